"""Instructions in the main loop of each scheme's tensor-core pass 1, read from its sm_90 binary:
no GPU needed, and the same count on every run.

On the GPU the compressed decode is bound by its instructions, not by its bytes (docs/benchmarks.md,
"Not bound by the bytes"), and chained timings of two schemes spread by 5-10% between runs. The
loop a warp repeats for every 16 tokens is what a scheme's extra instructions cost it at long
contexts, so this script counts it: each scheme's pass-1 variant at B=1, 32 query / 8 KV heads,
d=128, fp16 activations (the variant `bench/decode.py --compare` times, chosen by the host code
itself), compiled as MLX assembles it (`kernels.cuda.translation_unit`) with nvcc for sm_90,
disassembled with cuobjdump. The loop is the innermost backward branch that holds every MMA.

  python bench/kernel_sass.py --schemes turbo4,turbo5v4,auto3.5:mixed,auto6:mixed
  python bench/kernel_sass.py --schemes turbo4,turbo5v4 --against main   # and at another revision
  python bench/kernel_sass.py ... --write-docs                          # into docs/benchmarks.md

Needs nvcc and cuobjdump with nvdisasm beside it (the PyPI wheels nvidia-cuda-cuobjdump and
nvidia-cuda-nvdisasm carry both; `--tools` names their bin folder when it is not on PATH).
`--against REV` exports REV's tree with `git archive` and builds its variants with REV's own code.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HQ, HKV, D, T = 32, 8, 128, 1024
CLASSES = {
    "integer": ("LOP3", "SHF", "IMAD", "IADD3", "LEA", "PRMT", "SEL", "VIADD", "MOV", "ISETP", "P2R", "R2P", "PLOP3"),
    "shared loads": ("LDS",),
    "global loads": ("LDG",),
    "MMA": ("HMMA",),
    "float": ("FMUL", "FADD", "FFMA", "FMNMX", "FSETP", "FSEL", "MUFU", "HADD2", "HFMA2", "HMUL2", "F2FP", "F2F"),
}


def emit_sources(schemes: list[str], out: Path, root: Path) -> list[tuple[str, str]]:
    """Write each scheme's pass-1 translation units into `out` with the code under `root`;
    returns (scheme, variant name) pairs."""
    for p in (root, root / "tests"):
        sys.path.insert(0, str(p))
    import mlx.core as mx

    from kernel_support.synthetic import build_cache, stored
    from turboquant.attention.kernels import host
    from turboquant.attention.kernels.cuda import translation_unit
    from turboquant.codec.plan import plan_layer
    from turboquant.codec.schemes import parse_scheme

    q = mx.zeros((1, HQ, 1, D), dtype=mx.float16)
    pairs = []
    for scheme in schemes:
        name, _, mode = scheme.partition(":")
        layouts = [None]
        if mode == "mixed":
            layouts = plan_layer(parse_scheme(name), HKV, D, D, mx.float16).key_options()
        for keys in layouts:
            cache = build_cache(name, HKV, D, mx.float16, T, **({} if keys is None else {"keys": keys}))
            call = host.describe(q, cache._key_side, cache._value_side, stored(cache), cache._shifts,
                                 tensor_cores=True)
            if call is None:
                raise SystemExit(f"{scheme}: no fused kernel serves this layout")
            variant = call.pass1
            (out / f"{variant.name}.cu").write_text(translation_unit(variant))
            pairs.append((scheme, variant.name))
    return pairs


def _parse(sass: str) -> list[tuple[int, str]]:
    return [(int(m.group(1), 16), m.group(2).strip())
            for m in re.finditer(r"^\s+/\*([0-9a-f]+)\*/\s+(.*?);", sass, re.M)]


def _opcode(text: str) -> str:
    return re.sub(r"^@!?U?P\w+\s+", "", text).split()[0].split(".")[0]


def main_loop(sass: str) -> list[str]:
    """The instructions of the innermost loop (backward branch) holding every MMA."""
    ins = _parse(sass)
    mma = [a for a, t in ins if _opcode(t) == "HMMA"]
    best = None
    for a, t in ins:
        m = re.search(r"\bBRA\s+0x([0-9a-f]+)", t)
        if m and int(m.group(1), 16) <= mma[0] and a >= mma[-1]:
            span = (int(m.group(1), 16), a)
            if best is None or span[1] - span[0] < best[1] - best[0]:
                best = span
    return [t for a, t in ins if best[0] <= a <= best[1]]


def _env(tools: str | None) -> dict:
    return dict(os.environ, PATH=f"{tools}{os.pathsep}{os.environ['PATH']}" if tools else os.environ["PATH"])


def count(cubin: Path, tools: str | None) -> dict:
    """Registers and the main loop's instructions by class of one compiled variant."""
    env = _env(tools)
    sass = subprocess.run(["cuobjdump", "-sass", str(cubin)], capture_output=True, text=True, check=True, env=env).stdout
    res = subprocess.run(["cuobjdump", "-res-usage", str(cubin)], capture_output=True, text=True, check=True, env=env)
    regs = int(re.search(r"REG:(\d+)", res.stdout).group(1))
    loop = main_loop(sass)
    ops = collections.Counter(_opcode(t) for t in loop)
    row = {"registers": regs, "loop": len(loop)}
    for cls, names in CLASSES.items():
        row[cls] = sum(ops[n] for n in names)
    row["other"] = len(loop) - sum(row[c] for c in CLASSES)
    return row


