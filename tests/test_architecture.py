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


def test_every_module_states_its_contract(mods):
    assert [name for name, mod in mods.items() if not mod.summary] == []


def test_module_map_matches_the_tree(mods):
    assert arch.DOC.read_text() == arch.rendered_doc(mods), "run: python tools/architecture.py --write"


def test_layers_of_known_modules():
    assert arch.layer("turboquant.codec") < arch.layer("tqstore.errors") < arch.layer("tqstore.models.identity")
    assert arch.layer("tqstore.format.objects") < arch.layer("tqstore.store.put") < arch.layer("tqstore.engine.engine")
    assert arch.layer("tqstore.exchange.portable") < arch.layer("tqstore.serve.worker") < arch.layer("tqstore_cli.main")


def _fake(name, imports=(), runtime=None):
    return arch.Module(name, Path(f"/x/{name}.py"), "doc", frozenset(imports),
                       frozenset(imports if runtime is None else runtime))


def test_the_checks_find_an_upward_import_and_a_cycle():
    mods = {m.name: m for m in [_fake("tqstore.format.blocks", ["tqstore.store.put"]),
                                _fake("tqstore.store.put", ["tqstore.store.restore"]),
                                _fake("tqstore.store.restore", ["tqstore.store.put"]),
                                _fake("tqstore.engine.engine", ["tqstore.engine.chunks"]),
                                _fake("tqstore.engine.chunks", ["tqstore.engine.engine"], runtime=[])]}
    assert arch.violations(mods) == ["tqstore.format.blocks (layer 2) imports tqstore.store.put (layer 3)"]
    assert arch.cycles(mods) == [["tqstore.store.put", "tqstore.store.restore"]]
