"""A config.json edited after a save is another model (issue 27, finding 2).

The model identity used to hash only the config fields that shape the KV cache, so a save
followed by an edit of `rms_norm_eps` restored the whole stale cache and answered unlike a cold
save under the new config. Now the whole config counts, less a documented list of cosmetic
fields. Each scenario saves with a tiny model folder, edits its config.json in place, and asks
through a new Engine (as a new `tqstore ask` process would): the entry is refused naming the
field, the prompt's prefix is not reused, and once saved again the answer equals a cold save's.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from harness import open_store
from model_folder import write_model_folder
from tqstore.engine.engine import Engine
from tqstore.errors import IdentityMismatch

DOCUMENT = "The contract says the seller pays for delays. Clause seven covers delivery and penalties. " * 4
QUESTION = "Who pays for delays?"


def edit_config(folder: Path, **changes: object) -> None:
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **changes}))


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """One tiny model folder per kind, written once; each test edits a copy."""
    root = tmp_path_factory.mktemp("config-identity")
    return {kind: write_model_folder(root / kind, kind=kind) for kind in ("qwen2", "gemma3_text")}


def cold_answer(root: Path, loaded) -> list[int]:
    """The answer of a home that never saw the folder before its edit (the same loaded model)."""
    store = open_store(root)
    try:
        engine = Engine(store, prefill_chunk=64)
        engine.use_model(loaded)
        engine.save("doc", DOCUMENT, model=loaded.ref, scheme="turbo4")
        return engine.ask("doc", QUESTION, max_tokens=6).tokens
    finally:
        store.close()


@pytest.mark.filterwarnings("ignore:layer kind RotatingKVCache")
@pytest.mark.parametrize("kind,field,value", [("qwen2", "rms_norm_eps", 0.5),
                                              ("gemma3_text", "query_pre_attn_scalar", 64)])
def test_a_config_edit_after_a_save_is_never_restored(folders, tmp_path, kind, field, value, ledger):
    folder = Path(shutil.copytree(folders[kind], tmp_path / "model"))
    store = open_store(tmp_path / "home")
    try:
        Engine(store, prefill_chunk=64).save("doc", DOCUMENT, model=str(folder), scheme="turbo4")
        edit_config(folder, **{field: value})
        later = Engine(store, prefill_chunk=64)
        with pytest.raises(IdentityMismatch, match=rf"config\.{field}: .* vs {value}") as refused:
            later.ask("doc", QUESTION, model=str(folder), max_tokens=6)
        assert "\n" not in str(refused.value)
        loaded = later.model(str(folder))
        prompt = list(store.get("doc").tokens) + [1, 2]
        assert later.generate(loaded, "turbo4", prompt, max_tokens=1).cached_tokens == 0  # no prefix reused
        assert later.save("doc", DOCUMENT, model=str(folder), scheme="turbo4").reused_tokens == 0
        answer = later.ask("doc", QUESTION, max_tokens=6)
        assert answer.cached_tokens == len(store.get("doc").tokens)
        assert answer.tokens == cold_answer(tmp_path / "cold", loaded)
    finally:
        store.close()
    ledger.count("config edit", f"{kind} {field}: refused naming it, prefix not reused, re-save answers as cold")


def test_a_cosmetic_config_edit_still_reuses_the_cache(folders, tmp_path, ledger):
    folder = Path(shutil.copytree(folders["qwen2"], tmp_path / "model"))
    store = open_store(tmp_path / "home")
    try:
        saved = Engine(store, prefill_chunk=64).save("doc", DOCUMENT, model=str(folder), scheme="turbo4")
        # eos_token_id says where an answer stops, read when generating; the cache is the same.
        edit_config(folder, transformers_version="9.9.9", _name_or_path="/elsewhere", eos_token_id=0)
        later = Engine(store, prefill_chunk=64)
        answer = later.ask("doc", QUESTION, model=str(folder), max_tokens=6)
        assert answer.cached_tokens == saved.tokens
        assert answer.tokens == cold_answer(tmp_path / "cold", later.model(str(folder)))
    finally:
        store.close()
    ledger.count("config edit", "cosmetic fields: the cache reused, the answer a cold save's")
