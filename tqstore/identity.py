"""What a stored cache is valid for: the model identity and the codec identity.

A cache restored into anything but the model, tokenizer, chat template, adapter and KV dtype
it was computed with, or decoded with other codebooks or rotations, loads cleanly and answers
wrongly. Both identities are sha256 digests of a canonical JSON (sorted keys, no spaces), so
they are the same in every process and on every machine, and `describe_difference` names what
changed when a digest does not match.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from turboquant.schemes import parse_scheme
from turboquant.records import CodecRecord, Snapshot

from .durable import write_file_atomic
from .errors import ConfigError, NotFound

# The snapshot format version. format.py writes it into every frame and the codec identity
# hashes it, so objects written under another format are never found by key.
FORMAT_VERSION = 1

# Config fields that change what the KV cache holds or how positions are encoded.
KV_CONFIG_FIELDS = (
    "model_type", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
    "hidden_size", "layer_types", "sliding_window", "sliding_window_pattern", "use_sliding_window",
    "max_window_layers", "attention_chunk_size", "no_rope_layers", "rope_theta", "rope_scaling",
    "rope_parameters", "rope_local_base_freq", "rope_traditional", "partial_rotary_factor",
    "max_position_embeddings", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim",
)
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "merges.txt",
    "special_tokens_map.json", "added_tokens.json", "vocab.txt", "spiece.model",
)
DIGEST_CACHE_FILE = "file-digests.json"
_CHUNK = 1 << 23

# (mx dtype, safetensors code, unsigned dtype of the same width) per dtype name.
DTYPES: dict[str, tuple[mx.Dtype, str, mx.Dtype]] = {
    "float16": (mx.float16, "F16", mx.uint16),
    "bfloat16": (mx.bfloat16, "BF16", mx.uint16),
    "float32": (mx.float32, "F32", mx.uint32),
    "uint8": (mx.uint8, "U8", mx.uint8),
    "uint16": (mx.uint16, "U16", mx.uint16),
    "uint32": (mx.uint32, "U32", mx.uint32),
    "uint64": (mx.uint64, "U64", mx.uint64),
    "int8": (mx.int8, "I8", mx.uint8),
    "int16": (mx.int16, "I16", mx.uint16),
    "int32": (mx.int32, "I32", mx.uint32),
    "int64": (mx.int64, "I64", mx.uint64),
}
_NP_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def canonical_json(obj: Any) -> bytes:
    """The canonical JSON bytes that identities and headers hash (sorted keys, compact, ASCII)."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()


def dtype_name(dtype: mx.Dtype) -> str:
    """'float16', 'bfloat16', ... for an MLX dtype."""
    return str(dtype).rsplit(".", 1)[-1]


def tensor_bytes(a: mx.array) -> np.ndarray:
    """The array's bytes, C order, little-endian, as a flat uint8 numpy array.

    Goes through an unsigned view of the same width, so bfloat16 (which numpy lacks) and NaN
    payloads come out bit for bit.
    """
    name = dtype_name(a.dtype)
    if name not in DTYPES:
        raise ValueError(f"dtype {name} cannot be stored (supported: {', '.join(DTYPES)})")
    unsigned = DTYPES[name][2]
    view = a if a.dtype == unsigned else a.view(unsigned)
    return np.ascontiguousarray(np.asarray(view)).reshape(-1).view(np.uint8)


def tensor_from_bytes(data, dtype: str, shape: tuple[int, ...]) -> mx.array:
    """Inverse of `tensor_bytes` (copies `data` into a new MLX array)."""
    mx_dtype, _, unsigned = DTYPES[dtype]
    n = np.frombuffer(data, dtype=_NP_UINT[unsigned.size])
    if n.ctypes.data % unsigned.size:
        n = n.copy()  # safetensors data offsets need not be aligned
    a = mx.array(n.reshape(shape))
    return a if mx_dtype == unsigned else a.view(mx_dtype)


