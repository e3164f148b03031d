"""Bad input at every boundary: entry names, config files and environment variables, CLI
arguments and HTTP bodies. Each gets a clear, typed error (InvalidName, ConfigError; a non-zero
exit with one line and no traceback; a 4xx with a JSON error body), nothing is written, and the
server keeps serving.

The CLI (cli/) and the server (tqstore/serve/main.py) are checked once they are importable; the
tests skip cleanly before.
"""

from __future__ import annotations

import importlib.util
import json
import os

import pytest

import s3_server
from harness import cli_available, open_store, s3_settings
from model_folder import write_model_folder
from tqstore.config import load_config
from tqstore.errors import ConfigError, InvalidName
from tqstore.names import NAME_RULE
from workers import put

BAD_NAMES = ["", "../etc/passwd", "a/b", "/abs", "..", ".hidden", "-rf", " lead", "trail ", "a b", "tab\there",
             "new\nline", "nul\x00byte", "ünïcödé", "名前", "emoji😀", "x" * 129, "x" * 10_000, "a\\b",
             "%2e%2e"]
NON_STRINGS = [None, 5, b"bytes", ["a"]]


@pytest.fixture(scope="module")
def named_store(moto_server, tmp_path_factory):
    """(store, home) for every bad name, each of which checks that it is left as it was: a store
    on LMDB and the test S3 server (the `s3` fixture's environment and bucket, kept for the
    module) holding one entry, `ok-entry`. Opening a store builds its S3 client, which took most
    of each name's time."""
    root = tmp_path_factory.mktemp("names")
    with pytest.MonkeyPatch.context() as env:
        s3 = s3_server.fresh_s3(moto_server, env, root)
        store = open_store(root / "home", **s3_settings(s3))
        put(store, "ok-entry", 44, 1)
        yield store, root / "home"
        store.close()


@pytest.mark.parametrize("name", BAD_NAMES + NON_STRINGS, ids=lambda n: repr(n)[:20])
def test_bad_entry_names_are_refused_everywhere(name, named_store, ledger):
    store, home = named_store
    calls = {
        "put": lambda: put(store, name, 44, 2), "get": lambda: store.get(name), "load": lambda: store.load(name),
        "rm": lambda: store.rm(name), "pin": lambda: store.pin(name), "unpin": lambda: store.unpin(name),
        "info": lambda: store.info(name), "verify": lambda: store.verify(name), "push": lambda: store.push(name),
        "pull": lambda: store.pull(name), "rm --remote": lambda: store.rm(name, remote=True),
        "info --remote": lambda: store.info(name, remote=True),
        "LMDB manifest": lambda: store._tiers.lmdb.put_manifest(name, b"{}"),
        "S3 manifest": lambda: store._tiers.s3.manifest_name(name),
    }
    if name is None:  # push(None) and verify(None) mean every entry
        del calls["push"], calls["verify"]
    for op, call in calls.items():
        with pytest.raises(InvalidName) as refused:
            call()
        message = str(refused.value)
        assert NAME_RULE in message and "\n" not in message.replace(repr(name)[:40], "") and len(message) < 400, op
        ledger.count("bad input", f"entry names: refused ({op})")
    assert [e.name for e in store.ls()] == ["ok-entry"] and store.verify() == []
    assert sorted(p.name for p in home.iterdir()) == ["lmdb", "store.lock"]


def test_the_longest_and_oddest_valid_names_work(tmp_path):
    store = open_store(tmp_path / "home")
    for name in ("a" * 128, "A.b-c_9", "0", "x..y"):
        put(store, name, 44, 1)
        assert store.load(name)[1].tokens == 556
    store.close()


