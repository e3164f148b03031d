"""A model folder's files and their digests: config and tokenizer files, the chat template mlx-lm
would use, adapter weights (hashed once per file version, in a small digest cache) and the float
dtype of the weights. What `ModelIdentity.from_folder` is made of."""

from __future__ import annotations

import hashlib
import json
import os
import struct
import time
from pathlib import Path
from typing import Any, Mapping

from tqstore.canonical import canonical_json
from tqstore.durable import write_cache_file
from tqstore.errors import ConfigError, NotFound

TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "merges.txt",
    "special_tokens_map.json", "added_tokens.json", "vocab.txt", "spiece.model",
)
DIGEST_CACHE_FILE = "file-digests.json"
_CHUNK = 1 << 23


def read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise NotFound(f"{path} does not exist: pass a model folder (config.json, weights, tokenizer)")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"cannot read {path}: {e}; fix or re-download the model") from e
    if not isinstance(data, dict):
        raise ConfigError(f"{path} is not a JSON object; fix or re-download the model")
    return data


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


class DigestCache:
    """sha256 of files, in one small JSON file, reused only while a file is provably unchanged.

    Size and mtime alone are not enough: `cp -p`, `rsync -a`, `touch -r` and normalised archives
    give other bytes the same size and mtime. An entry is keyed by the real path and holds the
    device, inode, size, mtime and ctime it was hashed at: writing the file or renaming another
    over it changes the ctime or the inode, and only the kernel sets a ctime. A file changed
    within RACY_NS of its hashing (coarse timestamps could hide a second change) is hashed again.
    """

    VERSION = 2
    RACY_NS = 2_000_000_000

    def __init__(self, cache_dir: Path):
        self.path = cache_dir / DIGEST_CACHE_FILE
        self.entries: dict[str, dict[str, Any]] = {}
        self.dirty = False
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
            if isinstance(data, dict) and data.get("version") == self.VERSION and isinstance(data.get("files"), dict):
                self.entries = data["files"]
        except (OSError, ValueError):
            pass  # a missing, old or damaged cache only costs a re-hash

    def file_sha256(self, path: Path) -> str:
        real = os.path.realpath(path)
        before = _fingerprint(os.stat(real))
        hit = self.entries.get(real)
        if isinstance(hit, dict) and isinstance(hit.get("sha256"), str) and hit.get("stat") == before \
                and isinstance(hit.get("hashed_ns"), int) and before[-1] < hit["hashed_ns"] - self.RACY_NS:
            return hit["sha256"]
        hashed_ns = time.time_ns()
        digest = file_sha256(Path(real))
        after = _fingerprint(os.stat(real))
        if after == before:  # changed while being read: hash again next time
            self.entries[real] = {"stat": after, "hashed_ns": hashed_ns, "sha256": digest}
            self.dirty = True
        return digest

    def save(self) -> None:
        """Write the cache if it changed; skipped on a full disk (it only saves re-hashing)."""
        if self.dirty:
            write_cache_file(self.path, canonical_json({"version": self.VERSION, "files": self.entries}))
            self.dirty = False


def _fingerprint(st: os.stat_result) -> list[int]:
    """What identifies one version of a file's bytes short of reading them (ctime last)."""
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def adapter_digest(path: Path, cache: DigestCache) -> str:
    if path.is_file():
        files = [path]
    elif path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix == ".safetensors" or p.name == "adapter_config.json")
    else:
        files = []
    if not files:
        raise NotFound(f"no adapter weights at {path}: pass the adapter folder (adapters.safetensors) or file")
    listing = [{"name": p.name, "sha256": cache.file_sha256(p)} for p in files]
    return hashlib.sha256(canonical_json(listing)).hexdigest()


def tokenizer_files_digest(model_dir: Path) -> str | None:
    files = [model_dir / n for n in TOKENIZER_FILES if (model_dir / n).is_file()]
    files += sorted(model_dir.glob("*.tiktoken"))
    if not files:
        return None
    return hashlib.sha256(canonical_json([[p.name, file_sha256(p)] for p in files])).hexdigest()


def chat_template_digest(model_dir: Path) -> str | None:
    """The template mlx-lm would use: chat_template.jinja, chat_template.json, tokenizer_config."""
    template = None
    jinja = model_dir / "chat_template.jinja"
    if jinja.is_file():
        template = jinja.read_text(encoding="utf-8")
    else:
        for name in ("chat_template.json", "tokenizer_config.json"):
            if (model_dir / name).is_file():
                template = read_json(model_dir / name).get("chat_template")
                if template is not None:
                    break
    return None if template is None else hashlib.sha256(canonical_json(template)).hexdigest()


def config_dtype(config: Mapping[str, Any]) -> str | None:
    text = config.get("text_config") if isinstance(config.get("text_config"), Mapping) else {}
    for c in (config, text):
        for key in ("torch_dtype", "dtype"):
            value = c.get(key)
            if isinstance(value, str) and value in ("float16", "bfloat16", "float32"):
                return value
    return None


_SAFETENSORS_FLOATS = {"F16": "float16", "BF16": "bfloat16", "F32": "float32"}


def weights_dtype(files: list[Path]) -> str:
    """The float dtype holding the most bytes across the weight files (from their headers)."""
    totals: dict[str, int] = {}
    for path in files:
        try:
            with open(path, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(min(n, 100 << 20)))
        except (OSError, ValueError, struct.error) as e:
            raise ConfigError(f"cannot read the safetensors header of {path}: {e}; re-download the model") from e
        for name, t in header.items():
            if name != "__metadata__" and isinstance(t, dict) and t.get("dtype") in _SAFETENSORS_FLOATS:
                start, end = t.get("data_offsets", (0, 0))
                totals[_SAFETENSORS_FLOATS[t["dtype"]]] = totals.get(_SAFETENSORS_FLOATS[t["dtype"]], 0) + end - start
    return max(totals, key=totals.get) if totals else "float32"
