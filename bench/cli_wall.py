"""What a fresh `tqstore` process costs beyond its work: wall time against its timed phases.

Each tree (`--tree LABEL=PATH`) runs fresh processes of `tqstore --version`, `ls`, `info`, `ask`
and `ask --json` (as `python -m tqstore_cli`, what the console script runs) on one model folder,
N times each, interleaved so that the shared machine's noise falls on every tree alike. A tree
with its own `.venv` runs on that interpreter; a bare source tree (`git archive` of another
revision) runs on this one with the tree first on PYTHONPATH. Beside each command:

- floors, fresh `python -c "import mlx.core"` and `python -c "import mlx_lm"` (mlx-lm's package
  imports transformers: any command that runs a model pays it);
- its work: the same command run in one process after a first run of it (imports done, model
  files in the page cache), so what is left of the fresh process's wall is start-up;
- for `ask --json`, its timed phases (model load, restore, question prefill, generation): issue 28
  bounds wall / phases at 1.5x.

Models (`--model`): `tiny`, the tests' random-weight qwen2 (phases of a tenth of a second: the
start-up dominates on any machine); `llama8b`, Llama-3.1-8B's shapes (`--layers`, default 8) with
random weights as bench/restore_vs_recompute.py builds them (bf16 on a GPU, float32 on the CPU);
`qwen0.5b`, Qwen2.5-0.5B's shapes through the same builder. `auto` (the default) is llama8b on a
GPU and tiny on the CPU. The document is `--context-tokens` random words for the built models.
The default BLAS choice (`auto`) is what a user pays, so it is not pinned. Every figure is a
range over the runs (min-max), never the best one. Each measurement is printed as it is taken;
`--max-seconds` stops starting new runs so that a lent GPU's per-command limit still gets a table.

    python bench/cli_wall.py --tree before=/tmp/main-tree --tree after=. --runs 5 --write
    python bench/cli_wall.py --model qwen0.5b --runs 5 --write        # a realistic size on the CPU
    python bench/cli_wall.py --write                                  # H200: 8 layers of Llama-3.1-8B
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
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
FLOORS = {"import mlx.core": "import mlx.core", "import mlx_lm": "import mlx_lm"}
PHASES = ("model_seconds", "restore_seconds", "prefill_seconds", "generation_seconds")
MODELS = ("auto", "tiny", "llama8b", "qwen0.5b")
# Shapes for restore_vs_recompute's Llama builder (vocabulary 32,000 for Llama: it only sizes the head).
SHAPES = {
    "llama8b": {"hidden": 4096, "mlp": 14336, "heads": 32, "kv_heads": 8, "head_dim": 128, "vocab": 32000},
    "qwen0.5b": {"hidden": 896, "mlp": 4864, "heads": 14, "kv_heads": 2, "head_dim": 64, "vocab": 151936},
}
DEFAULT_LAYERS = {"llama8b": 8, "qwen0.5b": 24}
# Runs one command in-process, first untimed (imports, page cache), then timed: its work alone.
# Freeing what the command loaded is left out where main() can hand it over (as the console
# script does since issue 28: it ends with os._exit).
WORK = """
import contextlib, inspect, io, json, sys, time
from tqstore_cli.main import main
argv, runs = json.loads(sys.argv[1]), int(sys.argv[2])
kept = [] if "keep" in inspect.signature(main).parameters else None
seconds = []
for i in range(runs + 1):
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        t0, c0 = time.perf_counter(), time.process_time()
        code = main(argv) if kept is None else main(argv, keep=kept)
        seconds.append((time.perf_counter() - t0, time.process_time() - c0))
    if kept:
        kept.clear()
    if code:
        sys.exit(f"{argv} exited {code}")
