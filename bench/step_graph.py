"""What one decode step over stored rows is made of, compressed against raw: the MLX operations
its graph holds (by primitive), the host's time to build it against the whole step, and where the
build's Python time goes (issues 28, 30, 31: a turbo5v4 step costs about 2 ms more than raw's on
the H200 while its attention kernels are within 1.15x of SDPA).

    python bench/step_graph.py --tokens 512 16384 --schemes raw turbo5v4 --steps 50

The model is bench/question_prefill.py's (Llama-3.1-8B's shapes, --layers of them, random
weights) with its caches filled the same way; each step is one token's forward to the argmax, the
rows appended as a decode stream appends them (a trim would drop a short context's decoded
mirror). Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import io
import pstats
import re
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from question_prefill import fill_caches, llama_config  # noqa: E402


def step(model, caches, token):
    import mlx.core as mx

    return mx.argmax(model(token, cache=caches)[:, -1], axis=-1)


def primitives(out) -> collections.Counter:
    """The step's unevaluated graph, counted by primitive (`mx.export_to_dot`)."""
    import mlx.core as mx

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "step.dot"
        mx.export_to_dot(str(path), out)
        text = path.read_text()
    return collections.Counter(re.findall(r'label\s*=\s*"([A-Za-z][A-Za-z0-9_]*)', text))


def cell(model, scheme: str, tokens: int, steps: int, profile_rows: int) -> str:
    import mlx.core as mx

    caches = fill_caches(model, scheme, tokens, seed=tokens)
    token = mx.array([[17]])
    for _ in range(5):  # warm: kernels built, buffers sized
        mx.eval(step(model, caches, token))
    counts = primitives(step(model, caches, token))
    build = total = 0.0
    profiler = cProfile.Profile()
    for _ in range(steps):
        t0 = time.perf_counter()
        profiler.enable()
        out = step(model, caches, token)
        profiler.disable()
        t1 = time.perf_counter()
        mx.eval(out)
        t2 = time.perf_counter()
        build, total = build + t1 - t0, total + t2 - t0
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(profile_rows)
    top = "\n".join(line for line in text.getvalue().splitlines() if line.strip())
    ops = ", ".join(f"{name} {n}" for name, n in counts.most_common())
    del caches
    mx.clear_cache()
    return (f"## {scheme} at {tokens} tokens\nstep {1e3 * total / steps:.3f} ms, of which graph build "
            f"{1e3 * build / steps:.3f} ms (cProfile on); {sum(counts.values())} operations: {ops}\n{top}\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[512, 16384])
    parser.add_argument("--schemes", nargs="+", default=["raw", "turbo5v4"])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--profile-rows", type=int, default=25)
    args = parser.parse_args(argv)
    import mlx.core as mx
    from mlx_lm.models import llama

    model = llama.Model(llama.ModelArgs.from_dict(llama_config(args.layers)))
    model.set_dtype(mx.bfloat16 if mx.default_device().type == mx.DeviceType.gpu else mx.float32)
    mx.eval(model.parameters())
    for tokens in args.tokens:
        for scheme in args.schemes:
            print(cell(model, scheme, tokens, args.steps, args.profile_rows), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
