"""A first token from the memory tier, asked again and again, split into its parts (issues 28, 31).

    python bench/first_token_parts.py --tokens 4096 16384 --schemes raw turbo4 turbo5v4     # GPU
    python bench/first_token_parts.py --layers 8 --hidden 256 --mlp 512 --heads 4 --kv-heads 2 \
        --head-dim 64 --tokens 1024 --schemes raw turbo4                                     # CPU

bench/restore_vs_recompute.py times one first token per fresh store, right after its save; this
asks the same question of one saved context `--runs` times (after `--warm` untimed asks), as
a server answering questions about one document does, the schemes taking turns ask by ask
(`in_turns`), and splits each answer's wall
time as that bench does: the store's restore, the question's forward (all but its last token),
the first-token step, and the rest (the lookup, building the caches, Python between them).
"To the token" is the answer's own `first_token_seconds`: restore, question and the wait for
the token, without the rest, and without what the step does after handing the token out.
Medians over the runs, and the median (min-max) over the rounds of each ask's time over raw's
ask of the same round; `--tree DIR` measures
another checkout (a baseline, side by side). The model is
restore_vs_recompute's: Llama-3.1-8B's shapes by default (random weights, bf16 on a GPU, float32
on the CPU), nothing downloaded. `--profile` prints cProfile's top functions of 3 more asks.
"""

from __future__ import annotations

import argparse
import cProfile
import contextlib
import io
import pstats
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))

from common import markdown_table, print_and_write  # noqa: E402
from restore_vs_recompute import QUESTION_TOKENS, model_arguments, write_model  # noqa: E402
from storage import use_tree  # noqa: E402

MARKER = "bench-first-token-parts"
PARTS = ("wall", "first", "restore", "question", "step", "rest")


def ask(engine, loaded, scheme: str, prompt: list[int]) -> dict[str, float]:
    """One `generate(..., max_tokens=1)` from memory: its wall seconds and their parts."""
    import mlx.core as mx

    mx.synchronize()
    t0 = time.perf_counter()
    answer = engine.generate(loaded, scheme, prompt, max_tokens=1)
    wall = time.perf_counter() - t0
    if answer.tier != "memory":
        raise RuntimeError(f"expected a restore from memory, got {answer.tier!r}")
    parts = {"wall": wall, "first": answer.first_token_seconds, "restore": answer.restore_seconds,
             "question": answer.prefill_seconds, "step": answer.generation_seconds}
    parts["rest"] = wall - parts["restore"] - parts["question"] - parts["step"]
    return parts


def context_and_prompt(rng: random.Random, tokens: int, vocab: int) -> tuple[list[int], list[int]]:
    """`tokens` random context tokens, and the prompt: the context and a QUESTION_TOKENS-token question."""
    context = [rng.randrange(1, vocab - 1) for _ in range(tokens)]
    return context, context + [rng.randrange(1, vocab - 1) for _ in range(QUESTION_TOKENS)]


@contextlib.contextmanager
def saved(root: Path, scheme: str, context: list[int], prompt: list[int], warm: int) -> Iterator[tuple]:
    """(engine, loaded model) over a fresh store under `root` holding `context` saved under
    `scheme` (the model at root/model), after `warm` untimed asks of `prompt`; the store is
    closed and removed after."""
    from tqstore.config import load_config
    from tqstore.engine.engine import Engine
    from tqstore.store.store import Store

    home = root / f"home-{len(context)}-{scheme}"
    store = Store.open(home, config=load_config(home))
    try:
        engine = Engine(store)
        loaded = engine.model(str(root / "model"))
        engine.save_tokens("ctx", loaded, context, scheme=scheme)
        for _ in range(warm):
            ask(engine, loaded, scheme, prompt)
        yield engine, loaded
    finally:
        store.close()
        shutil.rmtree(home, ignore_errors=True)


@contextlib.contextmanager
def all_saved(root: Path, schemes: list[str], context: list[int], prompt: list[int], warm: int
              ) -> Iterator[dict[str, tuple]]:
    """`saved` for every scheme at once: {scheme: (engine, loaded model)}."""
    with contextlib.ExitStack() as stack:
        yield {s: stack.enter_context(saved(root, s, context, prompt, warm)) for s in schemes}


