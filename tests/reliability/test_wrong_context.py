"""A cache saved for one model, tokenizer, chat template, RoPE setting, KV dtype or scheme is
refused for another, with a message naming the difference.

Tiny model folders that differ from the saved one in exactly one thing (describe_difference
lists exactly one field). Through the Engine: `ask` on the entry with the other model raises
IdentityMismatch naming that field (so does `model_for`), and a prompt with the entry's tokens
run on the other model (or scheme) restores nothing: prefix reuse never crosses identities.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from harness import open_store
from model_folder import CHAT_TEMPLATE, write_model_folder
from tqstore.format import objects as F
from tqstore.engine.engine import Engine
from tqstore.errors import IdentityMismatch
from tqstore.models.identity import describe_difference

DOCUMENT = "The contract says the seller pays for delays. Clause seven covers delivery and penalties. " * 4


def base_folder(path: Path, seed: int = 0) -> Path:
    """A model folder whose chat template lives in chat_template.jinja (the tokenizer files do
    not hash it, so a changed template changes only the template's digest)."""
    write_model_folder(path, kind="qwen2", seed=seed, chat=False)
    (path / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return path


def variant(base: Path, where: Path, change: str) -> Path:
    """A copy of `base` differing in one thing."""
    if change == "weights":
        return base_folder(where, seed=1)  # the same config and tokenizer, other random weights
    shutil.copytree(base, where)
    if change == "tokenizer":
        tok = json.loads((where / "tokenizer.json").read_text())
        tok["added_tokens"].append({**tok["added_tokens"][-1], "id": tok["added_tokens"][-1]["id"] + 1,
                                    "content": "<|extra|>"})
        (where / "tokenizer.json").write_text(json.dumps(tok))
    elif change == "chat_template":
        (where / "chat_template.jinja").write_text(CHAT_TEMPLATE.replace("<|im_start|>assistant", "<|im_start|>bot"))
    elif change == "config.rope_theta":
        config = json.loads((where / "config.json").read_text())
        config["rope_theta"] = 500000.0
        (where / "config.json").write_text(json.dumps(config))
    return where


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("wrong-context")
    base = base_folder(root / "base")
    store = open_store(root / "home")
    engine = Engine(store, prefill_chunk=64)
    engine.save("doc", DOCUMENT, model=str(base), scheme="turbo4")
    yield engine, base, root
    store.close()


@pytest.mark.parametrize("change", ["weights", "tokenizer", "chat_template", "config.rope_theta"])
def test_another_model_is_refused_naming_the_difference(saved, change, ledger):
    engine, base, root = saved
    other = variant(base, root / f"other-{change.replace('.', '-')}", change)
    expected = engine.store.get("doc").model_identity
    loaded = engine.model(str(other))
    differences = describe_difference(expected, loaded.identity)
    assert [d.split(":")[0] for d in differences] == [change], differences  # exactly one thing differs
    with pytest.raises(IdentityMismatch, match=change.replace(".", r"\.")) as refused:
        engine.ask("doc", "Who pays for delays?", model=str(other), max_tokens=2)
    assert "\n" not in str(refused.value)
    with pytest.raises(IdentityMismatch, match=change.replace(".", r"\.")):
        engine.model_for("doc", str(other))
    prompt = list(engine.store.get("doc").tokens) + [1, 2]
    assert engine.generate(loaded, "turbo4", prompt, max_tokens=1).cached_tokens == 0  # never reused
    ledger.count("wrong context", f"{change}: refused by ask and model_for, named; prefix not reused")


def test_another_kv_dtype_is_refused(saved, ledger):
    engine, base, _ = saved
    half = Engine(engine.store, dtype="float16", prefill_chunk=64)
    loaded = half.model(str(base))
    differences = describe_difference(engine.store.get("doc").model_identity, loaded.identity)
    assert [d.split(":")[0] for d in differences] == ["kv_dtype"], differences
    with pytest.raises(IdentityMismatch, match="kv_dtype"):
        half.ask("doc", "Who pays?", max_tokens=1)
    ledger.count("wrong context", "kv_dtype: refused by ask, named")


def test_another_scheme_is_never_restored(saved, ledger):
    engine, base, _ = saved
    loaded = engine.model(str(base))
    manifest = engine.store.get("doc")
    turbo4, other = engine.codec_identity(loaded, "turbo4"), engine.codec_identity(loaded, "turbo8v3")
    assert turbo4.digest == manifest.codec_digest
    assert any(d.startswith("scheme: turbo4 vs turbo8v3") for d in describe_difference(turbo4, other))
    prompt = list(manifest.tokens) + [1, 2]
    assert engine.store.lookup(prompt, model=loaded.identity.digest, codec=other.digest) is None
    assert engine.generate(loaded, "turbo8v3", prompt, max_tokens=1).cached_tokens == 0
    assert engine.generate(loaded, "turbo4", prompt, max_tokens=1).cached_tokens == len(manifest.tokens)
    # A stored block asked for as another scheme's: the reader refuses it, naming the codec.
    payload = engine.store._tiers.lmdb.get_object(manifest.blocks[0].key)
    with pytest.raises(IdentityMismatch, match="another codec"):
        F.loads(payload, expect=F.Expect(codec=other.digest))
    ledger.count("wrong context", "scheme: not restored for turbo8v3, block refused naming the codec")
