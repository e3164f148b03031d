"""The compute half of the data path on the CPU: codec encode, question prefill over compressed
storage, and the BLAS under MLX.

    python bench/compute.py --openblas                        # 8k and 16k contexts, 3 runs each
    python bench/compute.py --openblas --contexts 4096 --runs 3

Encode: every layer of a context compressed with the MLX-ops reference path and with the numpy
stages (turboquant/codec/numpy_stages.py), side by side in each run. Prefill: a 32-token question and its first
token over a restored context, raw against each compressed scheme in the same run. The context
rows are the real model's keys and values of 1024 real tokens, repeated to the context length:
timings depend on shapes only (quality is docs/quality.md's job), and a 16k real prefill would
take this CPU ten minutes per run. Encode and prefill run on one BLAS thread and report CPU
seconds (the work itself; other jobs on a shared box disturb it far less than the wall clock) with
the wall-clock ratio beside them. BLAS: a float32 matmul in a fresh process per library, every core.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (DEFAULT_MODEL, DEFAULT_TEXT, load_real_model, markdown_table, replace_section,  # noqa: E402
                    stamp, text_tokens, use_openblas)

DOCS = Path(__file__).resolve().parent.parent / "docs"
SCHEMES = ["turbo4", "turbo8v3"]
QUESTION_TOKENS = 32
SEED_TOKENS = 1024
OPENBLAS = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0"


def span(values: list[float], fmt: str = "{:.2f}") -> str:
    """A range over runs (never the best one alone)."""
    lo, hi = min(values), max(values)
    return fmt.format(lo) if fmt.format(lo) == fmt.format(hi) else f"{fmt.format(lo)}-{fmt.format(hi)}"


def seed_rows(model, tokenizer, text: Path):
    """Per layer (keys, values) [1, H, 1024, D] of a real prefill."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    caches = make_prompt_cache(model)
    tokens = mx.array(text_tokens(tokenizer, text, SEED_TOKENS))
    for start in range(0, SEED_TOKENS, 512):
        model(tokens[None, start:start + 512], cache=caches)
    rows = [(c.keys[:, :, :SEED_TOKENS], c.values[:, :, :SEED_TOKENS]) for c in caches]
    mx.eval(rows)
    return rows


