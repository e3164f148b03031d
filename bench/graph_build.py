"""Host time of a first token after a restore from memory: building (not running) the question's
forward and the first decode step, per scheme (issue 31).

    python bench/graph_build.py --gpu --tokens 4096 --schemes raw turbo4             # GPU
    python bench/graph_build.py --tokens 1024 --schemes raw turbo4 turbo5v4          # CPU

MLX builds a forward's graph in Python before anything runs, so on a GPU whose kernels finish
sooner than the host can describe them, the build is the first token's wait (docs/benchmarks.md:
the H100's 4k turbo4 asks launched as many kernels as raw's, with the same device time, yet
answered 1.26-1.32x later). Each run restores the saved context from the memory tier into new
caches, builds the question's forward (timed), evaluates it (timed), builds the first step
(timed) and evaluates it (timed); medians over `--runs` after three untimed, the schemes taking
turns ask by ask, and each compressed scheme's builds over raw's in the same round (median, min
to max).

On a GPU the model has Llama-3.1-8B's shapes (8 layers, random bf16 weights). On the CPU
(`--gpu` absent) the model is small (float32) and the CUDA path is forced with each kernel
replaced by zero outputs of its shapes, so the build of the compressed layers' real CUDA path,
and nothing of its kernels, is what the build columns time; the eval columns then mean nothing.
`--tree DIR` measures another checkout (a baseline, side by side).
"""

from __future__ import annotations

import argparse
import functools
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))

from first_token_parts import all_saved, context_and_prompt, in_turns  # noqa: E402
from restore_vs_recompute import model_arguments, write_model  # noqa: E402
from storage import use_tree  # noqa: E402

CPU_SHAPES = ["--hidden", "512", "--mlp", "512", "--heads", "16", "--kv-heads", "8", "--head-dim", "128",
              "--vocab", "1000"]


class ZeroKernel:
    """A CUDA kernel's stand-in on the CPU: zero outputs of the launch's shapes (no work)."""

    def __init__(self, variant):
        self.variant = variant

    def __call__(self, *, inputs, output_shapes, output_dtypes, **launch):
        import mlx.core as mx

        return [mx.zeros(s, dtype=d) for s, d in zip(output_shapes, output_dtypes)]

    def bound(self, input_dtypes, output_dtypes):
        return self


def force_cuda_path() -> None:
    """Route compressed attention through the CUDA host path with `ZeroKernel`s (CPU only)."""
    import turboquant.attention.kernels as kernels
    import turboquant.attention.kernels.cuda as cuda

    kernels.select_backend = lambda: "cuda"
    cuda.kernel = functools.lru_cache(maxsize=None)(ZeroKernel)


PARTS = ("question build", "question eval", "step build", "step eval")


def one_ask(engine, loaded, question) -> tuple[float, ...]:
    """Seconds to build and to evaluate the question's forward and the first step after one
    restore from memory (`PARTS`)."""
    import mlx.core as mx

    caches, _, _ = engine.prompt_cache("ctx")
    mx.eval([c.state for c in caches])
    t0 = time.perf_counter()
    logits = loaded.model(question, cache=caches)
    t1 = time.perf_counter()
    token = mx.argmax(logits[:, -1], axis=-1)
    mx.eval(token)
    t2 = time.perf_counter()
    step = loaded.model(token[None], cache=caches)
    t3 = time.perf_counter()
    mx.eval(step)
    t4 = time.perf_counter()
    return t1 - t0, t2 - t1, t3 - t2, t4 - t3


def interleaved_times(root: Path, schemes: list[str], context: list[int], prompt: list[int], runs: int
                      ) -> dict[str, list[tuple[float, ...]]]:
    """Each scheme's `one_ask` times, the schemes taking turns (`in_turns`), after three untimed
    rounds: a build over raw's is taken within a round."""
    import mlx.core as mx

    question = mx.array(prompt[len(context):])[None]
    with all_saved(root, schemes, context, prompt, 1) as opened:
        made = in_turns(opened, runs + 3, lambda scheme, engine, loaded: one_ask(engine, loaded, question))
    return {scheme: times[3:] for scheme, times in made.items()}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gpu", action="store_true", help="the GPU, Llama-3.1-8B's shapes (else the CPU, small)")
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--schemes", nargs="+", default=["raw", "turbo4", "turbo5v4"])
    parser.add_argument("--runs", type=int, default=40)
    parser.add_argument("--tree", type=Path, help="measure another checkout's tqstore and turboquant (a baseline)")
    model_arguments(parser)
    args = parser.parse_args(argv if "--gpu" in argv else CPU_SHAPES + argv)
    use_tree(args.tree)

    import mlx.core as mx

    if not args.gpu:
        force_cuda_path()
    root = Path(tempfile.mkdtemp(prefix="tqstore-graph-build-"))
    try:
        write_model(root / "model", args, mx.bfloat16 if args.gpu else mx.float32)
        context, prompt = context_and_prompt(random.Random(0), args.tokens, args.vocab)
        made = interleaved_times(root, args.schemes, context, prompt, args.runs)
        for scheme, asks in made.items():
            line = ", ".join(f"{name} {statistics.median(a[k] for a in asks) * 1e3:.3f} ms"
                             for k, name in enumerate(PARTS))
            if "raw" in made and scheme != "raw":
                for k in (0, 2):  # the builds over raw's, round by round
                    over = [(a[k] - r[k]) * 1e3 for a, r in zip(asks, made["raw"])]
                    line += (f", {PARTS[k]} over raw {statistics.median(over):.3f} ms "
                             f"({min(over):.3f} to {max(over):.3f})")
            print(f"{args.tokens} {scheme}: {line}", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
