"""Quality receipts (tqstore/engine/receipts.py): measured at save, kept in the entry's metadata,
shown by `info` and `ls --json`, carried through push and pull; "not measured" where absent."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest

from model_folder import write_model_folder
from tqstore import Store
from tqstore.config import load_config
from tqstore.engine.engine import Engine
from tqstore.engine.receipts import PROBE_TOKENS, Receipt
from tqstore_cli import main as cli_main
from turboquant import make_prompt_cache, snapshot

DOC = ("The contract says the seller pays for delays. Clause seven covers delivery, payment and penalties. "
       "To abscond is to move in a mysterious way, commonly with the property of another. ") * 4


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return str(write_model_folder(tmp_path_factory.mktemp("model") / "tiny-qwen2"))


@pytest.fixture
def engine(tmp_path):
    store = Store.open(tmp_path / "home", config=load_config(tmp_path / "home"))
    yield Engine(store, prefill_chunk=64)
    store.close()


@pytest.fixture
def tq(tmp_path, capsys):
    """tq(home, *argv, json=True) -> (exit code, parsed --json stdout or the human text)."""
    def run(home: str, *argv: str, as_json: bool = True):
        capsys.readouterr()
        code = cli_main.main(["--home", str(tmp_path / home), *argv, *(["--json"] if as_json else [])])
        out, err = capsys.readouterr()
        assert "Traceback" not in out + err
        return code, json.loads(out) if as_json else out

    return run


def _receipt(engine, name: str) -> Receipt | None:
    return Receipt.from_metadata(engine.store.get(name).metadata)


def test_raw_measures_zero_and_turbo3_a_positive_kl(engine, model):
    engine.save("raw", DOC, model=model, scheme="raw")
    engine.save("t3", DOC, model=model, scheme="turbo3")
    raw, t3 = _receipt(engine, "raw"), _receipt(engine, "t3")
    assert raw is not None and t3 is not None
    assert raw.tokens == t3.tokens == PROBE_TOKENS
    # The raw entry's probe is the very computation of its reference (same caches, same chunk).
    assert raw.kl == 0.0 and raw.top1 == 1.0
    assert t3.kl > 1e-4 and 0.0 <= t3.top1 <= 1.0
    assert raw.seconds > 0 and t3.seconds > 0


def test_a_document_saved_again_keeps_its_receipt(engine, model):
    # Before: nothing new was prefilled, so no probe ran and the second entry read "not measured".
    engine.save("doc", DOC, model=model, scheme="turbo4")
    again = engine.save("copy", DOC, model=model, scheme="turbo4", metadata={"k": "v"})
    assert again.reused_tokens == again.tokens
    assert _receipt(engine, "copy") == _receipt(engine, "doc") is not None
    assert engine.store.get("copy").metadata["k"] == "v"


def test_a_receipt_does_not_change_the_entry(engine, model, tmp_path):
    """The probe runs on copies: the stored snapshot equals one of caches prefilled without it."""
    engine.save("doc", DOC, model=model, scheme="turbo4")
    loaded = engine.model(model)
    tokens = list(engine.store.get("doc").tokens)
    caches = make_prompt_cache(loaded.model, "turbo4")
    engine.prefill(loaded, caches, tokens)
    for c in caches:
        c.compress()
    snap, _ = engine.store.load("doc")
    expected = snapshot(caches)
    for got, want in zip(snap.layers, expected.layers):
        assert set(got.arrays) == set(want.arrays)
        assert all(mx.array_equal(got.arrays[k], want.arrays[k]).item() for k in want.arrays)


def test_entries_without_a_receipt_show_not_measured(engine, model, tq):
    loaded = engine.model(model)
    tokens = loaded.prompt.context_tokens(loaded.tokenizer, DOC, None)
    caches = make_prompt_cache(loaded.model, "turbo4")
    engine.prefill(loaded, caches, tokens)
    # store_caches (chat turns, the server) takes no receipt: what an old entry looks like.
    engine.store_caches("old", loaded, "turbo4", caches, tokens, prefill_seconds=1.0)
    code, doc = tq("home", "info", "old")  # the engine's home
    assert code == 0 and doc["quality"] == {"measured": False}
    code, text = tq("home", "info", "old", as_json=False)
    assert code == 0 and "quality:" in text and "not measured" in text


def test_the_receipt_shows_in_info_and_ls_and_survives_push_and_pull(s3, monkeypatch, tq, model):
    monkeypatch.setenv("TQSTORE_S3_URL", f"s3://{s3.bucket}/kv")
    monkeypatch.setenv("TQSTORE_S3_ENDPOINT", s3.endpoint)
    monkeypatch.setenv("TQSTORE_S3_REGION", "us-east-1")
    monkeypatch.delenv("TQSTORE_HOME", raising=False)
    assert tq("a", "save", "doc", "--model", model, "--prompt", DOC, "--scheme", "turbo3")[0] == 0
    _, info_a = tq("a", "info", "doc")
    quality = info_a["quality"]
    assert quality["measured"] and quality["kl"] > 0 and quality["tokens"] == PROBE_TOKENS
    assert info_a["metadata"] == {}  # the receipt's keys are shown as `quality` only
    _, listed = tq("a", "ls")
    assert [e["quality"] for e in listed["entries"]] == [quality]
    _, text = tq("a", "info", "doc", as_json=False)
    assert f"top-1 {quality['top1']:.3f} over the last {PROBE_TOKENS} tokens" in text
    assert tq("a", "push", "doc")[0] == 0
    assert tq("b", "pull", "doc")[0] == 0
    _, info_b = tq("b", "info", "doc")
    assert info_b["quality"] == quality


def test_a_sliding_window_model_gets_a_receipt_while_its_windows_can_be_trimmed(engine, tmp_path):
    """Window rows logged per token make checkpoints exist without recurrent states: the probe
    still runs (raw: exactly 0), where it used to be skipped as if the model were recurrent. The
    context stays inside the tiny model's 64-token windows (a full window cannot be trimmed, so
    longer contexts get no receipt: receipts.probe_length)."""
    gemma = str(write_model_folder(tmp_path / "tiny-gemma3", kind="gemma3_text"))
    engine.save("raw", DOC[:200], model=gemma, scheme="raw")
    receipt = _receipt(engine, "raw")
    assert receipt is not None and receipt.kl == 0.0 and receipt.top1 == 1.0


def test_the_default_scheme_saves_with_a_receipt(engine, model):
    engine.save("doc", DOC, model=model)  # no scheme: the config's default (turbo5v4, issue 31)
    assert engine.store.get("doc").scheme == "turbo5v4"
    receipt = _receipt(engine, "doc")
    assert receipt is not None and receipt.tokens == PROBE_TOKENS
    assert receipt.kl > 0.0 and 0.0 <= receipt.top1 <= 1.0