def tensor_summary(a: mx.array) -> dict[str, Any]:
    """{"dtype", "shape", "sha256"}: what identities hash for an array."""
    return {"dtype": dtype_name(a.dtype), "shape": list(a.shape),
            "sha256": hashlib.sha256(tensor_bytes(a)).hexdigest()}


def codecs_digest(codecs: Mapping[str, CodecRecord]) -> bytes:
    """Content digest of a snapshot's codecs (the key of the entry's shared object)."""
    return hashlib.sha256(canonical_json(_codec_fields(codecs))).digest()


def _codec_fields(codecs: Mapping[str, CodecRecord]) -> dict[str, Any]:
    return {name: {"rotation_kind": c.rotation_kind, "norm_mode": c.norm_mode,
                   "arrays": {k: tensor_summary(v) for k, v in sorted(c.arrays.items())}}
            for name, c in sorted(codecs.items())}


class _Digestible:
    """A dataclass whose digest is the sha256 of the canonical JSON of `fields()`."""

    def fields(self) -> dict[str, Any]:
        return {f.name: _jsonable(getattr(self, f.name)) for f in dataclasses.fields(self) if f.compare}

    @property
    def digest(self) -> bytes:
        """32 raw bytes (what block keys chain)."""
        return hashlib.sha256(canonical_json(self.fields())).digest()

    @property
    def hexdigest(self) -> str:
        return self.digest.hex()


@dataclass(frozen=True)
class ModelIdentity(_Digestible):
    """The model a cache belongs to. `source` (a path or a name) is for messages only, never hashed."""

    weights: str
    config: Mapping[str, Any]
    tokenizer: str | None
    chat_template: str | None
    adapter: str | None
    kv_dtype: str
    source: str = field(default="", compare=False)

    @classmethod
    def from_path(
        cls,
        model_dir: str | os.PathLike,
        cache_dir: str | os.PathLike,
        adapter_path: str | os.PathLike | None = None,
        kv_dtype: str | None = None,
    ) -> "ModelIdentity":
        """Identity of a model folder (config.json, model*.safetensors, tokenizer files).

        Each weight file's sha256 is computed once and cached in `cache_dir` under its real
        path, size and mtime, so only a changed file is read again. `kv_dtype` defaults to the
        config's torch_dtype, else the dominant float dtype of the weight files.
        """
        model_dir = Path(model_dir)
        config = _read_json(model_dir / "config.json")
        weights = sorted(model_dir.glob("model*.safetensors")) or sorted(model_dir.glob("*.safetensors"))
        if not weights:
            raise NotFound(f"no weight files (model*.safetensors) in {model_dir}: pass the folder that holds "
                           "the model's config.json and weights")
        cache = _DigestCache(Path(cache_dir))
        listing = [{"name": p.name, "size": p.stat().st_size, "sha256": cache.file_sha256(p)} for p in weights]
        adapter = None
        if adapter_path is not None:
            adapter = _adapter_digest(Path(adapter_path), cache)
        cache.save()
        return cls(
            weights=hashlib.sha256(canonical_json(listing)).hexdigest(),
            config=kv_config(config),
            tokenizer=_tokenizer_files_digest(model_dir),
            chat_template=_chat_template_digest(model_dir),
            adapter=adapter,
            kv_dtype=kv_dtype or _config_dtype(config) or _weights_dtype(weights),
            source=model_dir.resolve().name,
        )

    @classmethod
    def from_model(cls, model, tokenizer=None, kv_dtype: str | None = None) -> "ModelIdentity":
        """Identity of a model held in memory: its parameters' bytes (name order) and its args.

        Gives a different digest than `from_path` for the same weights (parameters vs file
        bytes): a store must use one of the two consistently.
        """
        args = _jsonable(_model_args(model))
        params = sorted(tree_flatten(model.parameters()), key=lambda kv: kv[0])
        h = hashlib.sha256(canonical_json(args))
        floats: dict[str, int] = {}
        for name, a in params:
            h.update(canonical_json([name, dtype_name(a.dtype), list(a.shape)]))
            h.update(tensor_bytes(a))
            if mx.issubdtype(a.dtype, mx.floating):
                floats[dtype_name(a.dtype)] = floats.get(dtype_name(a.dtype), 0) + a.nbytes
        tok, template = _tokenizer_digests(tokenizer)
        return cls(
            weights=h.hexdigest(),
            config=kv_config(args if isinstance(args, dict) else {}),
            tokenizer=tok,
            chat_template=template,
            adapter=None,
            kv_dtype=kv_dtype or (max(floats, key=floats.get) if floats else "float32"),
            source=str(getattr(getattr(model, "args", None), "model_type", type(model).__name__)),
        )


