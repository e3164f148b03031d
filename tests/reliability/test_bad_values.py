"""Bad values are refused where they enter, with the valid choices in the message (issue 19,
finding 8): seeds in HTTP bodies, `tqstore config set`, environment variables and CLI flags.
Before, a seed of -1 or 2**70 was an HTTP 500, and a bogus default scheme, a missing key file,
a fractional or zero budget were accepted and turned every later save into an internal error.
Real subprocesses: the server, and the `tqstore` command.
"""

from __future__ import annotations

import pytest

from harness import child_env, cli
from model_folder import write_model_folder
from server_process import ServerProcess, request
from tqstore.config import load_config
from tqstore.errors import ConfigError

BAD_SEEDS = [-1, 2**64, 2**70, -(2**70)]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return write_model_folder(tmp_path_factory.mktemp("values") / "tiny-qwen2", kind="qwen2")


def test_bad_seeds_are_a_400_naming_the_range(tiny_model, tmp_path, ledger):
    server = ServerProcess(tmp_path / "home", tiny_model, "--no-save")
    try:
        for seed in BAD_SEEDS:
            for stream in (False, True):
                body = {"prompt": "Who pays?", "max_tokens": 2, "temperature": 0.7, "seed": seed, "stream": stream}
                status, _, out = request(server, "POST", "/v1/completions", body)
                assert status == 400, (seed, stream, status, out)
                assert "seed" in out["error"]["message"] and "2**64 - 1" in out["error"]["message"], out
                # checked with the body: param and code as for any bad field (they were null)
                assert (out["error"]["param"], out["error"]["code"]) == ("seed", "invalid_value"), out
                ledger.count("bad input/seeds over HTTP", "400 naming the range")
        status, _, out = request(server, "POST", "/v1/completions",
                                 {"prompt": "Who pays?", "max_tokens": 2, "temperature": 0.7, "seed": 2**64 - 1})
        assert status == 200 and out["usage"]["completion_tokens"] == 2
        ledger.count("bad input/seeds over HTTP", "largest seed served")
    finally:
        assert server.stop() == 0, server.log()


BAD_SETTINGS = [
    ("store.default_scheme", "bogus", "turbo4"),
    ("store.default_scheme", "", "turbo4"),
    ("s3.key_file", "/nonexistent/key", "cannot read the key file"),
    ("store.memory_budget", "0.5", "whole number of bytes"),
    ("store.lmdb_budget", "0", "at least"),
    ("store.lmdb_budget", "1.5B", "whole number of bytes"),
]


@pytest.mark.parametrize("key,value,says", BAD_SETTINGS, ids=lambda v: str(v)[:24])
def test_config_set_refuses_bad_values_with_what_is_allowed(key, value, says, tmp_path, ledger):
    home = tmp_path / "home"
    env = child_env(TQSTORE_HOME=str(home))
    done = cli("config", "set", key, value, env=env)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1 and len(lines) == 1 and says in lines[0], (done.returncode, done.stderr)
    assert "internal error" not in done.stderr.lower()
    assert not (home / "config.toml").exists()
    ledger.count("bad input/config set", "refused with what is allowed, nothing written")


@pytest.mark.parametrize("var,value", [("TQSTORE_DEFAULT_SCHEME", "turbo9"), ("TQSTORE_MEMORY_BUDGET", "0.5"),
                                       ("TQSTORE_LMDB_BUDGET", "0")])
def test_bad_environment_values_are_refused_at_load(var, value, tmp_path, monkeypatch, ledger):
    monkeypatch.setenv(var, value)
    with pytest.raises(ConfigError, match=var):
        load_config(tmp_path / "home")
    done = cli("ls", env=child_env(TQSTORE_HOME=str(tmp_path / "home"), **{var: value}))
    assert done.returncode == 1 and var in done.stderr and "internal error" not in done.stderr.lower()
    ledger.count("bad input/environment", "refused at load naming the variable")


def test_an_empty_scheme_flag_is_an_error_not_the_default(tiny_model, tmp_path, ledger):
    env = child_env(TQSTORE_HOME=str(tmp_path / "home"))
    done = cli("save", "doc", "--model", str(tiny_model), "--prompt", "The seller pays.", "--scheme", "", env=env)
    assert done.returncode == 1 and "valid schemes: raw" in done.stderr, done.stderr
    assert cli("ls", "--json", env=env).stdout.count('"name"') == 0
    ledger.count("bad input/--scheme ''", "refused listing the schemes")
