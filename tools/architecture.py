"""The repository's layers, read from the source: the import graph, the layer rules and the module
map in docs/architecture.md.

    python tools/architecture.py            # print layer violations and import cycles; exit 1 if any
    python tools/architecture.py --write    # regenerate the module map in docs/architecture.md

tests/test_architecture.py runs the same checks, so the map and the rules cannot drift from the tree.
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "architecture.md"
BEGIN, END = "<!-- module-map:begin -->", "<!-- module-map:end -->"

# Lower numbers are lower layers; a module may import from its own layer and below only.
# Top-level modules of tqstore/ not listed in PACKAGE_LAYERS are the foundation (layer 0).
# turboquant's packages sit below all of tqstore, in their own order; its front door
# (turboquant/__init__.py, the only module tqstore imports besides records) is its top.
PACKAGE_LAYERS = {
    "turboquant.records": -7,
    "turboquant.environment": -7,
    "turboquant.memo": -7,
    "turboquant.codec": -6,
    "turboquant.attention": -5,
    "turboquant.cache": -4,
    "turboquant.adapter": -3,
    "turboquant.quality": -2,
    "turboquant": -1,
    "tqstore.models": 1,
    "tqstore.format": 2,
    "tqstore.store": 3,
    "tqstore.engine": 4,
    "tqstore.exchange": 5,
    "tqstore.serve": 6,
    "tqstore_cli": 7,
}
FOUNDATION = 0
# The package's own __init__ is its public face: `tqstore.Store` reaches up into the store layer.
FACADES = {"tqstore"}
# What tqstore and the CLI may import from turboquant: its front door and the plain records.
TURBOQUANT_FACE = frozenset({"turboquant", "turboquant.records"})
# (folder, import name) of each top-level package.
PACKAGES = [("turboquant", "turboquant"), ("tqstore", "tqstore"), ("cli", "tqstore_cli")]


@dataclass(frozen=True)
class Module:
    name: str
    path: Path
    summary: str
    imports: frozenset[str]


def layer(name: str) -> int:
    """The layer of a module or package by its dotted import name."""
    best, rank = "", FOUNDATION
    for prefix, value in PACKAGE_LAYERS.items():
        if (name == prefix or name.startswith(prefix + ".")) and len(prefix) > len(best):
            best, rank = prefix, value
    return rank


def modules() -> dict[str, Module]:
    """Every module of the three packages, with its docstring summary and project imports."""
    found: dict[str, tuple[Path, ast.Module]] = {}
    for folder, import_name in PACKAGES:
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = (import_name, *path.relative_to(ROOT / folder).with_suffix("").parts)
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = (path, ast.parse(path.read_text(), str(path)))
    result = {}
    for name, (path, tree) in found.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        result[name] = Module(name, path, _summary(tree), frozenset(_imports(tree, package, found)))
    return result


def _summary(tree: ast.Module) -> str:
    doc = ast.get_docstring(tree) or ""
    paragraph = " ".join(doc.split("\n\n")[0].split())
    # The first sentence: a full stop followed by a space and a capital (not `mx.fast.cuda_kernel`).
    sentence = re.match(r"(.+?[.!?])(?=\s+[A-Z`(])", paragraph)
    return sentence.group(1) if sentence else paragraph


def _imports(tree: ast.Module, package: str, known: dict) -> set[str]:
    """Project modules a module imports anywhere in its body (lazy and TYPE_CHECKING imports too)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # `from pkg import submodule` depends on the submodule; pkg itself runs first either way.
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        for target in names:
            while target and target not in known:
                target = target.rpartition(".")[0]
            # A package's own __init__ always runs before its submodules: not an edge of its own.
            if target and not package.startswith(target + ".") and target != package:
                out.add(target)
    return out


