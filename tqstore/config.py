"""Configuration: defaults, `home/config.toml`, `TQSTORE_*` environment variables and overrides.

Precedence, highest first: explicit overrides (CLI flags) > environment > config file > defaults.
The config file has two tables, each key documented in docs/tiers.md:

    [store]
    lmdb_budget = "20GiB"
    segment_size = "1MiB"

    [s3]
    url = "s3://my-bucket/kv"
    endpoint = "http://127.0.0.1:9000"

Every key `store.K` is also the environment variable `TQSTORE_K` and every `s3.K` is
`TQSTORE_S3_K` (upper case). A bad value raises ConfigError naming where it came from, the
value and what is allowed.
"""

from __future__ import annotations

import os
import re
import tomllib
import urllib.parse
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import tomli_w

from tqstore.durable import write_file_atomic
from tqstore.errors import ConfigError
from tqstore.keys import parse_key
from tqstore.units import GiB, KiB, MiB, format_size, parse_size

CONFIG_FILE = "config.toml"
DEFAULT_HOME = "~/.cache/tqstore"
# The default `store.compose_budget`: half the memory this process may use, leaving the rest to
# the model's weights, the memory tier and everything else on the machine.
COMPOSE_SHARE = 0.5


def usable_memory() -> int:
    """Bytes of memory this process may use: the machine's RAM, or the cgroup's limit (a
    container) when that is lower."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
    except OSError:
        return total
    return min(total, int(limit)) if limit.isdigit() else total


def default_compose_budget() -> int:
    """The default memory budget of one composition of documents (see COMPOSE_SHARE)."""
    return int(usable_memory() * COMPOSE_SHARE)


@dataclass(frozen=True)
class Config:
    """Resolved settings of one tqstore home. Build it with `load_config`."""

    home: Path
    lmdb_budget_bytes: int = 10 * GiB
    memory_budget_bytes: int = 2 * GiB
    # Peak memory one composition of documents (`ask --doc`, the server's `documents`) may be
    # estimated to need before it starts (tqstore/engine/compose_memory.py).
    compose_budget_bytes: int = field(default_factory=default_compose_budget)
    segment_size: int = 1 * MiB
    min_free_disk_bytes: int = 1 * GiB
    # Initial LMDB map size: address space, not disk (the file grows as pages are written);
    # the map is grown on demand past it.
    lmdb_map_size: int = 1 * GiB
    default_scheme: str = "turbo5v4"  # chosen in docs/quality.md (issue 31)
    s3_url: str | None = None
    s3_endpoint: str | None = None
    s3_region: str | None = None
    s3_multipart_threshold: int = 16 * MiB
    s3_part_size: int = 8 * MiB
    s3_concurrency: int = 8
    s3_max_attempts: int = 5
    s3_connect_timeout: float = 10.0
    s3_read_timeout: float = 60.0
    # Encryption at rest (tqstore/store/crypto.py): a file holding the key; $TQSTORE_S3_KEY wins over it.
    s3_key_file: str | None = None
    # MLX's Linux CPU matmul library (tqstore/models/blas.py): "auto" (OpenBLAS where installed),
    # "bundled" or "openblas".
    blas: str = "auto"

    @property
    def lmdb_path(self) -> Path:
        """Directory of the LMDB environment (data.mdb, lock.mdb)."""
        return self.home / "lmdb"

    @property
    def config_path(self) -> Path:
        """The TOML file read by `load_config`."""
        return self.home / CONFIG_FILE

    @property
    def s3_bucket(self) -> str | None:
        """Bucket part of `s3_url` (None when S3 is not configured)."""
        return _split_s3_url(self.s3_url)[0] if self.s3_url else None

    @property
    def s3_prefix(self) -> str:
        """Key prefix inside the bucket: "" or "some/path/" (always ends with '/')."""
        return _split_s3_url(self.s3_url)[1] if self.s3_url else ""


# --- value parsers: (where, raw) -> value; `where` names the source in error messages ---------


@dataclass(frozen=True)
class _Size:
    """A size setting's parser: `parse_size`, then the range lo..hi (hi None: no upper bound)."""

    lo: int
    hi: int | None = None

    def __call__(self, where: str, raw: object) -> int:
        value = parse_size(raw, where)
        if value < self.lo or (self.hi is not None and value > self.hi):
            allowed = (f"from {format_size(self.lo)} to {format_size(self.hi)}" if self.hi
                       else f"of at least {format_size(self.lo)}")
            raise ConfigError(f"{where}={raw!r} is out of range: use a size {allowed}")
        return value


def _number(kind: type, lo: float, hi: float) -> Callable[[str, object], float]:
    def parse(where: str, raw: object) -> float:
        try:
            if isinstance(raw, bool) or not isinstance(raw, (int, float, str)):
                raise ValueError
            value = kind(raw)
        except ValueError:
            raise ConfigError(
                f"{where}={raw!r} is not {'an integer' if kind is int else 'a number'}: "
                f"use one from {lo} to {hi}"
            ) from None
        if not lo <= value <= hi:
            raise ConfigError(f"{where}={raw!r} is out of range: use one from {lo} to {hi}")
        return value

    return parse