def in_turns(opened: dict[str, tuple], runs: int, measure) -> dict[str, list]:
    """`measure(scheme, engine, loaded)` of every scheme `runs` times, in rounds of one per scheme
    (the order rotating from round to round), so that a scheme's figure over raw's compares
    measurements made next to each other in time: on the GPU machines one process's cells drifted
    apart by up to 1.5x in every part, restore and raw included, which per-scheme blocks of asks
    turned into ratios."""
    schemes = list(opened)
    made: dict[str, list] = {s: [] for s in schemes}
    for i in range(runs):
        turn = i % len(schemes)
        for scheme in schemes[turn:] + schemes[:turn]:
            made[scheme].append(measure(scheme, *opened[scheme]))
    return made


def profile_asks(opened: dict[str, tuple], prompt: list[int], tokens: int) -> None:
    """cProfile's top functions of 3 more asks per scheme."""
    for scheme, (engine, loaded) in opened.items():
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(3):
            engine.generate(loaded, scheme, prompt, max_tokens=1)
        profiler.disable()
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(20)
        print(f"-- {tokens} {scheme}\n" + out.getvalue(), flush=True)


def _ratios(mine: list[dict[str, float]], raw: list[dict[str, float]], part: str) -> str:
    """Median (min-max) over the rounds of `part` of this scheme's ask over raw's."""
    ratios = [m[part] / r[part] for m, r in zip(mine, raw)]
    return f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--schemes", nargs="+", default=["raw", "turbo4", "turbo5v4"])
    parser.add_argument("--runs", type=int, default=8)
    parser.add_argument("--warm", type=int, default=2, help="untimed asks first (kernel builds, caches)")
    model_arguments(parser)
    parser.add_argument("--profile", action="store_true", help="cProfile's top functions of 3 more asks per cell")
    parser.add_argument("--tree", type=Path, help="measure another checkout's tqstore and turboquant (a baseline)")
    parser.add_argument("--write", action="store_true", help="write the table into docs/benchmarks.md")
    args = parser.parse_args(argv)
    use_tree(args.tree)

    import mlx.core as mx

    gpu = mx.default_device().type == mx.DeviceType.gpu
    root = Path(tempfile.mkdtemp(prefix="tqstore-first-token-parts-"))
    rows, medians = [], {}
    try:
        write_model(root / "model", args, mx.bfloat16 if gpu else mx.float32)
        rng = random.Random(0)
        for tokens in args.tokens:
            context, prompt = context_and_prompt(rng, tokens, args.vocab)
            with all_saved(root, args.schemes, context, prompt, args.warm) as opened:
                runs = in_turns(opened, args.runs, lambda scheme, engine, loaded: ask(engine, loaded, scheme, prompt))
                if args.profile:
                    profile_asks(opened, prompt, tokens)
            for scheme in args.schemes:
                mine = medians[(tokens, scheme)] = {p: statistics.median(r[p] for r in runs[scheme]) * 1e3
                                                    for p in PARTS}
                wall = [r["wall"] * 1e3 for r in runs[scheme]]
                ratio = first = "-"
                if "raw" in runs:
                    ratio, first = (_ratios(runs[scheme], runs["raw"], p) for p in ("wall", "first"))
                rows.append([f"{tokens:,}", scheme, f"{mine['wall']:.1f} ({min(wall):.1f}-{max(wall):.1f})", ratio,
                             f"{mine['first']:.1f}", first] + [f"{mine[p]:.1f}" for p in PARTS[2:]])
                print(f"{tokens} {scheme}: " + ", ".join(f"{p} {mine[p]:.1f} ms" for p in PARTS), flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    tree = f"the tree at {args.tree}; " if args.tree else ""
    body = (f"{tree}{args.layers} layers (hidden {args.hidden}, {args.heads} query / {args.kv_heads} KV heads, "
            f"head dim {args.head_dim}), a {QUESTION_TOKENS}-token question asked {args.runs} times per scheme after "
            f"{args.warm} untimed, the schemes in turn; medians (ms), wall as median (min-max); 'x raw' is the median "
            f"(min-max) over the rounds of each ask's time over raw's ask of the same round:\n\n"
            + markdown_table(["tokens", "scheme", "first token", "x raw", "to the token", "x raw", "restore",
                              "question forward", "first-token step", "rest"], rows))
    return print_and_write(MARKER, body, args.write, argv)


if __name__ == "__main__":
    raise SystemExit(main())