BAD_TOML = {
    "malformed": b"[store\nlmdb_budget = 1",
    "not utf-8": b"[store]\nlmdb_budget = \"\xff\xfe\"",
    "duplicate key": b"[store]\nlmdb_budget = \"1GiB\"\nlmdb_budget = \"2GiB\"",
    "unknown key": b"[store]\nlmdb_budgte = \"1GiB\"",
    "unknown table": b"[stroe]\nlmdb_budget = \"1GiB\"",
    "key outside a table": b"lmdb_budget = \"1GiB\"",
    "a table that is a value": b"store = 5",
    "boolean size": b"[store]\nlmdb_budget = true",
    "list size": b"[store]\nlmdb_budget = [1, 2]",
    "negative size": b"[store]\nlmdb_budget = -5",
    "size with a bad unit": b"[store]\nlmdb_budget = \"10 parsecs\"",
    "float overflow": b"[store]\nsegment_size = 1e400",
    "segment too small": b"[store]\nsegment_size = \"1KiB\"",
    "nested table": b"[store.deep]\nx = 1",
    "bad s3 url": b"[s3]\nurl = \"http://not-s3\"",
    "bad endpoint": b"[s3]\nendpoint = \"ftp://x\"",
    "concurrency zero": b"[s3]\nconcurrency = 0",
    "timeout as text": b"[s3]\nread_timeout = \"soon\"",
    "empty key file": b"[s3]\nkey_file = \"\"",
    "control characters": b"[store]\ndefault_scheme = \"turbo4\\u0007\"",
}


@pytest.mark.parametrize("label", list(BAD_TOML))
def test_bad_config_files_are_a_config_error_naming_the_file(label, tmp_path, ledger):
    home = tmp_path / "home"
    home.mkdir()
    (home / "config.toml").write_bytes(BAD_TOML[label])
    with pytest.raises(ConfigError) as refused:
        load_config(home)
    assert "config.toml" in str(refused.value), str(refused.value)
    with pytest.raises(ConfigError):
        open_store(home)
    assert not (home / "lmdb").exists()
    ledger.count("bad input", "config files: ConfigError naming the file")


@pytest.mark.parametrize("var,value", [("TQSTORE_LMDB_BUDGET", "lots"), ("TQSTORE_SEGMENT_SIZE", "-1"),
                                       ("TQSTORE_S3_URL", "s3://"), ("TQSTORE_S3_CONCURRENCY", "1.5"),
                                       ("TQSTORE_S3_MAX_ATTEMPTS", "99"), ("TQSTORE_MEMORY_BUDGET", "NaN")])
def test_bad_environment_variables_are_a_config_error_naming_them(var, value, tmp_path, monkeypatch, ledger):
    monkeypatch.setenv(var, value)
    with pytest.raises(ConfigError, match=var):
        load_config(tmp_path / "home")
    ledger.count("bad input", "environment variables: ConfigError naming the variable")


# -- the CLI ----------------------------------------------------------------------------------

CLI_CASES = [
    [], ["frobnicate"], ["ls", "--bogus"], ["rm"], ["rm", "../x"], ["rm", ""], ["info", "x" * 10_000],
    ["info", "ünïcödé"], ["rm", "no-such-entry"], ["verify", "no-such-entry"], ["pin", "a/b"],
    ["save", "doc"], ["save", "doc", "--model", "/no/such/model", "--file", "/no/such/file"],
    ["ask"], ["ask", "no-such-entry", "question?"], ["push", "x"], ["pull", "x"], ["gc", "--remote"],
    ["config", "set", "store.nope", "1"], ["config", "set", "store.lmdb_budget", "-5"],
    ["config", "set", "s3.url", "http://x"], ["config", "unset", "nope"], ["export", "../x", "/dev/null/x"],
    ["import", "/no/such/bundle"], ["ls", "--home", "/dev/null"], ["stats", "--home", "/proc/1/nope"],
]


@pytest.fixture
def cli_main():
    if not cli_available():
        pytest.skip("the CLI (tqstore_cli.main) is not importable yet")
    from tqstore_cli.main import main

    return main


def error_lines(err: str, code: int) -> list[str]:
    """The lines of stderr that say what went wrong. A usage error (exit 2) may come after
    argparse's synopsis ("usage: ..." and its indented continuation lines), as in uv and gh."""
    lines = err.strip().splitlines()
    if code == 2:
        lines = [line for line in lines if not line.startswith(("usage:", " "))]
    return lines


