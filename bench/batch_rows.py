"""What a decode step costs as rows join it, on the GPU (issue 30): the matmuls of 8 layers of
Llama-3.1-8B shapes at M rows, and one model step over M raw rows of equal length, split into
the host's graph build, `mx.async_eval` and the wait for the device.

    python bench/batch_rows.py            # the H200 (random bfloat16 weights, bench/server_batch.py's model)

Matmuls: 20 chained calls then a sync, median of 30 runs, us per call. Steps: 40 steps run as
the server runs them (the next step built and launched before the last one's tokens are read),
per step the median host build, async_eval and wait, in ms; then the same steps each evaluated
alone (build, eval and sync in a row) for the device's time with nothing overlapped.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(1, str(ROOT))

import mlx.core as mx  # noqa: E402

from common import evaluated_seconds  # noqa: E402

ROWS = (1, 2, 4, 8, 16)
SHAPES = {"q, o (4096 x 4096)": (4096, 4096), "k, v (4096 x 1024)": (4096, 1024),
          "gate, up (4096 x 14336)": (4096, 14336), "down (14336 x 4096)": (14336, 4096),
          "head (4096 x 32000)": (4096, 32000)}


def matmul_table(dtype) -> list[str]:
    lines = ["| weight | " + " | ".join(f"M={m}" for m in ROWS) + " |", "|---|" + "---|" * len(ROWS)]
    for name, (k, n) in SHAPES.items():
        w = mx.random.normal((n, k), key=mx.random.key(1)).astype(dtype) * 0.01
        cells = []
        for m in ROWS:
            x = mx.random.normal((m, k), key=mx.random.key(2)).astype(dtype)
            mx.eval(w, x)

            def chain(x=x, w=w):
                return [x @ w.T for _ in range(20)]

            times = evaluated_seconds(chain, runs=30, warm=3)
            cells.append(f"{1e6 * statistics.median(times) / 20:.0f}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def step_table(model, vocab: int) -> list[str]:
    from mlx_lm.models.cache import make_prompt_cache

    lines = ["| rows | pipelined: build / async_eval / wait ms | alone: build / eval ms | tokens/s pipelined |",
             "|---|---|---|---|"]
    for m in (1, 2, 4, 8):
        caches = make_prompt_cache(model)
        prompt = mx.array([[(5 + 7 * r + j) % (vocab - 10) + 5 for j in range(16)] for r in range(m)])
        mx.eval(model(prompt, cache=caches))
        token = mx.zeros((m, 1), dtype=mx.int32)
        build, launch, wait = [], [], []
        launched = None
        t_all = time.perf_counter()
        for _ in range(40):
            t0 = time.perf_counter()
            nxt = mx.argmax(model(token, cache=caches)[:, -1, :], axis=-1).astype(mx.int32)
            t1 = time.perf_counter()
            mx.async_eval(nxt)
            t2 = time.perf_counter()
            if launched is not None:
                launched.tolist()
            t3 = time.perf_counter()
            build.append(t1 - t0)
            launch.append(t2 - t1)
            wait.append(t3 - t2)
            launched, token = nxt, nxt[:, None]
        launched.tolist()
        rate = 40 * m / (time.perf_counter() - t_all)
        alone_build, alone_eval = [], []
        for _ in range(20):
            t0 = time.perf_counter()
            nxt = mx.argmax(model(token, cache=caches)[:, -1, :], axis=-1).astype(mx.int32)
            t1 = time.perf_counter()
            nxt.tolist()
            alone_build.append(t1 - t0)
            alone_eval.append(time.perf_counter() - t1)
            token = nxt[:, None]
        med = lambda xs: 1e3 * statistics.median(xs)  # noqa: E731
        lines.append(f"| {m} | {med(build):.2f} / {med(launch):.2f} / {med(wait):.2f} | "
                     f"{med(alone_build):.2f} / {med(alone_eval):.2f} | {rate:.0f} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    args = parser.parse_args(argv)
    gpu = mx.default_device().type == mx.DeviceType.gpu
    dtype = mx.bfloat16 if gpu else mx.float32
    print(f"device: {mx.default_device()}, {dtype}", flush=True)
    print("\n".join(matmul_table(dtype)), flush=True)
    from mlx_lm.utils import load_model
    from server_batch import write_model

    with tempfile.TemporaryDirectory() as root:
        folder, vocab, described = write_model(argparse.Namespace(model="8b", layers=args.layers), Path(root))
        print(described, flush=True)
        model, _ = load_model(folder)
        print("\n".join(step_table(model, vocab)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
