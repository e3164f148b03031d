"""Host time to build one layer's decode-step graph (issue 30): mlx-lm's SDPA over a KVCache
against the fused kernels over a compressed cache, no evaluation timed.

    python bench/host_cost.py                 # on a GPU: the real kernels
    python bench/host_cost.py --stub          # anywhere: kernel calls stand-ins that only make
                                              # their outputs, so what is timed is turboquant's Python
    python bench/host_cost.py --runs 3 --calls 2000 --context 4096 --scheme turbo5v4

In `generate_step` the host builds the next token's graph while the device runs this one, so a
step is host-bound once building it takes longer than running it: at short contexts an 8B
model's step runs in about 1.2 ms on the H200, and a compressed step's graph took 1.3-1.5 ms to
build against 0.5-0.8 ms for raw (docs/benchmarks.md, "One decode stream"). Rows, per layer
(32 query / 8 KV heads, head dim 128, bf16 on a GPU, float32 on the CPU; a context of `--context`
rows plus a 10-row raw tail):

- MLX's SDPA alone over K/V of `--context` rows;
- raw layer: `KVCache.update_and_fetch` of one row, the attention dispatch (mlx-lm's SDPA), trim;
- compressed layer: the same through a `TurboQuantKVCache` (its prepared step replayed);
- compressed attention: the replayed step alone (`TurboQuantKVCache.attention`);
- pass 1 through MLX's kernel object, as the prepared step calls it, and under `mx.compile`
  (GPU only: what one `mx.fast.cuda_kernel` call costs the host).

Each row is timed over `--calls` calls (graphs evaluated every 50 calls, outside the timing),
after 20 untimed ones; the table gives the median and min-max of `--runs` runs.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests"))  # kernel_support: the synthetic caches

from common import markdown_table, stamp  # noqa: E402

H, HQ, D, TAIL = 8, 32, 128, 10


class StubKernel:
    """Stands in for a kernel: makes its outputs (zeros), runs nothing."""

    def __init__(self, variant):
        self.name = variant.name

    def __call__(self, *, inputs, output_shapes, output_dtypes, **launch):
        import mlx.core as mx

        return [mx.zeros(s, dtype=d) for s, d in zip(output_shapes, output_dtypes)]


def per_call(fn, calls: int) -> float:
    """Microseconds of host time per call of `fn` (a graph build), its graphs evaluated apart."""
    import mlx.core as mx

    outs = [fn() for _ in range(20)]
    mx.eval(outs)
    outs, spent = [], 0.0
    for _ in range(calls):
        t0 = time.perf_counter()
        outs.append(fn())
        spent += time.perf_counter() - t0
        if len(outs) == 50:
            mx.eval(outs)
            outs = []
    mx.eval(outs)
    return spent / calls * 1e6


def cases(args) -> dict:
    """name -> a function that builds one call's graph."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    from kernel_support.synthetic import build_cache
    from turboquant import compressed_sdpa
    import turboquant.attention.kernels as kernels

    gpu = mx.default_device().type == mx.DeviceType.gpu
    if args.stub:
        import turboquant.attention.kernels.cuda as cuda

        kernels.select_backend = lambda: "cuda"
        cuda.kernel = StubKernel
    elif kernels.select_backend() is None:
        sys.exit("no fused kernels on this device: run on a GPU, or pass --stub")
    dtype = mx.bfloat16 if gpu else mx.float32
    scale = D ** -0.5
    cache = build_cache(args.scheme, H, D, dtype, args.context, seed=3, tail=TAIL)
    raw = KVCache()
    raw.update_and_fetch(mx.zeros((1, H, args.context + TAIL, D), dtype), mx.zeros((1, H, args.context + TAIL, D), dtype))
    q = mx.random.normal((1, HQ, 1, D)).astype(dtype)
    row = mx.random.normal((1, H, 1, D)).astype(dtype)
    mx.eval(q, row, cache.attention(q, scale))

    def layer(c):
        def run():
            keys, values = c.update_and_fetch(row, row)
            out = compressed_sdpa(q, keys, values, c, scale, None)
            c.trim(1)
            return out
        return run

    keys, values = (mx.random.normal((1, H, args.context, D)).astype(dtype) for _ in range(2))
    found = {"MLX's SDPA alone": lambda: mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale),
             "raw layer (update, SDPA, trim)": layer(raw),
             f"{args.scheme} layer (update, attention, trim)": layer(cache),
             f"{args.scheme} attention (the replayed step)": lambda: cache.attention(q, scale)}
    if not args.stub:
        step = cache._steps["decode"]
        k1, inputs, launch = step.kernels[0], list(step.inputs[0]), step.launch[0]
        compiled = mx.compile(lambda *a: tuple(k1(inputs=list(a), **launch)))
        found.update({"pass 1, MLX's kernel object (what the step replays)": lambda: k1(inputs=inputs, **launch),
                      "pass 1, MLX's kernel object under mx.compile": lambda: compiled(*inputs)})
    return found


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stub", action="store_true", help="kernel calls replaced by stand-ins (any device)")
    parser.add_argument("--scheme", default="turbo5v4")
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args(argv[1:])
    import mlx.core as mx

    found = cases(args)
    times: dict[str, list[float]] = {name: [] for name in found}
    for _ in range(args.runs):
        for name, fn in found.items():  # the rows take turns in every run
            times[name].append(per_call(fn, args.calls))
    rows = [[name, f"{statistics.median(v):.1f} ({min(v):.1f}-{max(v):.1f})"] for name, v in times.items()]
    kind = "stand-in kernels" if args.stub else "the fused kernels"
    print(f"Host microseconds per layer and call, {kind}, {args.context:,} stored rows + {TAIL} tail, "
          f"{mx.default_device()}: median (min-max) of {args.runs} runs of {args.calls} calls.\n")
    print(markdown_table(["graph built", "host us per call"], rows))
    print(f"\n{stamp(argv)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