def run_cli(main, argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 1


@pytest.mark.parametrize("argv", CLI_CASES, ids=lambda a: " ".join(a)[:40] or "(nothing)")
def test_bad_cli_arguments_exit_non_zero_with_one_line(argv, cli_main, tmp_path, monkeypatch, capsys, ledger):
    home = tmp_path / "home"
    monkeypatch.setenv("TQSTORE_HOME", str(home))
    for name in ("TQSTORE_S3_URL", "TQSTORE_S3_KEY"):
        monkeypatch.delenv(name, raising=False)
    code = run_cli(cli_main, argv)
    out, err = capsys.readouterr()
    assert code not in (0, None), (argv, out, err)
    assert "Traceback" not in out + err and "InternalError" not in out + err, err
    assert len(error_lines(err, code)) == 1, f"{argv}: {err!r}"
    code = run_cli(cli_main, [*argv, "--json"] if argv else ["--json"])
    out, err = capsys.readouterr()
    assert code not in (0, None) and "Traceback" not in out + err
    if out.strip():
        doc = json.loads(out)
        assert set(doc["error"]) >= {"type", "message"} and doc["error"]["type"] != "InternalError", doc
    ledger.count("bad input", "CLI arguments: non-zero exit, one line, no traceback (plain and --json)")


# Issue 27, finding 6: `ask --temp nan` (and inf) exited 0, `serve --port 70000` was an internal
# error. Each is a usage error (exit 2) whose one line names the flag.
USAGE_CASES = [
    (["ask", "e", "q", "--temp", value], "--temp") for value in ("nan", "inf", "-inf", "-0.5", "hot")
] + [
    (["ask", "e", "q", "--top-p", value], "--top-p") for value in ("nan", "0", "1.5", "-1", "inf")
] + [
    (["serve", "--model", "/no/such/model", "--port", value], "--port") for value in ("70000", "-1", "65536", "x")
] + [
    (["serve", "--model", "/no/such/model", "--temp", "nan"], "--temp"),
    (["serve", "--model", "/no/such/model", "--temp", "3"], "--temp"),
    (["serve", "--model", "/no/such/model", "--top-p", "inf"], "--top-p"),
]


@pytest.mark.parametrize("argv,flag", USAGE_CASES, ids=lambda a: " ".join(a)[-24:] if isinstance(a, list) else a)
def test_out_of_range_flags_are_a_usage_error_naming_the_flag(argv, flag, cli_main, tmp_path, monkeypatch, capsys,
                                                               ledger):
    monkeypatch.setenv("TQSTORE_HOME", str(tmp_path / "home"))
    code = run_cli(cli_main, argv)
    out, err = capsys.readouterr()
    lines = error_lines(err, code)
    assert code == 2 and len(lines) == 1 and flag in lines[0], (argv, code, out, err)
    assert "Traceback" not in out + err and "internal error" not in out + err
    ledger.count("bad input", "out-of-range flags: usage error naming the flag")


def test_serve_on_a_port_in_use_is_a_clear_error(cli_main, tmp_path, monkeypatch, capsys, ledger):
    import socket

    monkeypatch.setenv("TQSTORE_HOME", str(tmp_path / "home"))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        code = run_cli(cli_main, ["serve", "--model", "/no/such/model", "--port", str(port)])
    out, err = capsys.readouterr()
    lines = error_lines(err, code)
    assert code == 1 and len(lines) == 1 and "--port" in lines[0] and str(port) in lines[0], (code, out, err)
    assert "internal error" not in out + err
    ledger.count("bad input", "serve on a busy port: one line naming --port")


# Issue 27 (left from finding 6): a byte that is not UTF-8 on the command line reached the
# tokenizer as a lone surrogate and ended as `internal error: TypeError`.
def test_text_that_is_not_utf8_on_the_command_line_is_refused_naming_the_byte(cli_main, tmp_path, monkeypatch,
                                                                             capsys, ledger):
    monkeypatch.setenv("TQSTORE_HOME", str(tmp_path / "home"))
    model = str(write_model_folder(tmp_path / "model", kind="qwen2"))
    assert run_cli(cli_main, ["save", "doc", "--model", model, "--prompt", "a valid document", "-q"]) == 0
    capsys.readouterr()
    for argv in (["save", "bad", "--model", model, "--prompt", "caf\udce9 au lait"],
                 ["ask", "doc", "why\udcff?", "--max-tokens", "1"]):
        code = run_cli(cli_main, argv)
        out, err = capsys.readouterr()
        lines = error_lines(err, code)
        assert code == 1 and len(lines) == 1 and "not valid UTF-8" in lines[0] and "0x" in lines[0], (argv, err)
        assert "internal error" not in out + err and "Traceback" not in out + err
        ledger.count("bad input", "text that is not UTF-8 on the command line: one line naming the byte")
    assert run_cli(cli_main, ["info", "bad"]) != 0  # nothing was stored


# -- HTTP bodies ------------------------------------------------------------------------------

BAD_BODIES = [
    ("POST", "/v1/completions", b""), ("POST", "/v1/completions", b"{"), ("POST", "/v1/completions", b"[]"),
    ("POST", "/v1/completions", b"null"), ("POST", "/v1/completions", b"\xff\xfe\x00"),
    ("POST", "/v1/completions", b'{"prompt": 5}'), ("POST", "/v1/completions", b'{"prompt": "x", "max_tokens": -1}'),
    ("POST", "/v1/completions", b'{"prompt": "x", "max_tokens": 1e999}'),
    ("POST", "/v1/completions", b'{"prompt": "x", "temperature": "hot"}'),
    ("POST", "/v1/completions", b'{"prompt": "x", "stop": [1, 2]}'),
    ("POST", "/v1/completions", b'{"prompt": [99999999999]}'), ("POST", "/v1/completions", b'{"prompt": [-1]}'),
    ("POST", "/v1/completions", b'{"prompt": "x", "model": "another-model"}'),
    pytest.param("POST", "/v1/completions", b"[" * 100_000 + b"]" * 100_000, id="POST /v1/completions nested 1e5 deep"),
    ("POST", "/v1/completions", b'{"prompt": "x", "n": 5}'),
    ("POST", "/v1/chat/completions", b'{"messages": "hi"}'),
    ("POST", "/v1/chat/completions", b'{"messages": []}'),
    ("POST", "/v1/chat/completions", b'{"messages": [{"role": "user"}]}'),
    ("POST", "/v1/chat/completions", b'{"messages": [{"role": "wizard", "content": "hi"}]}'),
    ("PUT", "/v1/caches/..%2Fescape", b'{"document": "x"}'), ("PUT", "/v1/caches/" + "x" * 5000, b"{}"),
    ("PUT", "/v1/caches/ok", b'{"document": 5}'), ("PUT", "/v1/caches/ok", b"{}"),
    ("PUT", "/v1/caches/ok", b'{"document": "x", "prompt": "y"}'), ("PUT", "/v1/caches/%C3%BC", b'{"document": "x"}'),
    ("POST", "/v1/caches/ok/pin", b'{"pinned": "yes"}'), ("DELETE", "/v1/caches/..", b""),
    ("GET", "/v1/caches/no-such-entry", b""), ("PATCH", "/v1/completions", b"{}"), ("GET", "/nowhere", b""),
    # Issue 27, finding 6: a lone UTF-16 surrogate is valid JSON but no text (the tokenizer raised
    # TypeError: a 500); NaN, Infinity and numbers past a float are not JSON numbers.
    ("POST", "/v1/completions", b'{"prompt": "\\ud800", "max_tokens": 2}'),
    ("POST", "/v1/completions", b'{"prompt": ["a\\udfff"], "max_tokens": 2}'),
    ("POST", "/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 2}'),
    ("POST", "/v1/chat/completions",
     b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}], "max_tokens": 2}'),
    ("POST", "/v1/completions", b'{"prompt": "x", "stop": ["\\ud800"], "max_tokens": 2}'),
    ("POST", "/v1/completions", b'{"prompt": "x", "documents": ["\\ud800"], "max_tokens": 2}'),
    ("POST", "/v1/completions", b'{"prompt": "\\ud800", "documents": ["a text"], "max_tokens": 2}'),
    ("POST", "/v1/completions", b'{"prompt": "x", "documents": [{"name": "\\ud800"}], "max_tokens": 2}'),
    ("POST", "/v1/completions", b'{"prompt": "x", "tools": [{"\\ud800": 1}], "max_tokens": 2}'),
    ("PUT", "/v1/caches/ok", b'{"document": "\\ud800"}'), ("PUT", "/v1/caches/ok", b'{"prompt": "\\ud800"}'),
    ("PUT", "/v1/caches/ok", b'{"document": "x", "system": "\\ud800"}'),
    ("PUT", "/v1/caches/ok", b'{"document": "x", "ttl": Infinity}'),
    ("PUT", "/v1/caches/ok", b'{"document": "x", "ttl": 1e999}'),
    ("POST", "/v1/completions", b'{"prompt": "x", "temperature": NaN}'),
    ("POST", "/v1/completions", b'{"prompt": "x", "top_p": -Infinity}'),
]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    if importlib.util.find_spec("tqstore.serve.main") is None:
        pytest.skip("the server (tqstore.serve.main) is not importable yet")
    try:
        from server_process import ServerProcess
    except ImportError:
        pytest.skip("tests/server_process.py (the server's test helper) is not there yet")
    root = tmp_path_factory.mktemp("bad-http")
    model = write_model_folder(root / "model", kind="qwen2")
    proc = ServerProcess(root / "home", model)
    yield proc
    proc.stop()


