"""Tiny random-weight mlx-lm models built from configs (no files, no downloads)."""

from __future__ import annotations

import importlib

import mlx.core as mx

CONFIGS = {
    "llama": dict(model_type="llama", hidden_size=256, num_hidden_layers=8, intermediate_size=512,
                  num_attention_heads=8, num_key_value_heads=2, head_dim=128, vocab_size=512, rms_norm_eps=1e-5),
    "qwen2": dict(model_type="qwen2", hidden_size=448, num_hidden_layers=8, intermediate_size=512,
                  num_attention_heads=7, num_key_value_heads=1, vocab_size=512, rms_norm_eps=1e-6,
                  tie_word_embeddings=True),
    "qwen3": dict(model_type="qwen3", hidden_size=256, num_hidden_layers=8, intermediate_size=512,
                  num_attention_heads=8, num_key_value_heads=4, head_dim=64, vocab_size=512, rms_norm_eps=1e-6,
                  max_position_embeddings=2048, tie_word_embeddings=True, rope_theta=1000000.0),
    "gemma3_text": dict(model_type="gemma3_text", hidden_size=256, num_hidden_layers=6, intermediate_size=512,
                        num_attention_heads=4, num_key_value_heads=1, head_dim=256, vocab_size=512,
                        rms_norm_eps=1e-6, sliding_window=64, sliding_window_pattern=3,
                        query_pre_attn_scalar=256),
    # Families whose attention goes beyond plain SDPA (issue 18): sinks, MLA latents, soft-capping.
    "gpt_oss": dict(model_type="gpt_oss", hidden_size=128, num_hidden_layers=4, intermediate_size=128,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=512, num_local_experts=4,
                    num_experts_per_tok=2, sliding_window=32, layer_types=["sliding_attention", "full_attention"] * 2),
    "deepseek_v3": dict(model_type="deepseek_v3", hidden_size=128, num_hidden_layers=4, intermediate_size=256,
                        moe_intermediate_size=64, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
                        n_shared_experts=1, num_experts_per_tok=2, kv_lora_rank=64, q_lora_rank=96,
                        qk_rope_head_dim=32, v_head_dim=32, qk_nope_head_dim=32, vocab_size=512,
                        first_k_dense_replace=1),
    "gemma2": dict(model_type="gemma2", hidden_size=128, num_hidden_layers=4, intermediate_size=256,
                   num_attention_heads=4, head_dim=32, rms_norm_eps=1e-6, vocab_size=512, num_key_value_heads=2,
                   query_pre_attn_scalar=32),
    "gemma3n": dict(model_type="gemma3n", text_config=dict(
        model_type="gemma3n_text", hidden_size=128, num_hidden_layers=4, intermediate_size=[256] * 4,
        num_attention_heads=4, head_dim=32, rms_norm_eps=1e-6, vocab_size=512, num_key_value_heads=2,
        num_kv_shared_layers=2, vocab_size_per_layer_input=512, sliding_window=16, max_position_embeddings=512,
        rope_local_base_freq=10000.0, rope_theta=1000000.0, final_logit_softcapping=30.0,
        layer_types=["sliding_attention", "full_attention"] * 2, activation_sparsity_pattern=[0.0] * 4,
        hidden_size_per_layer_input=16, altup_num_inputs=2, altup_coef_clip=120.0, altup_correct_scale=True,
        altup_active_idx=0, laurel_rank=8)),
}


def _arch_family(family: str) -> dict:
    """A family's tiny config from arch_configs (hybrid families), with this file's vocabulary."""
    from arch_configs import config

    cfg = config(family)
    if "text_config" in cfg:
        cfg["text_config"] = {**cfg["text_config"], "vocab_size": 512}
    return {**cfg, "model_type": family, "vocab_size": 512}


CONFIGS["qwen3_5"] = _arch_family("qwen3_5")  # hybrid: gated delta-net (ArraysCache) + attention


def build_model(kind: str, seed: int = 0, dtype=mx.float32, **overrides):
    """A random-weight model of `kind` (see CONFIGS), evaluated, in `dtype`."""
    cfg = {**CONFIGS[kind], **overrides}
    module = importlib.import_module(f"mlx_lm.models.{cfg['model_type']}")
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(cfg))
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    return model


def prompt_tokens(n: int, seed: int = 1, vocab: int = 512) -> mx.array:
    return mx.random.randint(0, vocab, (n,), key=mx.random.key(seed))