print(json.dumps(seconds[1:]))
"""


def commands(question: str) -> dict[str, list[str]]:
    """The timed command lines (arguments after `tqstore`)."""
    return {
        "--version": ["--version"],
        "ls": ["ls"],
        "info": ["info", "doc"],
        "ask": ["ask", "doc", question, "--max-tokens", "4"],
        "ask --json": ["--json", "ask", "doc", question, "--max-tokens", "4"],
    }


class Tree:
    """How to run one checkout's tqstore: its interpreter and environment."""

    def __init__(self, label: str, path: Path, work: Path, base_env: dict[str, str]) -> None:
        self.label, self.path = label, path
        venv = path / ".venv" / "bin" / "python"
        self.python = str(venv) if venv.exists() else sys.executable
        self.env = dict(base_env, TQSTORE_HOME=str(work / f"home-{label}"))
        if not venv.exists():
            # A bare source tree: its packages first on the path; `cli/` installs as tqstore_cli.
            shim = work / f"shim-{label}"
            shim.mkdir(exist_ok=True)
            (shim / "tqstore_cli").symlink_to(path / "cli", target_is_directory=True)
            self.env["PYTHONPATH"] = os.pathsep.join([str(path), str(shim), base_env.get("PYTHONPATH", "")])

    def tqstore(self, *argv: str) -> list[str]:
        return [self.python, "-m", "tqstore_cli", *argv]

    def revision(self) -> str:
        out = subprocess.run(["git", "-C", str(self.path), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True)
        return f"git {out.stdout.strip()}" if out.returncode == 0 else "not a git checkout: see its label"


def timed(argv: list[str], env: dict[str, str], cwd: Path) -> tuple[float, float, str]:
    """(wall seconds, CPU seconds, stdout) of one fresh process; fails loudly on a non-zero exit.
    The CPU time (user + system of the child) is what the shared machine's load inflates least."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    out = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if out.returncode != 0:
        sys.exit(f"{' '.join(argv)} failed ({out.returncode}): {out.stderr.strip()[-2000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, out.stdout


def span(values: list[float], unit: str = "") -> str:
    if not values:
        return "-"
    lo, hi = min(values), max(values)
    return f"{lo:.2f}{unit}" if f"{lo:.2f}" == f"{hi:.2f}" else f"{lo:.2f}-{hi:.2f}{unit}"


def progress(line: str) -> None:
    """One measurement as it is taken, on stderr: a run cut off by a time limit (a lent GPU's
    per-command limit) still shows what it measured."""
    print(f"[{time.strftime('%H:%M:%S')}] {line}", file=sys.stderr, flush=True)


def gpu() -> bool:
    import mlx.core as mx

    return mx.default_device().type == mx.DeviceType.gpu


def build_model(kind: str, layers: int, folder: Path, context_tokens: int) -> tuple[str, str, str]:
    """Write the model folder; returns (document, question, a description of the model)."""
    if kind == "tiny":
        from model_folder import write_model_folder

        write_model_folder(folder)
        return DOCUMENT, QUESTION, "the tests' tiny random-weight qwen2 (tests/model_folder.py)"
    import mlx.core as mx
    from restore_vs_recompute import write_model

    shape = argparse.Namespace(layers=layers, **SHAPES[kind])
    dtype = mx.bfloat16 if gpu() else mx.float32
    write_model(folder, shape, dtype)
    rng = random.Random(0)
    # restore_vs_recompute's word-level tokenizer: one token per word w1 ... w{vocab-2}.
    words = " ".join(f"w{rng.randrange(1, shape.vocab - 1)}" for _ in range(context_tokens))
    question = " ".join(f"w{rng.randrange(1, shape.vocab - 1)}" for _ in range(16))
    name = {"llama8b": "Llama-3.1-8B", "qwen0.5b": "Qwen2.5-0.5B"}[kind]
    size = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
    return words, question, (f"{layers} layer{'s' if layers != 1 else ''} of {name}'s shapes (hidden {shape.hidden}, {shape.heads} query / "
                             f"{shape.kv_heads} KV heads, MLP {shape.mlp}, vocabulary {shape.vocab:,}), random "
                             f"{str(dtype).rsplit('.', 1)[-1]} weights ({size / 1e9:.2f} GB), a {context_tokens}-token "
                             "document of random words, a 16-token question")


def work_seconds(tree: Tree, argv: list[str], runs: int, cwd: Path) -> list[tuple[float, float]]:
    """(wall, CPU) seconds of `argv`'s work alone: run in one process after a first, untimed run."""
    out = subprocess.run([tree.python, "-c", WORK, json.dumps(argv), str(runs)], env=tree.env, cwd=cwd,
                         capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"in-process {argv} failed: {out.stderr.strip()[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def blas_environment(env: dict[str, str]) -> dict[str, str]:
    """The environment a fresh command ends up in under the default BLAS choice (`auto` restarts
    model commands on OpenBLAS where it is installed): in-process runs must not restart."""
    from tqstore.models import blas

    library, _ = blas.resolve(env.get("TQSTORE_BLAS", "auto"))
    return dict(env, **blas.openblas_environment()) if library == "openblas" else dict(env, TQSTORE_BLAS="bundled")


def parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tree", action="append", metavar="LABEL=PATH",
                    help="a checkout: with its .venv, or a bare source tree (repeatable; default: this one)")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--model", choices=MODELS, default="auto",
                    help="the model's size (default auto: llama8b on a GPU, tiny on the CPU)")
    ap.add_argument("--layers", type=int, help="layers of llama8b / qwen0.5b (default 8 / 24)")
    ap.add_argument("--context-tokens", type=int, default=1024, help="the stored document's length (built models)")
    ap.add_argument("--only", metavar="NAMES", help="a comma-separated subset of the commands, e.g. "
                    "`--only=--version,ls,ask --json` (the `=` because the value starts with a dash)")
    ap.add_argument("--max-seconds", type=float, default=100.0,
                    help="start no new run after this long (default 100: the table within 4 minutes)")
    ap.add_argument("--write", action="store_true", help="write the table into docs/benchmarks.md")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse(sys.argv[1:] if argv is None else argv)
    began = time.perf_counter()
    on_gpu = gpu()
    kind = ("llama8b" if on_gpu else "tiny") if args.model == "auto" else args.model
    layers = args.layers or DEFAULT_LAYERS.get(kind, 0)
    here = Path(__file__).resolve().parents[1]
    paths = dict(t.split("=", 1) for t in (args.tree or [f"this={here}"]))
    work = Path(tempfile.mkdtemp(prefix="cli-wall-"))
    try:
        measure(args, kind, layers, paths, work, here, on_gpu, began)
    finally:
        shutil.rmtree(work, ignore_errors=True)  # the built models are gigabytes