def _choice(*allowed: str) -> Callable[[str, object], str]:
    def parse(where: str, raw: object) -> str:
        if raw not in allowed:
            raise ConfigError(f"{where}={raw!r} is not valid: use one of {', '.join(allowed)}")
        return raw

    return parse


def _scheme(where: str, raw: object) -> str:
    from turboquant import parse_scheme

    try:
        return parse_scheme(raw).name
    except ValueError as exc:
        raise ConfigError(f"{where}={raw!r} is not valid: {exc}") from None


def _check_key_file(where: str, raw: str) -> None:
    path = Path(raw).expanduser()
    try:
        parse_key(path.read_text(encoding="ascii"), str(path))
    except (OSError, UnicodeError) as exc:
        raise ConfigError(f"{where}={raw!r}: cannot read the key file: {getattr(exc, 'strerror', None) or exc}; "
                          "write a key first (e.g. `openssl rand -base64 32 > FILE`)") from None


def _text(where: str, raw: object) -> str:
    if not isinstance(raw, str) or not raw.strip() or not raw.isprintable():
        raise ConfigError(f"{where}={raw!r} is not valid: use a non-empty printable string")
    return raw.strip()


_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")


def _split_s3_url(url: str) -> tuple[str, str]:
    rest = url[len("s3://"):]
    bucket, _, prefix = rest.partition("/")
    prefix = prefix.strip("/")
    return bucket, (prefix + "/" if prefix else "")


def _s3_url(where: str, raw: object) -> str:
    help_ = "use s3://BUCKET or s3://BUCKET/PREFIX (bucket: 3-63 of a-z 0-9 . -)"
    if not isinstance(raw, str) or not raw.startswith("s3://") or not raw.isprintable():
        raise ConfigError(f"{where}={raw!r} is not an S3 URL: {help_}")
    bucket, prefix = _split_s3_url(raw)
    if not _BUCKET.fullmatch(bucket) or "//" in prefix or " " in prefix:
        raise ConfigError(f"{where}={raw!r} is not a valid S3 URL: {help_}")
    return f"s3://{bucket}/{prefix}"


def _endpoint(where: str, raw: object) -> str:
    parsed = urllib.parse.urlsplit(raw) if isinstance(raw, str) else None
    if parsed is None or parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise ConfigError(
            f"{where}={raw!r} is not an endpoint URL: use http(s)://HOST[:PORT], "
            "e.g. http://127.0.0.1:9000 (MinIO) or https://ACCOUNT.r2.cloudflarestorage.com (R2)"
        )
    try:
        parsed.port  # noqa: B018 - raises ValueError on a malformed port
    except ValueError:
        raise ConfigError(f"{where}={raw!r} has a malformed port: use http(s)://HOST[:PORT]") from None
    return raw.rstrip("/")


@dataclass(frozen=True)
class Setting:
    """One configuration key: its Config field, its place in the file and its variable."""

    field: str
    table: str
    key: str
    parse: Callable[[str, object], object]

    @property
    def dotted(self) -> str:
        return f"{self.table}.{self.key}"

    @property
    def env(self) -> str:
        return "TQSTORE_" + ("S3_" if self.table == "s3" else "") + self.key.upper()

    @property
    def is_size(self) -> bool:
        """Whether the value is a number of bytes (shown as "5 MiB")."""
        return isinstance(self.parse, _Size)


_SETTINGS = (
    # A budget of 0 would evict every object as soon as it is written.
    Setting("lmdb_budget_bytes", "store", "lmdb_budget", _Size(1)),
    Setting("memory_budget_bytes", "store", "memory_budget", _Size(0)),
    Setting("compose_budget_bytes", "store", "compose_budget", _Size(1 * MiB)),
    Setting("segment_size", "store", "segment_size", _Size(4 * KiB, 256 * MiB)),
    Setting("min_free_disk_bytes", "store", "min_free_disk", _Size(0)),
    Setting("lmdb_map_size", "store", "lmdb_map_size", _Size(1 * MiB)),
    Setting("default_scheme", "store", "default_scheme", _scheme),
    Setting("s3_url", "s3", "url", _s3_url),
    Setting("s3_endpoint", "s3", "endpoint", _endpoint),
    Setting("s3_region", "s3", "region", _text),
    # S3 multipart limits: parts of at least 5 MiB (but the last), at most 5 GiB.
    Setting("s3_multipart_threshold", "s3", "multipart_threshold", _Size(5 * MiB, 5 * GiB)),
    Setting("s3_part_size", "s3", "part_size", _Size(5 * MiB, 5 * GiB)),
    Setting("s3_concurrency", "s3", "concurrency", _number(int, 1, 64)),
    Setting("s3_max_attempts", "s3", "max_attempts", _number(int, 1, 20)),
    Setting("s3_connect_timeout", "s3", "connect_timeout", _number(float, 0.1, 3600.0)),
    Setting("s3_read_timeout", "s3", "read_timeout", _number(float, 0.1, 3600.0)),
    Setting("s3_key_file", "s3", "key_file", _text),
    Setting("blas", "store", "blas", _choice("auto", "bundled", "openblas")),
)
_BY_FIELD = {s.field: s for s in _SETTINGS}
_BY_DOTTED = {s.dotted: s for s in _SETTINGS}


