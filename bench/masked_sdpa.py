"""One-token attention over 8 rows of unequal length on the GPU: MLX's SDPA without a mask, with
a bool and an additive array mask, and `kernels.ragged_decode` (turboquant/attention/kernels/ragged.py).

    python bench/masked_sdpa.py            # the H200: 8 rows, 32 query / 8 KV heads, d=128, bfloat16

Per key count: 8 calls chained (each call's query the last call's output), then a sync; the
median and minimum of 50 such runs in us, and the host time to build one call's graph. Row i
attends over its first T - 3i keys. On the CPU the ragged kernel does not apply (no row).
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(1, str(Path(__file__).resolve().parent))

import mlx.core as mx  # noqa: E402

from common import evaluated_seconds  # noqa: E402
from turboquant.attention.kernels import ragged_decode  # noqa: E402

B, HQ, H, D, SCALE = 8, 32, 8, 128, 128 ** -0.5


def attend(form, q, k, v, masks, lengths):
    if form == "ragged":
        return ragged_decode(q, k, v, lengths, SCALE)
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=SCALE, mask=masks[form])


def main() -> None:
    print("| keys per row | form | 8 chained calls + sync, median (min) us | host build us/call |")
    print("|---|---|---|---|")
    for T in (80, 144, 1024):
        q, k, v = (mx.random.normal(s, key=mx.random.key(i)).astype(mx.bfloat16)
                   for i, s in enumerate(((B, HQ, 1, D), (B, H, T, D), (B, H, T, D))))
        lengths = mx.array([T - 3 * i for i in range(B)])
        bool_mask = (mx.arange(T)[None, :] < lengths[:, None])[:, None, None, :]
        masks = {"none": None, "bool": bool_mask, "additive": mx.where(bool_mask, 0.0, -mx.inf).astype(mx.bfloat16)}
        mx.eval(q, k, v, lengths, *[m for m in masks.values() if m is not None])
        for form in ("none", "bool", "additive", "ragged"):
            if form == "ragged" and attend(form, q, k, v, masks, lengths) is None:
                continue

            def chain():
                x = q
                for _ in range(8):
                    x = attend(form, x, k, v, masks, lengths)
                return x

            times = evaluated_seconds(chain, runs=50, warm=5)
            t0 = time.perf_counter()
            built = [chain() for _ in range(20)]
            build = (time.perf_counter() - t0) / 160
            mx.eval(built)
            print(f"| {T} | {form} | {1e6 * statistics.median(times):.0f} ({1e6 * min(times):.0f}) | {1e6 * build:.1f} |",
                  flush=True)


if __name__ == "__main__":
    main()