def measure(args: argparse.Namespace, kind: str, layers: int, paths: dict[str, str], work: Path, here: Path,
            on_gpu: bool, began: float) -> None:
    # PYTHONDONTWRITEBYTECODE (set in some agent and CI shells) makes every process compile every
    # module of the tree again; an installed tqstore has its bytecode, so the children may write it
    # (the first `save` below does, for each tree).
    dropped = ("LD_PRELOAD", "TQSTORE_BLAS_ACTIVE", "TQSTORE_BLAS", "PYTHONDONTWRITEBYTECODE")
    base = {k: v for k, v in os.environ.items() if k not in dropped}
    trees = [Tree(label, Path(path).resolve(), work, base) for label, path in paths.items()]

    t0 = time.perf_counter()
    document, question, described = build_model(kind, layers, work / "model", args.context_tokens)
    (work / "doc.txt").write_text(document)
    progress(f"model folder written in {time.perf_counter() - t0:.1f} s: {described}")
    for tree in trees:
        wall, cpu, _ = timed(tree.tqstore("save", "doc", "--model", str(work / "model"), "--file",
                                          str(work / "doc.txt")), tree.env, work)
        progress(f"{tree.label}: save {wall:.2f} s (CPU {cpu:.2f} s)")

    cmds = commands(question)
    if args.only:
        cmds = {name: cmds[name] for name in args.only.split(",")}
    walls = {(t.label, name): [] for t in trees for name in [*FLOORS, *cmds]}
    cpus = {key: [] for key in walls}
    phases = {t.label: [] for t in trees}
    runs_done = 0
    for run in range(args.runs):
        if run and time.perf_counter() - began > args.max_seconds:
            progress(f"stopping after {run} runs: --max-seconds {args.max_seconds:.0f} passed")
            break
        for tree in trees:
            for floor, code in FLOORS.items():
                wall, cpu, _ = timed([tree.python, "-c", code], tree.env, work)
                walls[(tree.label, floor)].append(wall)
                cpus[(tree.label, floor)].append(cpu)
                progress(f"run {run + 1} {tree.label}: {floor} {wall:.2f} s (CPU {cpu:.2f} s)")
            for name, cmd in cmds.items():
                wall, cpu, out = timed(tree.tqstore(*cmd), tree.env, work)
                walls[(tree.label, name)].append(wall)
                cpus[(tree.label, name)].append(cpu)
                extra = ""
                if name == "ask --json":
                    done = json.loads(out)
                    phases[tree.label].append((wall, sum(done[p] for p in PHASES)))
                    extra = ", phases " + ", ".join(f"{p.split('_')[0]} {done[p]:.3f}" for p in PHASES)
                progress(f"run {run + 1} {tree.label}: tqstore {name} {wall:.2f} s (CPU {cpu:.2f} s{extra})")
        runs_done = run + 1

    # The work of each command, in-process after a first run (after the fresh runs: the page
    # cache is as warm for both). One process per tree and command, up to 3 timed calls.
    works = {}
    for tree in trees:
        env = blas_environment(tree.env)
        for name, cmd in cmds.items():
            if name == "ask":
                continue  # the same work as ask --json
            works[(tree.label, name)] = work_seconds(tree_with(tree, env), cmd, min(max(runs_done, 1), 3), work)
            progress(f"{tree.label}: {name} in-process {span([w for w, _ in works[(tree.label, name)]])} s "
                     f"(CPU {span([c for _, c in works[(tree.label, name)]])} s)")

    body = report(trees, cmds, walls, cpus, phases, works, runs_done, described)
    print(body)
    if args.write:
        marker = "bench-cli-wall" + ("" if kind == "tiny" else f"-{kind}") + ("-gpu" if on_gpu else "")
        replace_section(here / "docs" / "benchmarks.md", marker, body)


