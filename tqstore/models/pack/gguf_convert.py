"""Convert a llama.cpp GGUF checkpoint (qwen2, llama, gemma3) into a folder that mlx_lm.load accepts.

The folder holds config.json, model.safetensors (dequantized weights, Hugging Face tensor
names) and the tokenizer files. Weights are dequantized with gguf-py; the tokenizer is
rebuilt from the GGUF metadata by transformers' torch-free GGUF tokenizer builder.

Gemma 3 files lack what llama.cpp hard-codes for the family (its `llama-model.cpp`): every
`GEMMA3_PATTERN`-th layer is global and the others slide over `gemma3.attention.sliding_window`
tokens with RoPE base `GEMMA3_LOCAL_BASE`; the global layers use `gemma3.rope.freq_base` (and
the file's linear RoPE scaling, if any). llama.cpp stores Gemma's RMSNorm weights as `1 + w`
(the model multiplies by `1 + w`), so 1 is taken off every norm weight again.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from importlib import metadata as importlib_metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

import mlx.core as mx
import numpy as np

from tqstore.models.pack.errors import ConversionError, MissingDependencyError
from tqstore.models.pack.progress import ProgressFn, report

if TYPE_CHECKING:
    from types import ModuleType

    from gguf import GGUFReader

SUPPORTED_ARCHITECTURES = ("qwen2", "llama", "gemma3")
# What llama.cpp hard-codes for Gemma 3 (not in the file): one global layer in 6, local RoPE base.
GEMMA3_PATTERN = 6
GEMMA3_LOCAL_BASE = 10000.0
DTYPES = ("float16", "bfloat16", "float32")
# The tokenizer builder is a private transformers API; this is the version it was checked on.
TRANSFORMERS_VERSION = "5.24.0"
GGUF_VERSION = "0.19.0"

_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output.weight": "lm_head.weight",
    "output_norm.weight": "model.norm.weight",
}
_LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
# Gemma 3 names its norms after where they sit around attention and the MLP.
_GEMMA3_LAYER_TENSORS = {
    **_LAYER_TENSORS,
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_HF_CLASSES = {"qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM", "gemma3": "Gemma3ForCausalLM"}
# tokenizer_config.json key -> GGUF metadata key holding the token id
_SPECIAL_TOKEN_IDS = {
    "bos_token": "tokenizer.ggml.bos_token_id",
    "eos_token": "tokenizer.ggml.eos_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id",
    "pad_token": "tokenizer.ggml.padding_token_id",
}


def _import_gguf() -> ModuleType:
    try:
        import gguf
        import gguf.quants
    except ImportError as exc:
        raise MissingDependencyError(
            f"converting GGUF checkpoints needs the 'gguf' package ({GGUF_VERSION}): "
            "pip install 'tqstore[models]'"
        ) from exc
    return gguf


def _import_tokenizer_builder() -> tuple[dict, Callable, type]:
    try:
        from transformers import PreTrainedTokenizerFast
        from transformers.integrations.gguf.gguf_tokenizer_mapping import (
            GGUF_TOKENIZER_MAPPING,
            convert_gguf_tokenizer,
        )
    except ImportError as exc:
        try:
            installed = importlib_metadata.version("transformers")
        except importlib_metadata.PackageNotFoundError:
            installed = "not installed"
        raise MissingDependencyError(
            "building the tokenizer from GGUF metadata needs the GGUF tokenizer builder of "
            f"transformers=={TRANSFORMERS_VERSION} (transformers: {installed}): "
            "pip install 'tqstore[models]'"
        ) from exc
    return GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer, PreTrainedTokenizerFast


def check_dependencies() -> None:
    """Raise MissingDependencyError unless gguf and the transformers tokenizer API are usable."""
    _import_gguf()
    _import_tokenizer_builder()


def read_metadata(reader: GGUFReader) -> dict[str, Any]:
    """All key/value metadata of a GGUF file as Python values (file-format keys left out)."""
    return {
        key: field.contents()
        for key, field in reader.fields.items()
        if not key.startswith("GGUF.")
    }


def build_config(meta: dict[str, Any], tensor_names: set[str], dtype: str) -> dict[str, Any]:
    """The Hugging Face style config.json for the model the metadata describes."""
    arch = meta["general.architecture"]
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ConversionError(
            f"GGUF architecture {arch!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling not in ("none", "linear") or "rope_freqs.weight" in tensor_names:
        raise ConversionError(f"RoPE scaling ({scaling}, rope_freqs) is not supported: only linear scaling is")

    def arch_key(name: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{name}", default)

    config = {
        "model_type": arch,
        "architectures": [_HF_CLASSES[arch]],
        "vocab_size": len(meta["tokenizer.ggml.tokens"]),
        "hidden_size": arch_key("embedding_length"),
        "intermediate_size": arch_key("feed_forward_length"),
        "num_hidden_layers": arch_key("block_count"),
        "num_attention_heads": arch_key("attention.head_count"),
        "num_key_value_heads": arch_key(
            "attention.head_count_kv", arch_key("attention.head_count")
        ),
        "rms_norm_eps": arch_key("attention.layer_norm_rms_epsilon"),
        "rope_theta": arch_key("rope.freq_base", 10000.0),
        "max_position_embeddings": arch_key("context_length"),
        # Files of tied-embedding models carry no output.weight.
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
    }
    if scaling == "linear":
        config["rope_scaling"] = {"type": "linear", "factor": float(arch_key("rope.scaling.factor", 1.0))}
    if arch == "llama" and arch_key("attention.key_length"):
        config["head_dim"] = arch_key("attention.key_length")
    if arch == "gemma3":
        config.update(_gemma3_config(arch_key, config["num_hidden_layers"]))
    config["torch_dtype"] = dtype
    return config


def _gemma3_config(arch_key: Callable[..., Any], layers: int) -> dict[str, Any]:
    """What mlx-lm's gemma3_text reads beyond the common keys (see the module docstring)."""
    head_dim = arch_key("attention.key_length", 256)
    pattern = arch_key("attention.sliding_window_pattern", GEMMA3_PATTERN)
    return {
        "model_type": "gemma3_text",
        "head_dim": head_dim,
        "query_pre_attn_scalar": head_dim,
        "sliding_window": arch_key("attention.sliding_window", 512),
        "sliding_window_pattern": pattern,
        "rope_local_base_freq": GEMMA3_LOCAL_BASE,
        "hidden_activation": "gelu_pytorch_tanh",
        "layer_types": ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)],
    }


