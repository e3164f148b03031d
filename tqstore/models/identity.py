"""What a stored cache is valid for: the model identity and the codec identity.

A cache restored into anything but the model, tokenizer, chat template, adapter and KV dtype
it was computed with, or decoded with other codebooks or rotations, loads cleanly and answers
wrongly. Both identities are sha256 digests of a canonical JSON (sorted keys, no spaces), so
they are the same in every process and on every machine, and `describe_difference` names what
changed when a digest does not match.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import mlx.core as mx
from mlx.utils import tree_flatten

from turboquant import parse_scheme
from turboquant.records import CodecRecord, Snapshot

from tqstore.canonical import canonical_json, dtype_name, tensor_bytes, tensor_summary
from tqstore.errors import NotFound
from tqstore.models.files import (DigestCache, adapter_digest, chat_template_digest, config_dtype, read_json,
                          tokenizer_files_digest, weights_dtype)

# The snapshot format version. format.py writes it into every frame and the codec identity
# hashes it, so objects written under another format are never found by key.
FORMAT_VERSION = 1

# Config fields shown not to change what a model computes (docs/format.md, "Model identity"):
# no loader or model module of mlx-lm 0.32 reads them, or, for the dtype, the identity's own
# `kv_dtype` holds the dtype the model runs in. Every other field is hashed: an edited
# `rms_norm_eps` or quantization config changes the K/V of every layer past the first.
COSMETIC_CONFIG_FIELDS = frozenset({
    "_name_or_path", "transformers_version", "torch_dtype", "dtype", "use_cache", "eos_token_id",
})

# Sub-configs of multimodal wrappers, which transformers writes with the same bookkeeping fields.
SUB_CONFIGS = ("text_config", "vision_config", "audio_config")

# The config fields the model identity hashed before issue 27 (only those shaping the KV
# cache): kept to recognise entries stored then (`legacy_identity`), never to build a new key.
LEGACY_KV_CONFIG_FIELDS = (
    "model_type", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
    "hidden_size", "layer_types", "sliding_window", "sliding_window_pattern", "use_sliding_window",
    "max_window_layers", "attention_chunk_size", "no_rope_layers", "rope_theta", "rope_scaling",
    "rope_parameters", "rope_local_base_freq", "rope_traditional", "partial_rotary_factor",
    "max_position_embeddings", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim",
    "full_attention_interval", "full_attn_idxs", "layers_block_type", "hybrid_override_pattern",
    "attn_layer_period", "attn_layer_offset", "linear_attn_config", "linear_num_key_heads",
    "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim",
    "conv_L_cache", "conv_kernel", "ssm_state_size", "state_size", "n_groups", "mamba_num_heads",
    "mamba_head_dim", "mamba_d_conv", "mamba_d_state", "mamba_expand", "time_step_limit",
)


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

    @functools.cached_property
    def digest(self) -> bytes:
        """32 raw bytes (what block keys chain), worked out once per identity: the engine asks for
        the model's and the codec's on every request (about 1 ms of a 4k first token on an H100
        host, more with more layers), and an identity's fields are never changed once made."""
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
        source: str | None = None,
    ) -> "ModelIdentity":
        """Identity of a model folder (config.json, model*.safetensors, tokenizer files).
        `source` names the model in messages (a repo id); default the folder's name.

        Each weight file's sha256 is computed once and cached in `cache_dir` under its real
        path with its device, inode, size, mtime and ctime (model_files.DigestCache), so only a
        changed file is read again. `kv_dtype` defaults to the
        config's torch_dtype, else the dominant float dtype of the weight files.
        """
        model_dir = Path(model_dir)
        config = read_json(model_dir / "config.json")
        weights = sorted(model_dir.glob("model*.safetensors")) or sorted(model_dir.glob("*.safetensors"))
        if not weights:
            raise NotFound(f"no weight files (model*.safetensors) in {model_dir}: pass the folder that holds "
                           "the model's config.json and weights")
        cache = DigestCache(Path(cache_dir))
        listing = [{"name": p.name, "size": p.stat().st_size, "sha256": cache.file_sha256(p)} for p in weights]
        adapter = None
        if adapter_path is not None:
            adapter = adapter_digest(Path(adapter_path), cache)
        cache.save()
        return cls(
            weights=hashlib.sha256(canonical_json(listing)).hexdigest(),
            config=model_config(config),
            tokenizer=tokenizer_files_digest(model_dir),
            chat_template=chat_template_digest(model_dir),
            adapter=adapter,
            kv_dtype=kv_dtype or config_dtype(config) or weights_dtype(weights),
            source=source or model_dir.resolve().name,
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
            config=model_config(args if isinstance(args, dict) else {}),
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


def stored_bytes_at_least(codec: CodecIdentity, tokens: int) -> int:
    """A lower bound of the bytes `tokens` more tokens take when stored under `codec`, to refuse
    a save before its prefill: packed codes compress by at most ~6% (docs/format.md), so 1/1.1
    of their raw size. Layers whose config does not give their bits count 0."""
    bits = 0
    for layer in codec.layers:
        sizes = [layer.get(k) for k in ("n_kv_heads", "head_dim_k", "key_bits", "head_dim_v", "value_bits")]
        if all(type(v) is int and v >= 0 for v in sizes):
            heads, dim_k, key_bits, dim_v, value_bits = sizes
            bits += heads * (dim_k * key_bits + dim_v * value_bits)
    return int(tokens * bits / 8 / 1.1)


def describe_difference(a: _Digestible, b: _Digestible) -> list[str]:
    """The fields in which two identities differ, as "name: a vs b" (a first), for messages.

    Nested fields are dotted ("config.rope_theta", "layers.3.key_bits"); long digests are
    shortened to 12 hex digits.
    """
    fa, fb = _flatten(a.fields()), _flatten(b.fields())
    return [f"{k}: {_show(fa.get(k))} vs {_show(fb.get(k))}"
            for k in sorted(set(fa) | set(fb), key=_natural) if fa.get(k, _MISSING) != fb.get(k, _MISSING)]


def model_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """The config a model identity hashes: all of config.json as written, less the cosmetic
    fields (`COSMETIC_CONFIG_FIELDS`, also inside the `SUB_CONFIGS`).

    Defaults are not filled in: what a missing field means depends on the family (gemma3's
    head_dim is 256 whatever hidden_size / heads is), so a config that spells a default out is
    another identity (a miss, never a wrong cache).
    """
    out = {}
    for key, value in config.items():
        if key in COSMETIC_CONFIG_FIELDS:
            continue
        if key in SUB_CONFIGS and isinstance(value, Mapping):
            value = {k: v for k, v in value.items() if k not in COSMETIC_CONFIG_FIELDS}
        out[str(key)] = _jsonable(value)
    return out


def legacy_identity(identity: ModelIdentity) -> ModelIdentity:
    """`identity` as tqstore hashed it before issue 27 (only the KV-shaping config fields, with
    mlx-lm's usual defaults filled in), to recognise an entry stored then and say to save it
    again (loading.check_identity). Its blocks are keyed by that digest: lookups never find them."""
    text = identity.config.get("text_config")
    merged = {**identity.config, **text} if isinstance(text, Mapping) else dict(identity.config)
    config = {k: merged[k] for k in LEGACY_KV_CONFIG_FIELDS if merged.get(k) is not None}
    heads = config.get("num_attention_heads")
    if heads:
        config.setdefault("num_key_value_heads", heads)
        if config.get("hidden_size"):
            config.setdefault("head_dim", config["hidden_size"] // heads)
    return dataclasses.replace(identity, config=config)


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
