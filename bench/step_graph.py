"""What one decode step over stored rows is made of, compressed against raw: the MLX operations
its graph holds (by primitive), the host's time to build it (unprofiled) against its evaluation,
the step's time when steps are pipelined as mlx-lm's `generate_step` runs them (the figure that
sets tokens/s), and where the build's Python time goes under cProfile (issues 28, 30, 31).

    python bench/step_graph.py --tokens 16 512 4096 16384 --schemes raw turbo5v4 turbo4 --steps 50

The schemes alternate within each round, so every ratio to raw compares steps run side by side.
`--tree DIR` measures another checkout's turboquant (run it and this tree in alternate processes).
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
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from question_prefill import fill_caches, llama_config  # noqa: E402
from storage import span, use_tree  # noqa: E402


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


def sync_steps(model, caches, token, steps: int) -> tuple[list[float], list[float]]:
    """Per step, unprofiled: (seconds building the graph, seconds evaluating it)."""
    import mlx.core as mx

    builds, evals = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        out = step(model, caches, token)
        t1 = time.perf_counter()
        mx.eval(out)
        builds.append(t1 - t0)
        evals.append(time.perf_counter() - t1)
    return builds, evals


def pipelined_steps(model, caches, token, steps: int) -> float:
    """Seconds per step when each step's graph is built while the GPU runs the one before, as
    mlx-lm's `generate_step` runs them (the next token is the previous step's output)."""
    import mlx.core as mx

    y = step(model, caches, token)
    mx.async_eval(y)
    t0 = time.perf_counter()
    for _ in range(steps):
        nxt = step(model, caches, y.reshape(1, 1))
        mx.async_eval(nxt)
        y.item()
        y = nxt
    y.item()
    return (time.perf_counter() - t0) / steps


def profiled(model, caches, token, steps: int, profile_rows: int) -> tuple[float, str]:
    """(mean build seconds with cProfile on, the profile's top rows by own time)."""
    import mlx.core as mx

    build = 0.0
    profiler = cProfile.Profile()
    for _ in range(steps):
        t0 = time.perf_counter()
        profiler.enable()
        out = step(model, caches, token)
        profiler.disable()
        build += time.perf_counter() - t0
        mx.eval(out)
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(profile_rows)
    return build / steps, "\n".join(line for line in text.getvalue().splitlines() if line.strip())


def context(model, schemes: list[str], tokens: int, steps: int, rounds: int, profile_rows: int) -> str:
    """One context length: every scheme's caches filled, then `rounds` rounds in which each
    scheme in turn runs `steps` synchronous and `steps` pipelined steps (side by side, so each
    ratio to raw is within one round)."""
    import mlx.core as mx

    token = mx.array([[17]])
    caches = {s: fill_caches(model, s, tokens, seed=tokens) for s in schemes}
    counts = {}
    for s, c in caches.items():
        for _ in range(5):  # warm: kernels built, buffers sized
            mx.eval(step(model, c, token))
        counts[s] = primitives(step(model, c, token))
    rows = {s: {"build": [], "eval": [], "pipe": []} for s in schemes}
    for _ in range(rounds):
        for s in schemes:
            builds, evals = sync_steps(model, caches[s], token, steps)
            rows[s]["build"].append(1e3 * statistics.median(builds))
            rows[s]["eval"].append(1e3 * statistics.median(evals))
            rows[s]["pipe"].append(1e3 * pipelined_steps(model, caches[s], token, steps))
    lines = [f"## {tokens} tokens: {rounds} rounds of {steps} steps per scheme (ms; min-max over rounds)", "",
             "| scheme | operations | graph build (median step) | eval + wait | pipelined step | pipelined x raw |",
             "|---|---|---|---|---|---|"]
    base = rows.get("raw", {}).get("pipe")
    for s in schemes:
        r = rows[s]
        ratio = "-" if base is None else span([b / p for b, p in zip(base, r["pipe"])]) + "x"
        lines.append(f"| {s} | {sum(counts[s].values())} | {span(r['build'])} | {span(r['eval'])} | {span(r['pipe'])} "
                     f"| {ratio} |")
    lines.append("")
    for s in schemes:
        ops = ", ".join(f"{name} {n}" for name, n in counts[s].most_common())
        lines.append(f"{s} operations: {ops}")
    if profile_rows:
        for s in schemes:
            build, top = profiled(model, caches[s], token, steps, profile_rows)
            lines += ["", f"### {s}: graph build {1e3 * build:.3f} ms with cProfile on", top]
    del caches
    mx.clear_cache()
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[512, 16384])
    parser.add_argument("--schemes", nargs="+", default=["raw", "turbo5v4"])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--profile-rows", type=int, default=25, help="0: no profile")
    parser.add_argument("--tree", type=Path, default=None,
                        help="measure the tqstore and turboquant of another checkout (a baseline; PYTHONPATH does "
                             "not reach past this repository's root, which the bench's imports put first)")
    args = parser.parse_args(argv)
    use_tree(args.tree)
    import mlx.core as mx
    from mlx_lm.models import llama

    model = llama.Model(llama.ModelArgs.from_dict(llama_config(args.layers)))
    model.set_dtype(mx.bfloat16 if mx.default_device().type == mx.DeviceType.gpu else mx.float32)
    mx.eval(model.parameters())
    for tokens in args.tokens:
        print(context(model, args.schemes, tokens, args.steps, args.rounds, args.profile_rows), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
