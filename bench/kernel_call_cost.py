"""Host time of one attention call's pieces, built and not run: what a compressed layer's kernel
launches cost the host against MLX's fused SDPA and a plain op (issue 31, the 4k first token).

    python bench/kernel_call_cost.py --gpu            # the GPU: Llama-3.1-8B's attention shapes, bf16
    python bench/kernel_call_cost.py                  # the CPU: kernels stubbed (no launch cost)

On the H100 a compressed layer's question and first step took about 0.1 ms more host time to
build than a raw layer's (docs/benchmarks.md), more than this CPU's build of the same Python
path with the kernels stubbed. This times each piece alone over a 4k-token turbo4 cache of one
layer (8 KV heads, head dim 128, 32 query heads, 20 raw tail rows), `--calls` builds per
round and the median of `--rounds`, in microseconds per call; nothing is evaluated while timed.

Rows: a plain op; MLX's SDPA over raw K/V of the same length (what a raw layer launches); a
tiny `mx.fast.cuda_kernel` (two inputs, a one-line body: the launch's fixed cost); pass 1 and
pass 2 alone with the prepared step's inputs; the prepared step replayed (both launches); the
layer's attention call as the model makes it for a decode step (memo warm) and for a 16-token
question, warm and with the cache's prepared steps dropped first (what a question after a
restore pays: template found, inputs filled). On a GPU a second column times the launch:
`mx.async_eval` of 64 built calls at once, per call (the host's work at evaluation: kernel
arguments, graph nodes), which the build column leaves out.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))

from graph_build import force_cuda_path  # noqa: E402

TINY_SOURCE = "unsigned int i = threadIdx.x; out[i] = a[i] + b[i];"
LAUNCHED = 64  # built calls launched together per round (`launch_cost`)


def per_call(fn, calls: int, rounds: int) -> float:
    """Median over `rounds` of the host microseconds per call of `fn` (its results dropped)."""
    fn()
    times = []
    for _ in range(rounds):
        kept = []
        t0 = time.perf_counter()
        for _ in range(calls):
            kept.append(fn())
        times.append((time.perf_counter() - t0) / calls * 1e6)
        del kept
    return statistics.median(times)


def launch_cost(fn, calls: int, rounds: int) -> float:
    """Median over `rounds` of the host microseconds per call that `mx.async_eval` takes to
    launch `calls` built calls of `fn` together (the device finishes them after it returns; the
    wait is not timed). On a GPU this is the host's launch work per call: arguments, graph
    nodes, dependency tracking, which the build columns do not include."""
    import mlx.core as mx

    times = []
    for _ in range(rounds + 1):
        built = [fn() for _ in range(calls)]
        arrays = [a for out in built for a in (out if isinstance(out, (list, tuple)) else [out])]
        mx.synchronize()
        t0 = time.perf_counter()
        mx.async_eval(arrays)
        times.append((time.perf_counter() - t0) / calls * 1e6)
        mx.synchronize()
    return statistics.median(times[1:])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gpu", action="store_true", help="the GPU (else the CPU with stubbed kernels)")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--scheme", default="turbo4")
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args(argv)

    import mlx.core as mx

    if not args.gpu:
        force_cuda_path()
    from tests.kernel_support.synthetic import build_cache
    from turboquant.attention.kernels import cuda, steps

    dtype = mx.bfloat16 if args.gpu else mx.float32
    H, D, Hq, L = 8, 128, 32, 16
    scale = D ** -0.5
    cache = build_cache(args.scheme, H, D, dtype, args.tokens, seed=3, tail=20)
    q1 = mx.random.normal((1, Hq, 1, D)).astype(dtype)
    q16 = mx.random.normal((1, Hq, L, D)).astype(dtype)
    k = mx.random.normal((1, H, args.tokens + 20, D)).astype(dtype)
    v = mx.random.normal((1, H, args.tokens + 20, D)).astype(dtype)
    mx.eval(q1, q16, k, v)

    mx.eval(cache.attention(q1, scale))
    step = cache._steps["decode"]
    k1, k2 = step.template.kernels
    in1, in2 = (list(x) for x in step.inputs)
    po, pm, pl = k1(inputs=in1, **step.template.launch[0])
    in2[0:4] = [in1[step.template.slots[0]], po, pm, pl]
    mx.eval(po, pm, pl)

    rows: list[tuple[str, float]] = []

    def add(name: str, fn) -> None:
        launch = launch_cost(fn, LAUNCHED, args.rounds) if args.gpu else None
        rows.append((name, per_call(fn, args.calls, args.rounds), launch))

    add("plain op (q + 1)", lambda: q1 + 1)
    add("MLX SDPA over raw K/V (decode)", lambda: mx.fast.scaled_dot_product_attention(q1, k, v, scale=scale))
    add("MLX SDPA over raw K/V (16-token question)",
        lambda: mx.fast.scaled_dot_product_attention(q16, k, v, scale=scale, mask="causal"))
    if args.gpu:
        tiny = mx.fast.cuda_kernel(name="tqstore_bench_tiny", input_names=["a", "b"], output_names=["out"],
                                   source=TINY_SOURCE)
        a = mx.zeros((256,), dtype=mx.float32)
        add("tiny cuda_kernel (2 inputs)", lambda: tiny(inputs=[a, a], grid=(256, 1, 1), threadgroup=(256, 1, 1),
                                                        output_shapes=[(256,)], output_dtypes=[mx.float32]))
    add(f"pass 1 alone ({len(in1)} inputs)", lambda: k1(inputs=in1, **step.template.launch[0]))
    add(f"pass 2 alone ({len(in2)} inputs)", lambda: k2(inputs=in2, **step.template.launch[1]))
    call = (q1, cache._key_side, cache._value_side, cache._store.arrays, scale, cache._shifts,
            (cache._tail.arrays["keys"], cache._tail.arrays["values"]), cache.stored, cache.offset - cache.stored,
            None, steps.host.resolve(None), 0)
    add("prepared step replayed (both launches)", lambda: steps.run(cache._steps, cuda.kernel, *call))
    add("layer attention, decode step (memo warm)", lambda: cache.attention(q1, scale))

    def question_cold():
        cache._steps.clear()
        return cache.attention(q16, scale, "causal")

    add("layer attention, 16-token question (memo warm)", lambda: cache.attention(q16, scale, "causal"))
    add("layer attention, 16-token question (steps dropped)", question_cold)

    device = str(mx.default_device()) + (" (kernels real)" if args.gpu else " (kernels stubbed)")
    print(f"{args.tokens}-token {args.scheme} layer, {device}, {args.calls} calls x {args.rounds} rounds, "
          f"median host us per call: built (nothing evaluated); launched ({LAUNCHED} built calls, mx.async_eval, GPU)")
    print("| call | built, us | launched, us |")
    print("|---|---|---|")
    for name, us, launch in rows:
        print(f"| {name} | {us:.1f} | {'-' if launch is None else f'{launch:.1f}'} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