@pytest.mark.parametrize("method,path,body", BAD_BODIES,
                         ids=lambda v: v[:40].decode(errors="replace") if isinstance(v, bytes) else str(v)[:40])
def test_bad_http_bodies_get_a_4xx_and_the_server_keeps_serving(method, path, body, server, ledger):
    from server_process import request

    status, _, parsed = request(server, method, path, raw=body, headers={"Content-Type": "application/json"})
    shown = f"{method} {path[:40]!r} {body[:40]!r}"
    assert 400 <= status < 500, f"{shown}: {status} {parsed!r:.300}"
    assert isinstance(parsed, dict) and parsed["error"]["message"], f"{shown}: {parsed!r:.300}"
    assert "Traceback" not in json.dumps(parsed), shown
    assert request(server, "GET", "/healthz")[0] == 200 and server.proc.poll() is None, f"the server died: {shown}"
    ledger.count("bad input", f"HTTP bodies: {status}, server kept serving")


def test_http_parsers_refuse_any_json_with_a_4xx(ledger):
    """openai_schema's parsers, fed every JSON value hypothesis makes: a request or a 4xx ApiError."""
    if importlib.util.find_spec("tqstore.serve.openai_schema") is None:
        pytest.skip("tqstore.serve.openai_schema is not importable yet")
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from tqstore.serve import openai_schema as api

    defaults = api.Sampling(max_tokens=16, temperature=0.0, top_p=1.0, seed=None, stop=())
    leaves = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20)
    values = st.recursive(leaves, lambda kids: st.lists(kids, max_size=4) | st.dictionaries(
        st.sampled_from(["prompt", "messages", "document", "max_tokens", "temperature", "top_p", "seed", "stop",
                         "stream", "model", "role", "content", "pinned", "n", "logprobs", "name"])
        | st.text(max_size=8),
        kids, max_size=6), max_leaves=20)
    count = 0

    @settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    @given(values)
    def check(body):
        nonlocal count
        for parse in (lambda b: api.parse_generation(b, chat=False, defaults=defaults),
                      lambda b: api.parse_generation(b, chat=True, defaults=defaults),
                      api.parse_cache_source, api.parse_pin):
            try:
                parse(body)
            except api.ApiError as exc:
                assert 400 <= exc.status < 500, (body, exc.status, exc.message)
            count += 1

    check()
    ledger.count("bad input", "HTTP body parsers: random JSON values, parsed or 4xx", count)


def test_no_config_file_is_written_by_a_refused_setting(tmp_path):
    from tqstore.config import save_config_value

    with pytest.raises(ConfigError):
        save_config_value(tmp_path, "store.lmdb_budget", "-1")
    assert not os.path.exists(tmp_path / "config.toml")
