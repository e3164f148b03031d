import base64
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tqstore.config import Config, config_keys, load_config, save_config_value, setting, sources
from tqstore.errors import ConfigError, DiskFull


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in list(os.environ):
        if name.startswith("TQSTORE_"):
            monkeypatch.delenv(name)


def write_config(home: Path, text: str) -> None:
    home.mkdir(parents=True, exist_ok=True)
    (home / "config.toml").write_text(text)


def test_defaults(tmp_path):
    config = load_config(tmp_path)
    assert config == Config(home=tmp_path)
    assert config.segment_size == 1 << 20
    assert config.default_scheme == "turbo5v4"
    assert config.s3_url is None and config.s3_bucket is None and config.s3_prefix == ""
    assert config.lmdb_path == tmp_path / "lmdb"


def test_home_argument_then_environment_then_default(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "user"))
    assert load_config().home == tmp_path / "user" / ".cache" / "tqstore"
    monkeypatch.setenv("TQSTORE_HOME", str(tmp_path / "env"))
    assert load_config().home == tmp_path / "env"
    assert load_config(tmp_path / "arg").home == tmp_path / "arg"
    assert load_config("~/x").home == tmp_path / "user" / "x"


def test_home_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "f").write_text("")
    with pytest.raises(ConfigError, match="not a folder"):
        load_config(tmp_path / "f")


def test_precedence_overrides_then_env_then_file_then_default(tmp_path, monkeypatch):
    write_config(tmp_path, '[store]\nsegment_size = "2MiB"\nlmdb_budget = "1GB"\n[s3]\nconcurrency = 3\n')
    config = load_config(tmp_path)
    assert (config.segment_size, config.lmdb_budget_bytes, config.s3_concurrency) == (2 << 20, 10**9, 3)
    monkeypatch.setenv("TQSTORE_SEGMENT_SIZE", "4MiB")
    monkeypatch.setenv("TQSTORE_S3_CONCURRENCY", "5")
    config = load_config(tmp_path)
    assert (config.segment_size, config.lmdb_budget_bytes, config.s3_concurrency) == (4 << 20, 10**9, 5)
    config = load_config(tmp_path, overrides={"segment_size": "8MiB", "s3.concurrency": 7, "s3_url": None})
    assert (config.segment_size, config.s3_concurrency, config.s3_url) == (8 << 20, 7, None)


def test_empty_environment_variable_counts_as_unset(tmp_path, monkeypatch):
    monkeypatch.setenv("TQSTORE_S3_URL", "")
    assert load_config(tmp_path).s3_url is None


def test_s3_settings_from_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("TQSTORE_S3_URL", "s3://my-bucket/team/kv/")
    monkeypatch.setenv("TQSTORE_S3_ENDPOINT", "http://127.0.0.1:9000/")
    monkeypatch.setenv("TQSTORE_S3_REGION", "auto")
    config = load_config(tmp_path)
    assert (config.s3_bucket, config.s3_prefix) == ("my-bucket", "team/kv/")
    assert config.s3_endpoint == "http://127.0.0.1:9000"
    assert config.s3_region == "auto"
    monkeypatch.setenv("TQSTORE_S3_URL", "s3://my-bucket")
    assert (load_config(tmp_path).s3_bucket, load_config(tmp_path).s3_prefix) == ("my-bucket", "")


def test_one_duration_grammar_for_flags():
    import argparse

    from cli.arguments import duration
    from tqstore.serve.options import parse_args

    def save_ttl(raw: str) -> float:
        return parse_args(["--model", "m", "--save-ttl", raw]).save_ttl

    assert duration("1w") == save_ttl("1w") == 604800.0
    with pytest.raises(argparse.ArgumentTypeError):
        duration("0")
    assert save_ttl("0") == 0.0


def test_a_body_limit_no_request_fits_is_refused(capsys):
    from tqstore.serve.options import parse_args

    # --max-body-bytes 0 started a server that answered every POST with 413.
    assert parse_args(["--model", "m", "--max-body-bytes", "1KiB"]).max_body_bytes == 1024
    for raw in ("0", "1023"):
        with pytest.raises(SystemExit):
            parse_args(["--model", "m", "--max-body-bytes", raw])
        assert "below 1KiB" in capsys.readouterr().err