def context_caches(model, rows, scheme: str, n: int, compress: bool = True):
    """The scheme's caches holding n tokens (the seed rows repeated), compressed unless asked not to."""
    import mlx.core as mx

    from turboquant import TurboQuantKVCache, make_prompt_cache

    reps = -(-n // SEED_TOKENS)
    caches = make_prompt_cache(model, scheme)
    for cache, (k, v) in zip(caches, rows):
        cache.update_and_fetch(mx.tile(k, (1, 1, reps, 1))[:, :, :n], mx.tile(v, (1, 1, reps, 1))[:, :, :n])
    mx.eval([a for c in caches for a in c.state])
    if compress:
        for cache in caches:
            if isinstance(cache, TurboQuantKVCache):
                cache.compress()
    return caches


def encode_seconds(model, rows, scheme: str, n: int, on_host: bool) -> tuple[float, float]:
    """(wall, CPU) seconds to compress every layer of an n-token context (calibration fit included)."""
    from turboquant import TurboQuantKVCache
    from turboquant.codec import numpy_stages as host

    caches = context_caches(model, rows, scheme, n, compress=False)
    saved = host.on_host
    host.on_host = lambda: on_host
    try:
        start, cpu = time.perf_counter(), time.process_time()
        for cache in caches:
            if isinstance(cache, TurboQuantKVCache):
                cache.compress()
        return time.perf_counter() - start, time.process_time() - cpu
    finally:
        host.on_host = saved


def question_seconds(model, caches, question) -> tuple[float, float]:
    """(wall, CPU) seconds of question prefill + first token over the caches; the question's rows
    are trimmed after."""
    import mlx.core as mx

    start, cpu = time.perf_counter(), time.process_time()
    logits = model(question[None], cache=caches)
    mx.eval(mx.argmax(logits[0, -1]))
    elapsed = time.perf_counter() - start, time.process_time() - cpu
    for c in caches:
        c.trim(question.shape[0])
    return elapsed


def blas_gflops(env_extra: dict[str, str], size: int = 1024, reps: int = 5) -> float:
    """float32 matmul GFLOP/s in a fresh process (the BLAS is chosen at load time)."""
    code = (f"import time, mlx.core as mx\n"
            f"a = mx.random.normal(({size}, {size})); b = mx.random.normal(({size}, {size})); mx.eval(a @ b)\n"
            f"t = time.perf_counter()\n"
            f"for _ in range({reps}): mx.eval(a @ b)\n"
            f"print(2 * {size}**3 * {reps} / (time.perf_counter() - t) / 1e9)\n")
    dropped = ("LD_PRELOAD", "OPENBLAS_CORETYPE", "OPENBLAS_NUM_THREADS")  # every core, as a user runs it
    env = {k: v for k, v in os.environ.items() if k not in dropped} | env_extra
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    return float(out.stdout.strip())


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--openblas", action="store_true")
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--text", type=Path, default=DEFAULT_TEXT)
    parser.add_argument("--contexts", type=int, nargs="+", default=[8192, 16384])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--skip", nargs="*", default=[], choices=["encode", "prefill", "blas"])
    parser.add_argument("--out", type=Path, default=DOCS / "benchmarks.md")
    args = parser.parse_args(argv[1:])
    # One BLAS thread: CPU seconds then measure the work itself, which the other jobs on a shared
    # box disturb far less than the wall clock (the wall-clock ratios are printed beside them).
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    if args.openblas:
        use_openblas(argv)

    import mlx.core as mx

    model, tokenizer = load_real_model(args.model)
    rows = seed_rows(model, tokenizer, args.text)
    kv_elements = sum(k.size + v.size for k, v in rows) // SEED_TOKENS  # per token, K and V
    question = mx.array(text_tokens(tokenizer, args.text, SEED_TOKENS + QUESTION_TOKENS)[SEED_TOKENS:])
    provenance = stamp(argv)

    if "encode" not in args.skip:
        table = []
        for n in args.contexts:
            fp16 = kv_elements * n * 2
            for scheme in SCHEMES:
                wall, cpu = {True: [], False: []}, {True: [], False: []}
                for _ in range(args.runs):
                    for on_host in (False, True):
                        w, c = encode_seconds(model, rows, scheme, n, on_host)
                        wall[on_host].append(w)
                        cpu[on_host].append(c)
                table.append([n, scheme, f"{fp16 / 1e6:.0f}", span(cpu[False]), span(cpu[True]),
                              span([fp16 / s / 1e9 for s in cpu[False]], "{:.3f}"),
                              span([fp16 / s / 1e9 for s in cpu[True]], "{:.3f}"),
                              span([m / h for m, h in zip(cpu[False], cpu[True])], "{:.1f}x"),
                              span([fp16 / s / 1e9 for s in wall[True]], "{:.3f}")])
                print(table[-1], flush=True)
        body = markdown_table(["context", "scheme", "fp16-eq MB", "MLX ops CPU s", "numpy stages CPU s",
                               "MLX ops GB/s", "numpy stages GB/s", "speed-up", "numpy stages GB/s (wall)"], table)
        replace_section(args.out, "bench-encode", f"{body}\n\n{args.runs} runs per row, side by side. {provenance}")

    if "prefill" not in args.skip:
        table = []
        for n in args.contexts:
            caches = {s: context_caches(model, rows, s, n) for s in ["raw", *SCHEMES]}
            wall, cpu = {s: [] for s in caches}, {s: [] for s in caches}
            for c in caches.values():  # warm-up: first-call allocations and kernel setup
                question_seconds(model, c, question)
            for _ in range(args.runs):
                for s, c in caches.items():
                    w, u = question_seconds(model, c, question)
                    wall[s].append(w)
                    cpu[s].append(u)
            for s in SCHEMES:
                table.append([n, s, span(cpu["raw"]), span(cpu[s]),
                              span([c / r for c, r in zip(cpu[s], cpu["raw"])], "{:.2f}x"),
                              span([c / r for c, r in zip(wall[s], wall["raw"])], "{:.2f}x")])
                print(table[-1], flush=True)
            del caches
        body = markdown_table(["context", "scheme", "raw CPU s", "compressed CPU s", "compressed / raw (CPU)",
                               "compressed / raw (wall)"], table)
        replace_section(args.out, "bench-prefill", f"{body}\n\n{QUESTION_TOKENS}-token question + first token, "
                        f"{args.runs} runs, raw and compressed alternating. {provenance}")

    if "blas" not in args.skip and Path(OPENBLAS).exists():
        flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
        choices = [("bundled", {})]
        if " avx2" in flags:
            choices.append(("OpenBLAS HASWELL", {"LD_PRELOAD": OPENBLAS, "OPENBLAS_CORETYPE": "HASWELL"}))
        if " avx512f" in flags:
            choices.append(("OpenBLAS SKYLAKEX", {"LD_PRELOAD": OPENBLAS, "OPENBLAS_CORETYPE": "SKYLAKEX"}))
        gflops = {name: [] for name, _ in choices}
        for _ in range(args.runs):
            for name, env in choices:
                gflops[name].append(blas_gflops(env))
        table = [[name, span(v, "{:.1f}"), span([g / b for g, b in zip(v, gflops["bundled"])], "{:.0f}x")]
                 for name, v in gflops.items()]
        print(table, flush=True)
        body = markdown_table(["BLAS", "float32 matmul 1024^3 GFLOP/s", "x bundled"], table)
        replace_section(args.out, "bench-blas-gemm",
                        f"{body}\n\n{args.runs} fresh processes each, alternating. {provenance}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
