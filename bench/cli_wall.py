"""What a fresh `tqstore` process costs beyond its work: wall time against its timed phases.

Each tree (`--tree LABEL=PATH`, a checkout with its own `.venv` holding tqstore installed
editable from it) runs fresh processes of `tqstore --version`, `ls`, `info`, `ask` and `ask --json`
on a tiny random-weight model folder (written as tests/model_folder.py does), N times each,
interleaved so that the shared machine's noise falls on every tree alike. The floors are fresh
`python -c "import mlx.core"` and `python -c "import mlx_lm"` (what any `ask` must import) from the
same interpreter. `ask --json` reports its timed phases
(model load, restore, question prefill, generation); wall / phases is the ratio issue 28 bounds
at 1.5x. Every figure is a range over the runs (min-max), never the best one.

    python bench/cli_wall.py --tree before=/path/to/old/checkout --tree after=. --runs 5 --write
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from common import markdown_table, replace_section, stamp  # noqa: E402

QUESTION = "Who pays for delays?"
DOCUMENT = "The contract says the seller pays. Clause seven covers delivery, payment and penalties. " * 20
# Floors: MLX alone, and the model stack any `ask` must import (mlx-lm pulls transformers).
FLOORS = {"import mlx.core": "import mlx.core", "import mlx_lm": "import mlx_lm"}
PHASES = ("model_seconds", "restore_seconds", "prefill_seconds", "generation_seconds")


def commands() -> dict[str, list[str]]:
    """The timed command lines (arguments after `tqstore`)."""
    return {
        "--version": ["--version"],
        "ls": ["ls"],
        "info": ["info", "doc"],
        "ask": ["ask", "doc", QUESTION, "--max-tokens", "4"],
        "ask --json": ["--json", "ask", "doc", QUESTION, "--max-tokens", "4"],
    }


def timed(argv: list[str], env: dict[str, str]) -> tuple[float, str]:
    """(wall seconds, stdout) of one fresh process; fails loudly on a non-zero exit."""
    t0 = time.perf_counter()
    out = subprocess.run(argv, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if out.returncode != 0:
        sys.exit(f"{' '.join(argv)} failed ({out.returncode}): {out.stderr.strip()[-2000:]}")
    return wall, out.stdout


def revision(tree: Path) -> str:
    out = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return out.stdout.strip() or "unknown"


def span(values: list[float]) -> str:
    lo, hi = min(values), max(values)
    return f"{lo:.2f}" if f"{lo:.2f}" == f"{hi:.2f}" else f"{lo:.2f}-{hi:.2f}"


def progress(line: str) -> None:
    """One measurement as it is taken, on stderr: a run cut off by a time limit (a lent GPU's
    per-command limit) still shows what it measured."""
    print(line, file=sys.stderr, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tree", action="append", metavar="LABEL=PATH",
                    help="a checkout with its .venv (repeatable; default: this one as `this`)")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--only", metavar="NAMES", help="a comma-separated subset of the commands, e.g. "
                    "`--only=--version,ls,ask --json` (the `=` because the value starts with a dash)")
    ap.add_argument("--write", action="store_true", help="write the table into docs/benchmarks.md")
    args = ap.parse_args()
    trees = dict(t.split("=", 1) for t in (args.tree or [f"this={Path(__file__).resolve().parents[1]}"]))
    trees = {label: Path(path).resolve() for label, path in trees.items()}

    from model_folder import write_model_folder

    work = Path(tempfile.mkdtemp(prefix="cli-wall-"))
    model = write_model_folder(work / "model")
    document = work / "doc.txt"
    document.write_text(DOCUMENT)
    # The default BLAS choice (`auto`) is part of what a user pays, so it is not pinned here.
    base = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "TQSTORE_BLAS_ACTIVE", "TQSTORE_BLAS")}
    envs, tools, pythons = {}, {}, {}
    for label, tree in trees.items():
        envs[label] = dict(base, TQSTORE_HOME=str(work / f"home-{label}"))
        tools[label] = str(tree / ".venv" / "bin" / "tqstore")
        pythons[label] = str(tree / ".venv" / "bin" / "python")
        wall, _ = timed([tools[label], "save", "doc", "--model", str(model), "--file", str(document)], envs[label])
        progress(f"{label}: save {wall:.2f} s")

    cmds = commands()
    if args.only:
        cmds = {name: cmds[name] for name in args.only.split(",")}
    walls = {(label, name): [] for label in trees for name in [*FLOORS, *cmds]}
    phases = {label: [] for label in trees}
    for _ in range(args.runs):
        for label in trees:
            for floor, code in FLOORS.items():
                walls[(label, floor)].append(timed([pythons[label], "-c", code], envs[label])[0])
                progress(f"{label}: {floor} {walls[(label, floor)][-1]:.2f} s")
            for name, argv in cmds.items():
                wall, out = timed([tools[label], *argv], envs[label])
                walls[(label, name)].append(wall)
                progress(f"{label}: tqstore {name} {wall:.2f} s")
                if name == "ask --json":
                    doc = json.loads(out)
                    phases[label].append((wall, sum(doc[p] for p in PHASES)))

    rows = []
    for name in [*FLOORS, *cmds]:
        row = [f"`python -c \"{FLOORS[name]}\"` (floor)" if name in FLOORS else f"`tqstore {name}`"]
        row += [span(walls[(label, name)]) for label in trees]
        rows.append(row)
    if "ask --json" in cmds:
        rows.append(["`ask --json` timed phases (model + restore + prefill + generation)"]
                    + [span([p for _, p in phases[label]]) for label in trees])
        rows.append(["`ask --json` wall - timed phases"]
                    + [span([w - p for w, p in phases[label]]) for label in trees])
        rows.append(["`ask --json` wall / timed phases"]
                    + [span([w / p for w, p in phases[label]]) + "x" for label in trees])
    header = ["fresh process (seconds, min-max over runs)", *[f"{label} (git {revision(trees[label])})" for label in trees]]
    table = markdown_table(header, rows)
    body = (f"{table}\n\n{args.runs} runs per cell, trees interleaved. {stamp(sys.argv)}")
    print(body)
    if args.write:
        replace_section(Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md", "bench-cli-wall", body)


if __name__ == "__main__":
    main()