@pytest.mark.parametrize(
    "variable, value, allowed",
    [
        ("TQSTORE_SEGMENT_SIZE", "lots", "KiB, MiB"),
        ("TQSTORE_SEGMENT_SIZE", "1KiB", "from 4 KiB to 256 MiB"),
        ("TQSTORE_S3_PART_SIZE", "1MiB", "from 5 MiB"),
        ("TQSTORE_S3_CONCURRENCY", "many", "an integer"),
        ("TQSTORE_S3_CONCURRENCY", "0", "from 1 to 64"),
        ("TQSTORE_S3_READ_TIMEOUT", "-3", "from 0.1"),
        ("TQSTORE_S3_URL", "http://bucket/x", "s3://BUCKET"),
        ("TQSTORE_S3_URL", "s3://B", "s3://BUCKET"),
        ("TQSTORE_S3_ENDPOINT", "localhost:9000", "http(s)://HOST"),
        ("TQSTORE_S3_ENDPOINT", "http://host:port", "port"),
    ],
)
def test_bad_environment_values_name_variable_value_and_rule(tmp_path, monkeypatch, variable, value, allowed):
    monkeypatch.setenv(variable, value)
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path)
    message = str(info.value)
    assert variable in message and repr(value) in message and allowed in message


def test_bad_file_value_names_file_and_key(tmp_path):
    write_config(tmp_path, "[s3]\nconcurrency = true\n")
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path)
    assert "config.toml [s3] concurrency" in str(info.value) and "True" in str(info.value)


def test_unknown_keys_are_refused_with_the_known_ones(tmp_path):
    write_config(tmp_path, "[store]\nsegmentsize = 4096\n")
    with pytest.raises(ConfigError, match="unknown key .* segmentsize.*store.segment_size"):
        load_config(tmp_path)
    write_config(tmp_path, "segment_size = 4096\n")
    with pytest.raises(ConfigError, match="must be a table"):
        load_config(tmp_path)
    with pytest.raises(ConfigError, match="unknown setting 'nope'"):
        load_config(tmp_path / "other", overrides={"nope": 1})


def test_unparseable_file_names_the_file(tmp_path):
    write_config(tmp_path, "[store\n")
    with pytest.raises(ConfigError, match="cannot parse .*config.toml"):
        load_config(tmp_path)


def test_save_config_value_round_trips_and_removes(tmp_path):
    home = tmp_path / "new-home"
    path = save_config_value(home, "s3.url", "s3://bucket-a/p")
    save_config_value(home, "segment_size", "2MiB")
    save_config_value(home, "s3.concurrency", 4)
    assert path == home / "config.toml"
    data = tomllib.loads(path.read_text())
    assert data == {"s3": {"url": "s3://bucket-a/p", "concurrency": 4}, "store": {"segment_size": "2MiB"}}
    config = load_config(home)
    assert (config.s3_bucket, config.segment_size, config.s3_concurrency) == ("bucket-a", 2 << 20, 4)
    save_config_value(home, "s3.url", None)
    assert load_config(home).s3_url is None
    assert sorted(p.name for p in home.iterdir()) == ["config.toml"]  # no temp files left


def test_save_config_value_refuses_bad_values_and_keeps_the_file(tmp_path):
    save_config_value(tmp_path, "store.lmdb_budget", "20GiB")
    before = (tmp_path / "config.toml").read_bytes()
    with pytest.raises(ConfigError, match="store.lmdb_budget='twenty'"):
        save_config_value(tmp_path, "store.lmdb_budget", "twenty")
    with pytest.raises(ConfigError, match="unknown config key 'store.nope'"):
        save_config_value(tmp_path, "store.nope", 1)
    assert (tmp_path / "config.toml").read_bytes() == before