def tree_with(tree: Tree, env: dict[str, str]) -> Tree:
    """`tree` with another environment."""
    other = Tree.__new__(Tree)
    other.__dict__.update(tree.__dict__, env=env)
    return other


def report(trees: list[Tree], cmds: dict, walls: dict, cpus: dict, phases: dict, works: dict, runs: int,
           described: str) -> str:
    def fresh(label: str, name: str) -> str:
        return f"{span(walls[(label, name)])} (CPU {span(cpus[(label, name)])})"

    def in_process(label: str, name: str) -> str:
        wall, cpu = zip(*works[(label, name)])
        return f"{span(list(wall))} (CPU {span(list(cpu))})"

    def fresh_over_work(label: str, name: str) -> str:
        wall, cpu = zip(*works[(label, name)])
        return f"{ratio(walls[(label, name)], list(wall))} (CPU {ratio(cpus[(label, name)], list(cpu))})"

    rows = []
    for name in FLOORS:
        rows.append([f"`python -c \"{FLOORS[name]}\"` (floor)"] + [fresh(t.label, name) for t in trees])
    for name in cmds:
        rows.append([f"`tqstore {name}`"] + [fresh(t.label, name) for t in trees])
        if (trees[0].label, name) in works:
            rows.append([f"`{name}` in-process (its work)"] + [in_process(t.label, name) for t in trees])
            rows.append([f"`{name}` fresh / in-process"] + [fresh_over_work(t.label, name) for t in trees])
    if "ask --json" in cmds:
        rows.append(["`ask --json` timed phases (model + restore + prefill + generation)"]
                    + [span([p for _, p in phases[t.label]]) for t in trees])
        rows.append(["`ask --json` wall - timed phases"] + [span([w - p for w, p in phases[t.label]]) for t in trees])
        rows.append(["`ask --json` wall / timed phases"] + [span([w / p for w, p in phases[t.label]], "x")
                                                            for t in trees])
    header = ["fresh process: wall (CPU) seconds, min-max over runs",
              *[f"{t.label} ({t.revision()})" for t in trees]]
    from tqstore.models import blas

    library, _ = blas.resolve("auto")
    return (f"{markdown_table(header, rows)}\n\nModel: {described}. {runs} runs per cell, trees interleaved; "
            f"in-process: up to 3 timed calls after one untimed. The commands ran under the default BLAS "
            f"choice (auto: {library} here), with bytecode caching on (__pycache__ written by the first "
            f"process). {stamp(sys.argv)}")


def ratio(walls: list[float], works: list[float]) -> str:
    """Fresh / in-process, against the median in-process figure (the in-process calls vary far
    less than fresh processes)."""
    if not walls or not works:
        return "-"
    middle = sorted(works)[len(works) // 2]
    return span([w / middle for w in walls], "x")


if __name__ == "__main__":
    main()
