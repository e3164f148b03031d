"""Where a repeated first token's time goes on the GPU: the kernels of each ask, counted and timed
by Nsight Compute, beside the ask's wall time (issues 28, 31).

    python bench/first_token_trace.py --tokens 4096 16384 --schemes raw turbo4 --runs 2   # CUDA, ncu on PATH

Each scheme runs in its own process under `ncu --profile-from-start off`, which profiles only
between the process's cudaProfilerStart and cudaProfilerStop: the asks `bench/first_token_parts.py`
times (the same model, a context of the same length), after its untimed warm asks, not the save. ncu
replays each kernel alone with the caches flushed, so its durations are each kernel's device
time from cold caches (an upper bound of what the ask's kernels cost together) and the asks'
wall time under it means nothing: compare the schemes' kernel counts and summed device time, and
take wall times from `first_token_parts.py`. Where two schemes' kernels cost the same and their
wall times differ, the difference is the host's (Python, MLX's graph, the launches). `--from DIR`
renders the table from the CSV files (`<scheme>-<tokens>.csv`) an earlier run kept with `--keep DIR`.
"""

from __future__ import annotations

import argparse
import csv
import ctypes
import ctypes.util
import io
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))

from common import markdown_table, print_and_write  # noqa: E402
from first_token_parts import ask, context_and_prompt, saved  # noqa: E402
from restore_vs_recompute import QUESTION_TOKENS, model_arguments, write_model  # noqa: E402
from storage import use_tree  # noqa: E402

MARKER = "bench-first-token-trace"
METRIC = "gpu__time_duration.sum"


def cudart() -> ctypes.CDLL:
    """The CUDA runtime library, for cudaProfilerStart/Stop."""
    names = [ctypes.util.find_library("cudart"), "libcudart.so", "libcudart.so.13", "libcudart.so.12"]
    names += [str(p) for p in sorted(Path("/usr/local/cuda/lib64").glob("libcudart.so*"))]
    for name in filter(None, names):
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    raise SystemExit("no CUDA runtime library (libcudart) found")


def child(args) -> int:
    """Save the context, ask `--warm` times, then `--runs` asks between the profiler's start and stop."""
    import mlx.core as mx

    root = Path(tempfile.mkdtemp(prefix="tqstore-first-token-trace-"))
    try:
        write_model(root / "model", args, mx.bfloat16)
        context, prompt = context_and_prompt(random.Random(0), args.tokens[0], args.vocab)
        with saved(root, args.child, context, prompt, args.warm) as (engine, loaded):
            runtime = cudart()
            mx.synchronize()
            runtime.cudaProfilerStart()
            walls = [ask(engine, loaded, args.child, prompt)["wall"] for _ in range(args.runs)]
            mx.synchronize()
            runtime.cudaProfilerStop()
        print(f"wall under ncu (not a timing): {statistics.median(walls) * 1e3:.1f} ms", file=sys.stderr)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


def kernels_of(path: Path) -> list[tuple[str, float]]:
    """(kernel name, device ns) of every kernel in an `ncu --csv` output."""
    found, header = [], None
    for row in csv.reader(io.StringIO(path.read_text())):
        if row and row[0] == "ID":
            header = row
        elif header and len(row) == len(header):
            r = dict(zip(header, row))
            if r["Metric Name"] == METRIC:
                found.append((r["Kernel Name"], float(r["Metric Value"].replace(",", ""))))
    return found


def short(name: str) -> str:
    """A kernel's name without its template arguments and parameters."""
    return re.sub(r"[<(].*", "", name).removeprefix("void ").removeprefix("mlx::custom_kernel_")


def row(scheme: str, tokens: int, path: Path, runs: int) -> list[str]:
    found = kernels_of(path)
    if not found:
        raise SystemExit(f"{path}: no kernel measured (was the profiler range reached?)")
    total: dict[str, float] = {}
    for name, ns in found:
        total[short(name)] = total.get(short(name), 0.0) + ns
    top = sorted(total.items(), key=lambda kv: kv[1], reverse=True)[:4]
    return [f"{tokens:,}", scheme, f"{len(found) / runs:.0f}", f"{sum(ns for _, ns in found) / runs / 1e6:.2f}",
            "; ".join(f"{n[:36]} {ns / runs / 1e3:.0f}" for n, ns in top)]


def profile(scheme: str, tokens: int, args, argv: list[str], out: Path) -> None:
    """Run one scheme's asks under ncu, its CSV into `out`."""
    command = ["ncu", "--profile-from-start", "off", "--metrics", METRIC, "--csv", sys.executable, argv[0],
               *argv[1:], "--child", scheme, "--tokens", str(tokens)]
    with open(out, "w") as f:
        run = subprocess.run(command, stdout=f, stderr=subprocess.PIPE, text=True)
    if run.returncode != 0:
        raise SystemExit(f"ncu failed ({run.returncode}): {run.stderr[-3000:]}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096])
    parser.add_argument("--schemes", nargs="+", default=["raw", "turbo4"])
    parser.add_argument("--runs", type=int, default=8)
    parser.add_argument("--warm", type=int, default=2, help="untimed asks first (kernel builds, caches)")
    model_arguments(parser)
    parser.add_argument("--tree", type=Path, help="measure another checkout's tqstore and turboquant (a baseline)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--keep", type=Path, help="keep ncu's CSV files here")
    parser.add_argument("--from", dest="source", type=Path, help="render the table from the CSVs of --keep DIR")
    parser.add_argument("--write", action="store_true", help="write the table into docs/benchmarks.md")
    args = parser.parse_args(argv[1:])
    use_tree(args.tree)
    if args.child:
        return child(args)
    work = args.source or args.keep or Path(tempfile.mkdtemp(prefix="tqstore-trace-"))
    try:
        if args.source is None:
            if shutil.which("ncu") is None:
                raise SystemExit("ncu (Nsight Compute) is not on PATH")
            work.mkdir(parents=True, exist_ok=True)
            passed = [a for a in argv if a != "--write"]
            for t in args.tokens:
                for s in args.schemes:
                    profile(s, t, args, passed, work / f"{s}-{t}.csv")
        rows = [row(s, t, work / f"{s}-{t}.csv", args.runs) for t in args.tokens for s in args.schemes]
    finally:
        if args.source is None and args.keep is None:
            shutil.rmtree(work, ignore_errors=True)
    tree = f"the tree at {args.tree}; " if args.tree else ""
    body = (f"{tree}{args.layers} layers (hidden {args.hidden}, {args.heads} query / {args.kv_heads} KV heads, head "
            f"dim {args.head_dim}), a {QUESTION_TOKENS}-token question asked {args.runs} times after {args.warm} "
            "untimed, under ncu (each kernel alone, caches flushed); per ask:\n\n"
            + markdown_table(["tokens", "scheme", "kernels", "device ms (ncu)", "top kernels (us)"], rows))
    return print_and_write(MARKER, body, args.write, argv)


if __name__ == "__main__":
    raise SystemExit(main())
