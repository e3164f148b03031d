"""First token of a fresh `tqstore ask` process on a GPU: fused kernels against plain ops, and
where the difference goes (kernel compilation, the Metal self-check, first allocations).

    python bench/gpu_first_token.py                       # 4k-token entry, turbo4, 3 runs per mode
    python bench/gpu_first_token.py --tokens 16384 --runs 5 --scheme turbo8v3

Part 1 saves one entry in a throwaway home, then starts `python -m tqstore_cli ask` as a fresh
process per run, alternating TQSTORE_KERNELS=1 (fused) and =0 (plain ops), and reads the answer's
JSON (first_token_seconds: restore + question prefill + first token; model_seconds) beside the
process's wall time. Part 2 (`--probe`, run in a fresh process per mode) times every phase of one
ask inside the process: imports, model load, restore, question prefill, then the first three
decode steps one by one, with every kernel launch synchronised and timed per variant, so the
first launch of each variant (NVRTC/Metal compilation and module load) stands apart from the
warm launches, and the Metal self-check (`metal.verdict`) is timed on its own. The table goes to
docs/benchmarks.md (section bench-gpu-first-token) and stdout; run it on the GPU machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import DEFAULT_MODEL, DEFAULT_TEXT, markdown_table, replace_section, stamp, text_tokens  # noqa: E402

DOCS = Path(__file__).resolve().parent.parent / "docs"
ENTRY = "gpu-first-token"
QUESTION = "Summarise the text above in one sentence."
MODES = {"fused": "1", "plain": "0"}


def cli(home: Path, *argv: str, kernels: str = "1") -> tuple[float, dict]:
    """One fresh `tqstore` process: (wall seconds, its --json document)."""
    env = dict(os.environ, TQSTORE_KERNELS=kernels)
    start = time.perf_counter()
    run = subprocess.run([sys.executable, "-m", "tqstore_cli", "--home", str(home), *argv, "--json"],
                         capture_output=True, text=True, env=env)
    wall = time.perf_counter() - start
    if run.returncode != 0:
        sys.exit(f"tqstore {' '.join(argv)} failed:\n{run.stderr}")
    return wall, json.loads(run.stdout)


def probe(home: Path, max_tokens: int) -> dict:
    """Every phase of one ask in this (fresh) process, seconds."""
    phases: dict[str, float] = {}
    t = time.perf_counter()
    import mlx.core as mx

    from tqstore.config import load_config
    from tqstore.engine.engine import Engine
    from tqstore.store.store import Store
    from turboquant.attention import kernels
    from turboquant.attention.kernels import host as khost
    phases["imports"] = time.perf_counter() - t

    compiling: list[float] = []  # launches that built a new kernel variant (JIT + module load)
    warm: list[float] = []
    launch = khost.launch

    def timed_launch(make_kernel, call, *args, **kw):
        built = make_kernel.cache_info().currsize
        t0 = time.perf_counter()
        out = launch(make_kernel, call, *args, **kw)
        mx.eval(out)
        (compiling if make_kernel.cache_info().currsize > built else warm).append(time.perf_counter() - t0)
        return out

    khost.launch = timed_launch
    verdicts: list[float] = []
    if kernels.select_backend() == "metal":
        from turboquant.attention.kernels import metal

        verdict = metal.verdict

        def timed_verdict(*args, **kw):
            t0 = time.perf_counter()
            out = verdict(*args, **kw)
            verdicts.append(time.perf_counter() - t0)
            return out

        metal.verdict = timed_verdict

    t = time.perf_counter()
    x = mx.zeros((64, 1024, 1024))  # 256 MiB: the allocator's first large buffer
    mx.eval(x)
    phases["first 256 MiB allocation"] = time.perf_counter() - t
    del x

    store = Store.open(home, config=load_config(home))
    engine = Engine(store)
    manifest = store.get(ENTRY)
    t = time.perf_counter()
    loaded = engine.model_for(ENTRY)
    phases["model load"] = time.perf_counter() - t
    prompt = list(manifest.tokens) + loaded.prompt.question_tokens(loaded.tokenizer, QUESTION)
    scheme = engine.entry_scheme(manifest, loaded)
    t = time.perf_counter()
    started = engine.start(loaded, scheme, prompt[:-1])
    mx.eval([a for c in started.caches for a in c.state])
    phases["restore"] = time.perf_counter() - t
    t = time.perf_counter()
    engine.prefill(loaded, started.caches, prompt[started.matched:-1])
    phases["question prefill"] = time.perf_counter() - t
    token = mx.array([[prompt[-1]]])
    for step in range(3):
        t = time.perf_counter()
        logits = loaded.model(token, cache=started.caches)
        token = mx.argmax(logits[:, -1], axis=-1)[:, None]
        mx.eval(token)
        phases[f"decode step {step + 1}"] = time.perf_counter() - t
    phases["launches that built a kernel"] = len(compiling)
    phases["their time (sum)"] = sum(compiling)
    phases["warm launch (median)"] = statistics.median(warm) if warm else 0.0
    phases["self-checks (sum)"] = sum(verdicts)
    store.close()
    return phases


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--text", type=Path, default=DEFAULT_TEXT)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--scheme", default="turbo4")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--probe", type=Path, help=argparse.SUPPRESS)  # internal: a home to probe
    parser.add_argument("--out", type=Path, default=DOCS / "benchmarks.md")
    args = parser.parse_args(argv[1:])
    if args.probe is not None:
        print(json.dumps(probe(args.probe, args.max_tokens)))
        return 0

    import mlx.core as mx

    if mx.default_device().type != mx.DeviceType.gpu:
        sys.exit("this benchmark needs an MLX GPU backend (CUDA or Metal)")
    home = Path(tempfile.mkdtemp(prefix="tqstore-gpu-first-token-"))
    document = home / "document.txt"
    from mlx_lm import load

    _, tokenizer = load(str(args.model))
    document.write_text(tokenizer.decode(text_tokens(tokenizer, args.text, args.tokens)))
    cli(home, "save", ENTRY, "--model", str(args.model), "--file", str(document), "--scheme", args.scheme)

    rows, runs = [], {m: [] for m in MODES}
    for _ in range(args.runs):
        for mode, flag in MODES.items():
            wall, doc = cli(home, "ask", ENTRY, QUESTION, "--max-tokens", str(args.max_tokens), kernels=flag)
            runs[mode].append((wall, doc))

    def span(values: list[float]) -> str:
        return f"{min(values):.2f}-{max(values):.2f}"

    for mode, results in runs.items():
        rows.append([mode, span([w for w, _ in results]), span([d["first_token_seconds"] for _, d in results]),
                     span([d["model_seconds"] for _, d in results]), span([d["restore_seconds"] for _, d in results]),
                     span([d["prefill_seconds"] for _, d in results])])
    gap = [f["first_token_seconds"] - p["first_token_seconds"]
           for (_, f), (_, p) in zip(runs["fused"], runs["plain"])]
    table = markdown_table(["mode", "process wall s", "first token s", "model load s", "restore s",
                            "question prefill s"], rows)

    phases = {}
    for mode, flag in MODES.items():
        run = subprocess.run([sys.executable, __file__, "--probe", str(home), "--max-tokens", str(args.max_tokens)],
                             capture_output=True, text=True, env=dict(os.environ, TQSTORE_KERNELS=flag), check=True)
        phases[mode] = json.loads(run.stdout.strip().splitlines()[-1])
    names = list(phases["fused"])
    breakdown = markdown_table(["phase (one fresh process)", "fused", "plain ops"],
                               [[n, *(f"{phases[m][n]:.3f}" if isinstance(phases[m][n], float) else phases[m][n]
                                      for m in MODES)] for n in names])
    body = (f"{table}\n\nFirst token, fused minus plain (same run): {span(gap)} s (target: within 0.5 s). "
            f"{args.tokens}-token {args.scheme} entry, {args.max_tokens} answer tokens, {args.runs} fresh processes "
            f"per mode, alternating.\n\n{breakdown}\n\n{stamp(argv)}")
    replace_section(args.out, "bench-gpu-first-token", body)
    print(body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