def test_save_config_value_failure_leaves_old_file_and_no_temp(tmp_path, monkeypatch):
    save_config_value(tmp_path, "s3.region", "eu-west-1")
    before = (tmp_path / "config.toml").read_bytes()

    def broken_replace(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(DiskFull, match="no space left"):
        save_config_value(tmp_path, "s3.region", "us-east-2")
    assert (tmp_path / "config.toml").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.toml"]


def test_saved_strings_are_escaped(tmp_path):
    save_config_value(tmp_path, "s3.region", 'we"ird\\region')
    assert load_config(tmp_path).s3_region == 'we"ird\\region'


def test_every_key_has_an_environment_variable(tmp_path, monkeypatch):
    values = {
        "store.lmdb_budget": "1GiB", "store.memory_budget": "1GiB", "store.compose_budget": "3GiB",
        "store.segment_size": "64KiB",
        "store.min_free_disk": "0", "store.lmdb_map_size": "8MiB", "store.default_scheme": "turbo4",
        "s3.url": "s3://abc", "s3.endpoint": "https://x.r2.cloudflarestorage.com", "s3.region": "auto",
        "s3.multipart_threshold": "32MiB", "s3.part_size": "6MiB", "s3.concurrency": "2",
        "s3.max_attempts": "2", "s3.connect_timeout": "1.5", "s3.read_timeout": "9",
        "s3.key_file": "~/.config/tqstore/s3.key", "store.blas": "openblas",
    }
    assert sorted(values) == sorted(config_keys())
    for key, value in values.items():
        table, name = key.split(".")
        monkeypatch.setenv("TQSTORE_" + ("S3_" if table == "s3" else "") + name.upper(), value)
    config = load_config(tmp_path)
    assert config.segment_size == 64 << 10 and config.s3_part_size == 6 << 20
    assert config.s3_connect_timeout == 1.5 and config.s3_max_attempts == 2 and config.blas == "openblas"
    assert config.default_scheme == "turbo4" and config.lmdb_map_size == 8 << 20
    assert config.compose_budget_bytes == 3 << 30


def test_key_file_is_checked_with_the_key_rule(tmp_path):
    bad, good = tmp_path / "bad.key", tmp_path / "good.key"
    bad.write_text("not a key\n")
    good.write_text(base64.b64encode(bytes(range(32))).decode() + "\n")
    with pytest.raises(ConfigError, match="bad.key is not base64 of 32 bytes"):
        save_config_value(tmp_path, "s3.key_file", str(bad))
    save_config_value(tmp_path, "s3.key_file", str(good))
    assert load_config(tmp_path).s3_key_file == str(good)


def test_config_imports_nothing_from_the_store(tmp_path):
    # The foundation sits below the store: checking a key file must not load tqstore.store.
    key = tmp_path / "k"
    key.write_text(base64.b64encode(bytes(32)).decode())
    code = ("import sys; from tqstore.config import save_config_value; "
            f"save_config_value({str(tmp_path)!r}, 's3.key_file', {str(key)!r}); "
            "print(sorted(m for m in sys.modules if m.startswith('tqstore.store')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def test_sources_say_where_each_value_comes_from(tmp_path, monkeypatch):
    write_config(tmp_path, '[store]\nsegment_size = "2MiB"\nlmdb_budget = "1GB"\n')
    monkeypatch.setenv("TQSTORE_SEGMENT_SIZE", "4MiB")
    monkeypatch.setenv("TQSTORE_S3_REGION", "")  # empty: unset, like load_config reads it
    found = sources(load_config(tmp_path))
    assert sorted(found) == sorted(config_keys())
    assert (found["store.segment_size"], found["store.lmdb_budget"], found["s3.region"]) == ("env", "file", "default")
    assert [k for k in config_keys() if setting(k).is_size] == [
        "store.lmdb_budget", "store.memory_budget", "store.compose_budget", "store.segment_size",
        "store.min_free_disk", "store.lmdb_map_size", "s3.multipart_threshold", "s3.part_size"]


def test_a_relative_key_file_is_stored_absolute(tmp_path, monkeypatch):
    # It was stored as given, checked against this directory and then read against every later
    # command's, so `tqstore ls` elsewhere failed with "cannot read the key file".
    import base64

    (tmp_path / "keys").mkdir()
    (tmp_path / "keys" / "rel.key").write_text(base64.b64encode(bytes(32)).decode())
    monkeypatch.chdir(tmp_path / "keys")
    save_config_value(tmp_path / "home", "s3.key_file", "rel.key")
    monkeypatch.chdir(tmp_path)
    assert load_config(tmp_path / "home").s3_key_file == str(tmp_path / "keys" / "rel.key")
