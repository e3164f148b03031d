"""The layers hold and docs/architecture.md describes the tree as it is (tools/architecture.py)."""

import importlib.util
import sys
from pathlib import Path

import pytest

_TOOL = Path(__file__).resolve().parent.parent / "tools" / "architecture.py"
_spec = importlib.util.spec_from_file_location("architecture_tool", _TOOL)
arch = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = arch  # dataclasses look their module up while the class is built
_spec.loader.exec_module(arch)


@pytest.fixture(scope="module")
def mods():
    return arch.modules()


def test_no_module_imports_from_a_layer_above(mods):
    assert arch.violations(mods) == []


def test_no_import_cycles(mods):
    assert arch.cycles(mods) == []


def test_tqstore_and_the_cli_use_turboquant_through_its_face(mods):
    assert arch.face_breaches(mods) == []
    used = {t for m in mods.values() if not m.name.startswith("turboquant") for t in m.imports
            if t.startswith("turboquant")}
    assert used <= arch.TURBOQUANT_FACE and len(used) <= 3


def test_turboquant_keeps_its_code_in_packages(mods):
    top = [m.path.name for m in mods.values() if m.path.parent == arch.ROOT / "turboquant"]
    assert len(top) <= 6, top


def test_every_module_states_its_contract(mods):
    assert [name for name, mod in mods.items() if not mod.summary] == []


def test_module_map_matches_the_tree(mods):
    assert arch.DOC.read_text() == arch.rendered_doc(mods), "run: python tools/architecture.py --write"


def test_layers_of_known_modules():
    assert arch.layer("turboquant.codec.turbo") < arch.layer("tqstore.errors") < arch.layer("tqstore.models.identity")
    order = ["turboquant.records", "turboquant.codec.plan", "turboquant.attention.kernels",
             "turboquant.cache.compressed", "turboquant.adapter.snapshots", "turboquant.quality", "turboquant"]
    assert [arch.layer(name) for name in order] == sorted(arch.layer(name) for name in order)
    assert len({arch.layer(name) for name in order}) == len(order)
    assert arch.layer("tqstore.format.objects") < arch.layer("tqstore.store.put") < arch.layer("tqstore.engine.engine")
    assert arch.layer("tqstore.exchange.portable") < arch.layer("tqstore.serve.worker") < arch.layer("tqstore_cli.main")


def _fake(name, imports=()):
    return arch.Module(name, Path(f"/x/{name}.py"), "doc", frozenset(imports))


def test_the_checks_find_an_upward_import_a_cycle_and_a_breach_of_the_face():
    mods = {m.name: m for m in [_fake("tqstore.format.blocks", ["tqstore.store.put"]),
                                _fake("tqstore.store.put", ["tqstore.store.restore", "turboquant.cache.compressed"]),
                                _fake("tqstore.store.restore", ["tqstore.store.put", "turboquant"]),
                                _fake("turboquant.codec.plan", ["turboquant.cache.compressed"])]}
    assert arch.violations(mods) == ["tqstore.format.blocks (layer 2) imports tqstore.store.put (layer 3)",
                                     "turboquant.codec.plan (layer -6) imports turboquant.cache.compressed (layer -4)"]
    assert arch.cycles(mods) == [["tqstore.store.put", "tqstore.store.restore"]]
    assert arch.face_breaches(mods) == ["tqstore.store.put imports turboquant.cache.compressed (use turboquant's "
                                        "front door)"]


def test_a_cycle_hidden_in_a_function_or_under_type_checking_is_found(tmp_path):
    a = "def f():\n    from tqstore.engine import b\n"
    b = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from tqstore.engine import a\n"
    known = {"tqstore.engine.a": None, "tqstore.engine.b": None}
    imports = {name: frozenset(arch._imports(arch.ast.parse(src), "tqstore.engine", known))
               for name, src in (("tqstore.engine.a", a), ("tqstore.engine.b", b))}
    mods = {name: _fake(name, found) for name, found in imports.items()}
    assert arch.cycles(mods) == [["tqstore.engine.a", "tqstore.engine.b"]]
