"""Every model family of the installed mlx-lm, each with a tiny config (issue 18).

`families()` discovers the modules of `mlx_lm.models` that define a `Model` (pkgutil, not a
hand-picked list), so a family added to mlx-lm later shows up here by itself: it either builds
from the generic config (plus `OVERRIDES`), or is listed in `NOT_BUILDABLE` with the reason, or
`build` fails and the test over all families fails loudly.

The generic config fills every field a family's ModelArgs names with a small value chosen by
the field's name (hidden 64, 4 layers, 4 heads of 16, vocab 128); `OVERRIDES` holds what a
family needs beyond that (layer patterns that mix kinds, sizes its code asserts).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import pkgutil
from typing import Any

import mlx.core as mx
import mlx_lm.models

VOCAB = 128
LAYERS = 4

# Families that do not build from a tiny random config, and why (checked by the tests: a family
# listed here that mlx-lm no longer has, or that now builds and gives finite logits, fails them).
# Families whose tiny model must not even run: it corrupts memory and crashes later tests.
UNSAFE = frozenset({"phi3small"})
NOT_BUILDABLE: dict[str, str] = {
    "olmo": "needs the ai2-olmo package (hf_olmo), which is not installed",
    "phi3small": "its blocksparse attention gives NaN logits on a tiny config and can crash the process",
    "bitnet": "its BitLinear layer is a Metal kernel only (no CPU back-end)",
    "muse_spark": "its code raises NotImplementedError for dense feed-forward layers",
    "prism_hadamard_qwen35": "needs a Hadamard pack shipped with real checkpoints (schema 2)",
}

# Generic values by field name: the same small model for every family.
GENERIC: dict[str, Any] = dict(
    hidden_size=64, d_model=64, n_embd=64, dim=64, embed_dim=64, model_dim=64,
    num_hidden_layers=LAYERS, n_layer=LAYERS, n_layers=LAYERS, num_layers=LAYERS,
    intermediate_size=128, ffn_hidden_size=128, ffn_dim=128, n_inner=128, hidden_dim=128,
    num_attention_heads=4, n_head=4, n_heads=4, num_heads=4,
    num_key_value_heads=2, n_kv_heads=2, num_kv_heads=2, multi_query_group_num=2,
    head_dim=16, vocab_size=VOCAB, rms_norm_eps=1e-5, layer_norm_eps=1e-5, norm_eps=1e-5,
    layer_norm_epsilon=1e-5, norm_epsilon=1e-5, max_position_embeddings=512, n_positions=512,
    max_seq_len=512, rope_theta=10000.0, tie_word_embeddings=False,
    num_experts=4, n_routed_experts=4, num_local_experts=4, moe_num_experts=4, n_experts=4,
    num_experts_per_tok=2, moe_topk=2, top_k=2, moe_k=2, n_shared_experts=1, num_shared_experts=1,
    moe_intermediate_size=32, shared_expert_intermediate_size=32, first_k_dense_replace=1,
    n_group=1, topk_group=1, routed_scaling_factor=1.0,
    kv_lora_rank=32, q_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16,
    sliding_window=16, attention_chunk_size=16, sliding_window_pattern=2, rotary_dim=8,
    # recurrent and convolution layers
    n_groups=1, conv_kernel=4, conv_L_cache=3, ssm_state_size=16, state_size=16, mamba_num_heads=4,
    mamba_head_dim=16, mamba_d_conv=4, mamba_d_state=16, mamba_expand=2, expand=2, conv_bias=False,
    use_conv_bias=True, time_step_rank=8, num_dense_layers=1, time_step_limit=(0.0, float("inf")),
    block_dim=64, block_ff_dim=128, block_multiple_of=16, linear_num_value_heads=4, linear_num_key_heads=2,
    linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4, full_attention_interval=2,
)

# What a family needs beyond the generic config.
_KDA = {"kda_layers": [1, 3], "num_heads": 4, "head_dim": 16, "short_conv_kernel_size": 4}
_LLAMA4_ROPE = {"rope_theta": 10000.0, "llama_4_scaling_beta": 0.1, "original_max_position_embeddings": 512}
_SLIDING = ["sliding_attention", "full_attention"] * 2
_LFM2 = dict(layer_types=["conv", "full_attention", "conv", "full_attention"])
OVERRIDES: dict[str, dict[str, Any]] = {
    "lfm2": _LFM2, "lfm2_moe": _LFM2, "lfm2-vl": {"text_config": {"model_type": "lfm2", **_LFM2}},
    "granitemoehybrid": dict(layer_types=["mamba", "attention", "mamba", "attention"], mamba_n_heads=4,
                             mamba_d_head=16, mamba_n_groups=1, mamba_proj_bias=False, mamba_conv_bias=True,
                             shared_intermediate_size=128),
    "nemotron_h": dict(hybrid_override_pattern=["M", "*", "M", "-"]),
    "jamba": dict(attn_layer_offset=1, attn_layer_period=2, expert_layer_offset=1, expert_layer_period=2),
    "mamba2": dict(num_heads=8, head_dim=16),
    "afmoe": dict(layer_types=_SLIDING),
    "mellum": dict(layer_types=_SLIDING, rope_parameters={t: {"rope_theta": 10000.0} for t in set(_SLIDING)}),
    "gemma4": {"text_config": dict(layer_types=_SLIDING, num_kv_shared_layers=0)},
    "gemma4_text": dict(layer_types=_SLIDING, num_kv_shared_layers=0),
    "exaone_moe": dict(layer_types=_SLIDING, is_moe_layer=[False, True, True, True]),
    # two of four layers read the KV of earlier ones (num_kv_shared_layers), as gemma3n models do
    "gemma3n": {"text_config": dict(layer_types=_SLIDING, num_kv_shared_layers=2, activation_sparsity_pattern=[0.0] * 4,
                                    hidden_size_per_layer_input=16, altup_num_inputs=2, altup_coef_clip=120.0,
                                    altup_correct_scale=True, altup_active_idx=0, laurel_rank=8,
                                    final_logit_softcapping=30.0, rope_local_base_freq=10000.0)},
    "plamo": dict(n_shared_head=2),
    "longcat_flash": dict(mla_scale_q_lora=True, mla_scale_kv_lora=True, zero_expert_type="identity"),
    "longcat_flash_ngram": dict(mla_scale_q_lora=True, mla_scale_kv_lora=True),
    "bailing_moe_linear": dict(layer_group_size=2),
    "afm7": dict(num_kv_reuse_layers=2),  # the last two layers read the KV of earlier ones
    # a no-op attention block among attention blocks, as the real Nemotron-NAS models mix them
    "nemotron-nas": dict(block_configs=[{"attention": {"n_heads_in_group": 2}, "ffn": {"ffn_mult": 1.0}},
                                        {"attention": {"no_op": True}, "ffn": {"ffn_mult": 1.0}},
                                        {"attention": {"n_heads_in_group": 2}, "ffn": {"ffn_mult": 1.0}},
                                        {"attention": {"n_heads_in_group": 4}, "ffn": {"ffn_mult": 1.0}}]),
    "qwen": dict(kv_channels=16),
    "exaone4": dict(sliding_window_pattern="LG"),
    "llama4_text": dict(no_rope_layers=[1, 0, 1, 0]),
    "mimo_v2_flash": dict(hybrid_layer_pattern=[1, 0, 1, 0], moe_layer_freq=[0, 1, 1, 1], topk_method="noaux_tc",
                          swa_head_dim=16, swa_v_head_dim=16, swa_rope_theta=10000.0, swa_num_attention_heads=4,
                          swa_num_key_value_heads=2, partial_rotary_factor=0.5),
    "openelm": dict(num_query_heads=[4] * 4, num_kv_heads=[2] * 4, ffn_multipliers=[2.0] * 4,
                    num_transformer_layers=LAYERS, ffn_dim_divisor=16),
    "baichuan_m1": dict(conv_window=2, sliding_window_layers=[1, 3]),
    "gear": dict(layer_types=["conv_mixer", "full_attention", "conv_mixer", "sliding_attention"]),
    "kimi_linear": dict(linear_attn_config=_KDA), "kimi_k3": {"text_config": dict(linear_attn_config=_KDA, num_experts_per_token=2)},
    "ministral3": dict(rope_parameters=_LLAMA4_ROPE), "mistral4": dict(rope_parameters=_LLAMA4_ROPE),
    "hunyuan": dict(rope_scaling={"alpha": 1.0, "factor": 1.0, "type": "dynamic"}),
    "deepseek_v2": dict(rope_scaling={"factor": 1.0, "original_max_position_embeddings": 512, "beta_fast": 32,
                                      "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}),
    "minicpm3": dict(rope_scaling={"original_max_position_embeddings": 512}),
    "step3p5": dict(num_attention_groups=2, moe_num_experts=4, moe_top_k=2),
    "recurrent_gemma": dict(block_types=["recurrent", "attention"], conv1d_width=4, attention_window_size=16,
                            logits_soft_cap=30.0),
    "glm_moe_dsa": dict(rope_parameters={"rope_theta": 10000.0}),
    "spark2_5": dict(layer_types=_SLIDING, rope_parameters={t: {"rope_theta": 10000.0} for t in set(_SLIDING)}),
    "dbrx": dict(ffn_config={"ffn_hidden_size": 128, "moe_num_experts": 4, "moe_top_k": 2},
                 attn_config={"kv_n_heads": 2, "clip_qkv": 8.0, "rope_theta": 10000.0}),
}


@functools.lru_cache(maxsize=None)
def families() -> tuple[str, ...]:
    """Every module of mlx_lm.models that defines a Model, sorted; a module that does not import
    (a missing optional package) counts as a family too, so that it must be listed."""
    out = []
    for info in pkgutil.iter_modules(mlx_lm.models.__path__):
        try:
            module = importlib.import_module(f"mlx_lm.models.{info.name}")
        except (ImportError, SystemExit):  # olmo exits when ai2-olmo is missing
            out.append(info.name)
            continue
        if hasattr(module, "Model") and hasattr(module, "ModelArgs"):
            out.append(info.name)
    return tuple(sorted(out))


def config(family: str, **changes) -> dict[str, Any]:
    """The tiny config of `family`: generic values for the fields its ModelArgs has, then
    overrides, then `changes` (applied to the text config of a wrapper too).

    A wrapper family (a `text_config` field) gets the generic config as its text config, with
    the required fields of the argument classes it uses filled in too.
    """
    module = importlib.import_module(f"mlx_lm.models.{family}")
    cfg = _fill(module.ModelArgs)
    if "text_config" in inspect.signature(module.ModelArgs).parameters:
        text = dict(GENERIC)
        for cls in _arg_classes(module):
            text.update({k: v for k, v in _fill(cls).items() if k not in text})
        cfg["text_config"] = {**text, **OVERRIDES.get(family, {}).get("text_config", {}), **changes}
    overrides = {k: v for k, v in OVERRIDES.get(family, {}).items() if k != "text_config"}
    return {**cfg, "model_type": family, **overrides, **changes}


def _fill(args) -> dict[str, Any]:
    names = set(inspect.signature(args).parameters)
    cfg = {k: v for k, v in GENERIC.items() if k in names}
    for f in dataclasses.fields(args) if dataclasses.is_dataclass(args) else ():
        if f.name in cfg:
            continue
        if "vocab" in f.name and f.type in (int, "int"):
            cfg[f.name] = VOCAB
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            cfg[f.name] = _guess(f.name, f.type)
    return cfg


def _arg_classes(module) -> list[type]:
    """The argument dataclasses a wrapper module uses: its own and the ModelArgs of the mlx-lm
    model modules it imports."""
    out = []
    for value in vars(module).values():
        if inspect.isclass(value) and dataclasses.is_dataclass(value) and value is not module.ModelArgs \
                and value.__module__.startswith("mlx_lm.models"):
            out.append(value)
        elif inspect.ismodule(value) and value.__name__.startswith("mlx_lm.models.") \
                and hasattr(value, "ModelArgs"):
            out.append(value.ModelArgs)
    return out


def _guess(name: str, annotation: Any) -> Any:
    """A small value for a required field, by its type annotation."""
    text = str(annotation)
    if text.lower().startswith(("list", "typing.list", "tuple", "typing.tuple")):
        return []
    if text.lower().startswith(("dict", "typing.dict")):
        return {}
    if "bool" in text:
        return False
    if "float" in text:
        return 1.0
    if "int" in text:
        return 16
    if "str" in text:
        return "silu" if "act" in name else ""
    if "dict" in text.lower():
        return {}
    if "list" in text.lower():
        return []
    return None


def build(family: str, seed: int = 0, **overrides):
    """A random-weight float32 model of `family` (its config with `overrides`), evaluated."""
    module = importlib.import_module(f"mlx_lm.models.{family}")
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(config(family, **overrides)))
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    return model