def config_keys() -> list[str]:
    """The keys a config file may hold, as `table.key` (what `save_config_value` accepts)."""
    return [s.dotted for s in _SETTINGS]


def setting(name: str) -> Setting:
    """The setting called `name` (`table.key` or the Config field); ConfigError if unknown."""
    found = _BY_DOTTED.get(name) or _BY_FIELD.get(name)
    if found is None:
        raise ConfigError(f"unknown config key {name!r}: known keys are {', '.join(config_keys())}")
    return found


def resolve_home(home: str | os.PathLike[str] | None = None) -> Path:
    """The home folder: `home` if given, else `$TQSTORE_HOME`, else ~/.cache/tqstore."""
    chosen = home if home is not None else os.environ.get("TQSTORE_HOME") or DEFAULT_HOME
    path = Path(chosen).expanduser().absolute()
    if path.exists() and not path.is_dir():
        raise ConfigError(f"tqstore home {str(path)!r} exists and is not a folder: choose another --home")
    return path


def load_config(
    home: str | os.PathLike[str] | None = None, overrides: Mapping[str, object] | None = None
) -> Config:
    """Resolve the configuration of `home` (see `resolve_home`).

    `overrides` maps Config field names (e.g. "segment_size") or `table.key` names to values
    (strings are parsed like the environment); None values mean "not given" and are skipped.
    """
    home_path = resolve_home(home)
    values: dict[str, object] = {}
    for _, setting, where, raw in _given(home_path / CONFIG_FILE):
        values[setting.field] = setting.parse(where, raw)
    for name, raw in (overrides or {}).items():
        setting = _BY_FIELD.get(name) or _BY_DOTTED.get(name)
        if setting is None:
            raise ConfigError(f"unknown setting {name!r}: known settings are {', '.join(_BY_FIELD)}")
        if raw is not None:
            values[setting.field] = setting.parse(name, raw)
    return Config(home=home_path, **values)


def sources(config: Config) -> dict[str, str]:
    """Where each setting of `config` comes from, by `table.key`: "env", "file" or "default"
    (overrides are not known here: `config` records only the result)."""
    found = dict.fromkeys(config_keys(), "default")
    for source, setting, _, _ in _given(config.config_path):
        found[setting.dotted] = source
    return found


def _given(path: Path) -> Iterator[tuple[str, Setting, str, object]]:
    """(source, setting, where, raw value) of each value the config file at `path`, then the
    environment, gives; ConfigError for an unknown key in the file."""
    for table, entries in _read_toml(path).items():
        for key, raw in entries.items():
            setting = _BY_DOTTED.get(f"{table}.{key}")
            if setting is None:
                raise ConfigError(
                    f"unknown key [{table}] {key} in {path}: known keys are {', '.join(config_keys())}"
                )
            yield "file", setting, f"{path} [{table}] {key}", raw
    for setting in _SETTINGS:
        raw = os.environ.get(setting.env)
        if raw:  # an empty variable counts as unset, as shells make that easy to do by accident
            yield "env", setting, setting.env, raw


def save_config_value(home: str | os.PathLike[str] | None, key: str, value: object) -> Path:
    """Set `key` ("s3.url", or the field name "s3_url") in home/config.toml; None removes it.

    The value is validated first. The file is replaced atomically (tmp file, fsync, rename, fsync
    of the folder), so a crash leaves the old file or the new one, never a torn one. Comments in
    the file are not kept. Returns the path written.
    """
    chosen = setting(key)
    if value is not None:
        parsed = chosen.parse(key, value)
        if chosen.field == "s3_key_file":  # only when set: a missing file must not stop local use
            _check_key_file(key, parsed)
            # Stored absolute: a relative path was checked against this directory and then read
            # against every later command's (`ls` elsewhere: "cannot read the key file").
            value = str(Path(parsed).expanduser().resolve())
    home_path = resolve_home(home)
    path = home_path / CONFIG_FILE
    data = _read_toml(path)
    table = data.setdefault(chosen.table, {})
    if value is None:
        table.pop(chosen.key, None)
    else:
        table[chosen.key] = value
    home_path.mkdir(parents=True, exist_ok=True)
    write_file_atomic(path, _dump_toml(data).encode())
    return path


def _read_toml(path: Path) -> dict[str, dict[str, object]]:
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        return {}
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot parse {path}: {exc}; fix the file or delete it") from None
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror}") from None
    for table, entries in data.items():
        if not isinstance(entries, dict):
            raise ConfigError(
                f"{path}: {table!r} must be a table ([store] or [s3]); keys go inside a table"
            )
    return data


def _dump_toml(data: Mapping[str, Mapping[str, object]]) -> str:
    tables = {table: dict(entries) for table, entries in data.items() if entries}
    return "# tqstore configuration (docs/tiers.md lists the keys)\n\n" + tomli_w.dumps(tables)
