"""A model's plan verdicts (which layers its code reads, whether a scheme's plan passes its
check) are kept in the home, so the next process that loads the same model runs neither the
probe nor the check again, and gets the same caches and codec identity."""

import json

import pytest

import turboquant.adapter.making as integration
import turboquant.adapter.residence as residence
from model_folder import write_model_folder
from tqstore import Store
from tqstore.config import load_config
from tqstore.engine.engine import Engine
from tqstore.models.verdicts import FileVerdicts
from turboquant import make_prompt_cache


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_model_folder(tmp_path_factory.mktemp("model") / "tiny-llama", kind="llama")


def _engine(home):
    return Engine(Store.open(home, config=load_config(home)))


def _kinds(model, scheme):
    return [type(c).__name__ for c in make_prompt_cache(model, scheme)]


def _no_model_runs(monkeypatch):
    """Fail the test if the probe or the plan's check runs the model."""
    def refuse(*args, **kwargs):
        raise AssertionError("the model ran although its verdicts were kept")

    monkeypatch.setattr(integration, "check_plan", refuse)
    monkeypatch.setattr(residence, "mlx_make_prompt_cache", refuse)


def test_a_second_load_reads_the_verdicts_instead_of_running_the_model(tmp_path, model_dir, monkeypatch):
    home = tmp_path / "home"
    first = _engine(home)
    loaded = first.model(str(model_dir))
    codec = first.codec_identity(loaded, "turbo4")
    kinds = _kinds(loaded.model, "turbo4")
    first.store.close()
    kept = list((home / "cache" / "verdicts").glob(f"{loaded.identity.hexdigest}-*.json"))
    assert len(kept) == 1 and json.loads(kept[0].read_text())

    _no_model_runs(monkeypatch)
    second = _engine(home)  # a new model object: nothing remembered in memory for it
    again = second.model(str(model_dir))
    assert again.model is not loaded.model
    assert second.codec_identity(again, "turbo4").digest == codec.digest
    assert _kinds(again.model, "turbo4") == kinds
    second.store.close()


def test_caches_made_before_any_codec_identity_read_the_kept_verdicts(tmp_path, model_dir, monkeypatch):
    """Every tqstore call that makes a model's caches hands turboquant the model's book, so the
    order of a process's first calls does not decide whether the model runs (a documents
    question makes its caches before it asks the codec identity)."""
    home = tmp_path / "home"
    first = _engine(home)
    loaded = first.model(str(model_dir))
    first.codec_identity(loaded, "turbo4")
    kinds = _kinds(loaded.model, "turbo4")
    first.store.close()

    _no_model_runs(monkeypatch)
    second = _engine(home)
    again = second.model(str(model_dir))
    fresh = make_prompt_cache(again.model, "turbo4", verdicts=second.models.verdicts(again))
    assert [type(c).__name__ for c in fresh] == kinds
    second.store.close()


def test_a_damaged_verdict_file_is_ignored_and_written_again(tmp_path, model_dir):
    home = tmp_path / "home"
    first = _engine(home)
    loaded = first.model(str(model_dir))
    first.codec_identity(loaded, "turbo4")
    first.store.close()
    (path,) = (home / "cache" / "verdicts").glob("*.json")
    path.write_bytes(b"\x00not json")

    second = _engine(home)
    again = second.model(str(model_dir))
    second.codec_identity(again, "turbo4")
    assert _kinds(again.model, "turbo4") == _kinds(loaded.model, "turbo4")
    second.store.close()
    assert json.loads(path.read_text())


def test_a_book_keeps_what_two_writers_put(tmp_path):
    a = FileVerdicts(tmp_path, "m" * 64)
    b = FileVerdicts(tmp_path, "m" * 64)
    a.put("one", [1])
    b.put("two", {"fallback": None, "notice": None})
    assert FileVerdicts(tmp_path, "m" * 64).get("one") == [1]
    assert FileVerdicts(tmp_path, "m" * 64).get("two") == {"fallback": None, "notice": None}
    assert FileVerdicts(tmp_path, "x" * 64).get("one") is None