def hf_tensor_name(gguf_name: str, arch: str = "qwen2") -> str:
    """The Hugging Face name of a GGUF tensor (``blk.3.attn_q.bias`` -> ``model.layers.3...``)."""
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    table = _GEMMA3_LAYER_TENSORS if arch == "gemma3" else _LAYER_TENSORS
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in table:
        _, layer, base, suffix = parts
        return f"model.layers.{layer}.{table[base]}.{suffix}"
    raise ConversionError(f"GGUF tensor {gguf_name!r} has no Hugging Face counterpart")


def _unpermute_rope_rows(weight: np.ndarray, n_head: int) -> np.ndarray:
    # llama.cpp interleaves the rotary halves of q/k rows for llama; undo its permute.
    return (
        weight.reshape(n_head, weight.shape[0] // n_head // 2, 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def convert_weights(
    reader: GGUFReader,
    meta: dict[str, Any],
    dtype: str,
    progress: ProgressFn | None = None,
) -> dict[str, mx.array]:
    """Every tensor dequantized to float32, renamed, and cast to ``dtype``."""
    gguf = _import_gguf()
    arch = meta["general.architecture"]
    n_head = meta[f"{arch}.attention.head_count"]
    rope_heads = {
        "attn_q.weight": n_head,
        "attn_k.weight": meta.get(f"{arch}.attention.head_count_kv", n_head),
    }
    target = getattr(mx, dtype)
    weights = {}
    total = len(reader.tensors)
    report(progress, "convert", 0, total)
    for done, tensor in enumerate(reader.tensors, start=1):
        # ggml lists dimensions fastest-moving first, numpy the other way round
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        array = array.astype(np.float32).reshape(shape)
        role = tensor.name.split(".", 2)[-1]
        if arch == "llama" and role in rope_heads:
            array = _unpermute_rope_rows(array, rope_heads[role])
        if arch == "gemma3" and tensor.name.endswith("norm.weight"):
            array = array - np.float32(1.0)  # stored as 1 + w (module docstring)
        # Cast tensor by tensor so only one float32 copy is alive at a time.
        converted = mx.array(array).astype(target)
        mx.eval(converted)
        weights[hf_tensor_name(tensor.name, arch)] = converted
        report(progress, "convert", done, total)
    return weights


def build_tokenizer(meta: dict[str, Any], out_dir: Path) -> None:
    """Write tokenizer.json, tokenizer_config.json (and the chat template) into ``out_dir``."""
    key_map, convert_gguf_tokenizer, tokenizer_class = _import_tokenizer_builder()
    grouped = {
        group: {name: meta[f"tokenizer.{key}"] for key, name in renames.items()
                if f"tokenizer.{key}" in meta}
        for group, renames in key_map.items()
    }
    vocab, tokenizer_config = grouped["tokenizer"], grouped["tokenizer_config"]
    if vocab.get("tokenizer_type") == "llama":
        # llama.cpp adds BOS to a sentencepiece vocabulary unless the file says otherwise.
        tokenizer_config.setdefault("add_bos_token", True)
    for name, key in _SPECIAL_TOKEN_IDS.items():
        token_id = meta.get(key)
        tokenizer_config[name] = vocab["tokens"][token_id] if token_id is not None else None
    backend, _ = convert_gguf_tokenizer(meta["general.architecture"], vocab)
    tokenizer_class(tokenizer_object=backend, **tokenizer_config).save_pretrained(str(out_dir))


def convert_gguf(
    gguf_path: Path,
    out_dir: Path,
    dtype: str = "float16",
    progress: ProgressFn | None = None,
) -> dict[str, Any]:
    """Convert ``gguf_path`` into an mlx-lm folder at ``out_dir``; returns the written config.

    ``progress("convert", done, total)`` counts tensors.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, not {dtype!r}")
    gguf = _import_gguf()
    _import_tokenizer_builder()  # fail before the slow part, not after it
    reader = gguf.GGUFReader(str(gguf_path))
    meta = read_metadata(reader)
    config = build_config(meta, {t.name for t in reader.tensors}, dtype)
    out_dir.mkdir(parents=True, exist_ok=True)
    weights = convert_weights(reader, meta, dtype, progress)
    mx.save_safetensors(str(out_dir / "model.safetensors"), weights, metadata={"format": "mlx"})
    del weights
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    build_tokenizer(meta, out_dir)
    return config