@dataclass(frozen=True)
class CodecIdentity(_Digestible):
    """How a cache's arrays are encoded: data-independent, so a snapshot of fresh, empty caches
    has the same codec identity as a full one (layouts and calibration are not part of it)."""

    scheme: str
    layers: tuple[Mapping[str, Any], ...]
    codecs: Mapping[str, Any]
    format_version: int = FORMAT_VERSION

    @classmethod
    def from_snapshot(cls, snapshot: Snapshot, scheme: str) -> "CodecIdentity":
        """The canonical scheme name, every layer's config and a sha256 of every codec array."""
        return cls(scheme=parse_scheme(scheme).name,
                   layers=tuple(dict(r.config) for r in snapshot.layers),
                   codecs=_codec_fields(snapshot.codecs))


def describe_difference(a: _Digestible, b: _Digestible) -> list[str]:
    """The fields in which two identities differ, as "name: a vs b" (a first), for messages.

    Nested fields are dotted ("config.rope_theta", "layers.3.key_bits"); long digests are
    shortened to 12 hex digits.
    """
    fa, fb = _flatten(a.fields()), _flatten(b.fields())
    return [f"{k}: {_show(fa.get(k))} vs {_show(fb.get(k))}"
            for k in sorted(set(fa) | set(fb), key=_natural) if fa.get(k, _MISSING) != fb.get(k, _MISSING)]


# -- model folders ---------------------------------------------------------------------------


def kv_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """The KV-relevant fields of a model config (text_config of multimodal models first).

    Defaults mlx-lm applies are made explicit (kv heads = heads, head dim = hidden / heads), so
    a config that spells them out and one that does not give the same identity.
    """
    text = config.get("text_config")
    merged = {**config, **text} if isinstance(text, Mapping) else dict(config)
    out = {k: _jsonable(merged[k]) for k in KV_CONFIG_FIELDS if merged.get(k) is not None}
    heads = out.get("num_attention_heads")
    if heads:
        out.setdefault("num_key_value_heads", heads)
        if out.get("hidden_size"):
            out.setdefault("head_dim", out["hidden_size"] // heads)
    return out


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise NotFound(f"{path} does not exist: pass a model folder (config.json, weights, tokenizer)")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"cannot read {path}: {e}; fix or re-download the model") from e
    if not isinstance(data, dict):
        raise ConfigError(f"{path} is not a JSON object; fix or re-download the model")
    return data


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


class _DigestCache:
    """sha256 of files keyed by (real path, size, mtime_ns), in one small JSON file."""

    def __init__(self, cache_dir: Path):
        self.path = cache_dir / DIGEST_CACHE_FILE
        self.entries: dict[str, dict[str, Any]] = {}
        self.dirty = False
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
            if isinstance(data, dict) and isinstance(data.get("files"), dict):
                self.entries = data["files"]
        except (OSError, ValueError):
            pass  # a missing or damaged cache only costs a re-hash

    def file_sha256(self, path: Path) -> str:
        real = os.path.realpath(path)
        st = os.stat(real)
        hit = self.entries.get(real)
        if isinstance(hit, dict) and hit.get("size") == st.st_size and hit.get("mtime_ns") == st.st_mtime_ns \
                and isinstance(hit.get("sha256"), str):
            return hit["sha256"]
        digest = _file_sha256(Path(real))
        self.entries[real] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": digest}
        self.dirty = True
        return digest

    def save(self) -> None:
        if self.dirty:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            write_file_atomic(self.path, canonical_json({"version": 1, "files": self.entries}))
            self.dirty = False