def violations(mods: dict[str, Module]) -> list[str]:
    """Imports that point into a higher layer, one line each."""
    problems = []
    for mod in mods.values():
        if mod.name in FACADES:
            continue
        for target in sorted(mod.imports):
            if layer(target) > layer(mod.name):
                problems.append(f"{mod.name} (layer {layer(mod.name)}) imports {target} (layer {layer(target)})")
    return problems


def cycles(mods: dict[str, Module]) -> list[list[str]]:
    """Import cycles between modules, counting every import: those inside functions and under
    `if TYPE_CHECKING:` too, since a cycle hidden there is still two modules that need each other."""
    graph = {m.name: {t for t in m.imports if t != m.name and t in mods} for m in mods.values()}
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        # Tarjan's strongly connected components; the graph is small, recursion depth is bounded.
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def face_breaches(mods: dict[str, Module]) -> list[str]:
    """tqstore and CLI imports of turboquant modules other than its face, one line each."""
    return [f"{mod.name} imports {target} (use turboquant's front door)" for mod in mods.values()
            if not mod.name.startswith("turboquant") for target in sorted(mod.imports)
            if target.startswith("turboquant") and target not in TURBOQUANT_FACE]


def module_map(mods: dict[str, Module]) -> str:
    """The generated part of docs/architecture.md: one table per package, then who imports whom."""
    lines = []
    groups: dict[str, list[Module]] = {}
    for mod in mods.values():
        group = mod.name if mod.path.name == "__init__.py" else mod.name.rpartition(".")[0]
        if layer(mod.name) != layer(group):  # a module on a level of its own (turboquant's records, quality)
            group = mod.name
        groups.setdefault(group, []).append(mod)
    for group in sorted(groups, key=lambda g: (layer(g), g)):
        members = groups[group]
        place = members[0].path.relative_to(ROOT) if members[0].name == group and members[0].path.name != \
            "__init__.py" else _folder(members[0])
        lines += [f"### `{place}` ({_layer_name(layer(group))})", "", "| module | contract |", "|---|---|"]
        for mod in sorted(groups[group], key=lambda m: (m.path.name != "__init__.py", m.name)):
            lines.append(f"| `{mod.path.relative_to(ROOT)}` | {mod.summary.replace('|', '/')} |")
        lines.append("")
    lines += ["### Which package imports which", "", "| package | imports from |", "|---|---|"]
    for group in sorted(groups, key=lambda g: (layer(g), g)):
        used = sorted({_group_of(t, groups) for m in groups[group] for t in m.imports} - {group, None})
        lines.append(f"| `{group}` | {', '.join(f'`{u}`' for u in used) or '-'} |")
    return "\n".join(lines) + "\n"


def _group_of(name: str, groups: dict) -> str | None:
    while name and name not in groups:
        name = name.rpartition(".")[0]
    return name or None


def _folder(mod: Module) -> str:
    return str(mod.path.parent.relative_to(ROOT)) + "/"


def _layer_name(rank: int) -> str:
    if rank < FOUNDATION:
        return f"turboquant, level {rank - min(PACKAGE_LAYERS.values()) + 1} of {-min(PACKAGE_LAYERS.values())}"
    return {FOUNDATION: "layer 0, foundation"}.get(rank, f"layer {rank}")


def rendered_doc(mods: dict[str, Module]) -> str:
    """docs/architecture.md with its module map regenerated from the tree."""
    text = DOC.read_text()
    head, _, rest = text.partition(BEGIN)
    _, _, tail = rest.partition(END)
    return f"{head}{BEGIN}\n{module_map(mods)}{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help="regenerate the module map in docs/architecture.md")
    args = parser.parse_args(argv)
    mods = modules()
    if args.write:
        DOC.write_text(rendered_doc(mods))
        print(f"wrote {DOC.relative_to(ROOT)}")
    problems = violations(mods) + face_breaches(mods) + [" -> ".join(c) + " (import cycle)" for c in cycles(mods)]
    for line in problems:
        print(line)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