def compile_all(folder: Path, names: list[str], tools: str | None) -> dict[str, dict]:
    def one(name: str) -> tuple[str, dict]:
        src, cubin = folder / f"{name}.cu", folder / f"{name}.cubin"
        res = subprocess.run(["nvcc", "-arch=sm_90", "-std=c++17", "-cubin", "-o", str(cubin), str(src)],
                             capture_output=True, text=True)
        if res.returncode:
            raise SystemExit(f"nvcc failed on {name}:\n{res.stderr[-2000:]}")
        return name, count(cubin, tools)

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        return dict(pool.map(one, sorted(set(names))))


def build(schemes: list[str], tools: str | None, rev: str | None, work: Path) -> list[tuple[str, str, dict]]:
    """(scheme, variant, counts) at the working tree, or at `rev` (its code, exported)."""
    out = work / (rev or "tree")
    out.mkdir(parents=True)
    if rev is None:
        pairs = emit_sources(schemes, out, ROOT)
    else:
        tree = work / "src"
        tree.mkdir()
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev], capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
        res = subprocess.run([sys.executable, __file__, "--emit", str(out), "--root", str(tree),
                              "--schemes", ",".join(schemes)], capture_output=True, text=True, cwd=tree)
        if res.returncode:
            raise SystemExit(f"building {rev}'s variants failed:\n{res.stderr[-2000:]}")
        pairs = [tuple(line.split("\t")) for line in res.stdout.splitlines() if "\t" in line]
    counts = compile_all(out, [v for _, v in pairs], tools)
    return [(s, v, counts[v]) for s, v in pairs]


def table(rows: list[tuple[str, str, dict]], base: list[tuple[str, str, dict]] | None, rev: str | None) -> str:
    """One line per (scheme, variant); with `base`, the same variant's loop at the other revision."""
    first = rows[0][2]["loop"]
    head = ["scheme", "pass 1", "registers", "loop instructions", "vs first", *CLASSES, "other"]
    if base is not None:
        head += [f"loop at {rev}", "change"]
    old = {(s, v): c for s, v, c in base or []}
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for s, v, c in rows:
        cells = [s, v, str(c["registers"]), str(c["loop"]), f"{c['loop'] / first:.3f}x"]
        cells += [str(c[k]) for k in [*CLASSES, "other"]]
        if base is not None:
            same = old.get((s, v))
            cells += ["" if same is None else str(same["loop"]),
                      "" if same is None else f"{c['loop'] / same['loop'] - 1:+.1%}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def tool_versions(tools: str | None) -> str:
    def version(tool: str) -> str:
        out = subprocess.run([tool, "--version"], capture_output=True, text=True, env=_env(tools)).stdout
        m = re.search(r"V(\d+\.\d+\.\d+)", out)
        return f"{tool} {m.group(1) if m else '?'}"

    return f"{version('nvcc')}, {version('cuobjdump')}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--schemes", default="turbo4,turbo5v4,auto3.5:mixed,auto6:mixed")
    ap.add_argument("--against", help="also count at this git revision")
    ap.add_argument("--tools", help="folder holding cuobjdump and nvdisasm")
    ap.add_argument("--write-docs", action="store_true")
    ap.add_argument("--emit", help=argparse.SUPPRESS)  # internal: write the sources of --root's tree here
    ap.add_argument("--root", help=argparse.SUPPRESS)
    args = ap.parse_args()
    schemes = args.schemes.split(",")
    if args.emit:
        for s, v in emit_sources(schemes, Path(args.emit), Path(args.root)):
            print(f"{s}\t{v}")
        return
    for tool in ("nvcc", "cuobjdump"):
        if shutil.which(tool, path=_env(args.tools)["PATH"]) is None:
            raise SystemExit(f"{tool} not found (see this script's docstring)")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        rows = build(schemes, args.tools, None, work)
        base = build(schemes, args.tools, args.against, work) if args.against else None
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--", "turboquant"],
                           capture_output=True, text=True).stdout.strip()
    body = (f"Tools: {tool_versions(args.tools)}, sm_90. Tree: git {head}{' (modified)' if dirty else ''}. "
            f"Command: `python bench/kernel_sass.py --schemes {args.schemes}"
            f"{' --against ' + args.against if args.against else ''}`.\n"
            f"Each scheme's tensor-core pass 1 at B=1, {HQ} query / {HKV} KV heads, d={D}, fp16 activations; "
            "the main loop (a warp's 16 tokens) by instruction class; `:mixed`: every key layout the "
            "allocation can choose.\n\n" + table(rows, base, args.against))
    print(body)
    if args.write_docs:
        sys.path.insert(0, str(ROOT / "bench"))
        from common import replace_section

        replace_section(ROOT / "docs" / "benchmarks.md", "kernel-sass", body)
        print("wrote docs/benchmarks.md (kernel-sass section)")


if __name__ == "__main__":
    main()