def _adapter_digest(path: Path, cache: _DigestCache) -> str:
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


def _tokenizer_files_digest(model_dir: Path) -> str | None:
    files = [model_dir / n for n in TOKENIZER_FILES if (model_dir / n).is_file()]
    files += sorted(model_dir.glob("*.tiktoken"))
    if not files:
        return None
    return hashlib.sha256(canonical_json([[p.name, _file_sha256(p)] for p in files])).hexdigest()


def _chat_template_digest(model_dir: Path) -> str | None:
    """The template mlx-lm would use: chat_template.jinja, chat_template.json, tokenizer_config."""
    template = None
    jinja = model_dir / "chat_template.jinja"
    if jinja.is_file():
        template = jinja.read_text(encoding="utf-8")
    else:
        for name in ("chat_template.json", "tokenizer_config.json"):
            if (model_dir / name).is_file():
                template = _read_json(model_dir / name).get("chat_template")
                if template is not None:
                    break
    return None if template is None else hashlib.sha256(canonical_json(template)).hexdigest()


def _config_dtype(config: Mapping[str, Any]) -> str | None:
    text = config.get("text_config") if isinstance(config.get("text_config"), Mapping) else {}
    for c in (config, text):
        for key in ("torch_dtype", "dtype"):
            value = c.get(key)
            if isinstance(value, str) and value in ("float16", "bfloat16", "float32"):
                return value
    return None


_SAFETENSORS_FLOATS = {"F16": "float16", "BF16": "bfloat16", "F32": "float32"}


def _weights_dtype(files: list[Path]) -> str:
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


# -- models in memory ------------------------------------------------------------------------


def _model_args(model) -> dict[str, Any]:
    args = getattr(model, "args", None)
    if dataclasses.is_dataclass(args):
        return dataclasses.asdict(args)
    return dict(vars(args)) if args is not None else {}


def _tokenizer_digests(tokenizer) -> tuple[str | None, str | None]:
    """(tokenizer digest, chat template digest) of a Hugging Face tokenizer or mlx-lm's
    TokenizerWrapper (which forwards these attributes), so both give the same identity."""
    if tokenizer is None:
        return None, None
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        body: Any = backend.to_str()
    elif hasattr(tokenizer, "get_vocab"):
        body = sorted(tokenizer.get_vocab().items())
    else:
        raise TypeError(f"cannot fingerprint a {type(tokenizer).__name__}: pass a Hugging Face tokenizer "
                        "or mlx-lm's TokenizerWrapper")
    special = sorted(map(str, getattr(tokenizer, "all_special_tokens", [])))
    tok_digest = hashlib.sha256(canonical_json([body, special])).hexdigest()
    template = getattr(tokenizer, "chat_template", None)
    return tok_digest, None if template is None else hashlib.sha256(canonical_json(template)).hexdigest()


# -- helpers ---------------------------------------------------------------------------------

_MISSING = object()


def _jsonable(value: Any) -> Any:
    """Plain JSON data for config values (tuples -> lists, mappings -> dicts, other -> str)."""
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if value == value and abs(value) != float("inf") else str(value)
    return str(value)


def _flatten(obj: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(obj, dict) and obj:
        out = {}
        for k, v in obj.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    if isinstance(obj, list) and obj and all(isinstance(v, dict) for v in obj):
        out = {}
        for i, v in enumerate(obj):
            out.update(_flatten(v, f"{prefix}{i}."))
        return out
    return {prefix[:-1]: obj}


def _show(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value):
        return value[:12] + "…"
    return json.dumps(value) if not isinstance(value, str) else value


def _natural(key: str) -> list[Any]:
    return [(0, int(p), "") if p.isdigit() else (1, 0, p) for p in key.split(".")]
