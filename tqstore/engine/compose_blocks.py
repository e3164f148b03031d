"""The decoder blocks the compose recompute reproduces, by model family (mlx-lm's model_type).

The recompute (compose.py) runs a share of the documents' tokens through the model's own
modules (norms, projections, RoPE, MLP) in context; what differs between families is how a
block adds its attention and MLP outputs back and how the embeddings are scaled. A family not
listed here composes at recompute 0 (concatenation) or 1 (a full prefill) only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import mlx.core as mx

from tqstore.errors import BadInput


def _llama_rest(layer, h: mx.array, attended: mx.array) -> mx.array:
    h = h + attended
    return h + layer.mlp(layer.post_attention_layernorm(h))


def _sandwich_rest(layer, h: mx.array, attended: mx.array) -> mx.array:
    """gemma3: norms around the attention's and the MLP's outputs both."""
    h = h + layer.post_attention_layernorm(attended)
    return h + layer.post_feedforward_layernorm(layer.mlp(layer.pre_feedforward_layernorm(h)))


def _glm4_rest(layer, h: mx.array, attended: mx.array) -> mx.array:
    """glm4: a norm after the attention and after the MLP, besides the usual ones before them."""
    h = h + layer.post_self_attn_layernorm(attended)
    return h + layer.post_mlp_layernorm(layer.mlp(layer.post_attention_layernorm(h)))


def _granite_rest(layer, h: mx.array, attended: mx.array) -> mx.array:
    """granite: both branches scaled by the residual multiplier before they are added."""
    h = h + attended * layer.residual_multiplier
    return h + layer.mlp(layer.post_attention_layernorm(h)) * layer.residual_multiplier


@dataclass(frozen=True)
class Block:
    """A family's decoder block as the recompute runs it, beside the model's own modules (norms,
    projections, RoPE, MLP): the block after its attention, and what the embeddings are
    multiplied by from the model's args (None: nothing)."""

    rest: Callable[[Any, mx.array, mx.array], mx.array]
    embed_scale: Callable[[Any], Any] | None = None


LLAMA_BLOCK = Block(_llama_rest)
# The families (mlx-lm's model_type) whose block the recompute reproduces, each checked against
# mlx-lm's own prefill of the composed prompt, every layer (tests/test_compose_families.py). Any
# other family composes at recompute 0 or 1 only (`check_recompute`): a block with another
# attention (sinks, gates, norms over all heads, position-dependent query scales), another
# residual, layers run several times, or embeddings under another module would give wrong K/V
# without an error. Left out for those reasons: laguna (an output gate), olmoe (q/k norms over
# all heads), mimo_v2_flash (attention sinks), ministral3 (query scale by position),
# nanbeige and iquestloopcoder (layers looped), and the multimodal wrappers.
RECOMPUTE_FAMILIES: dict[str, Block] = {
    **dict.fromkeys(("llama", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "dots1", "ernie4_5", "ernie4_5_moe",
                     "glm4_moe", "solar_open", "helium", "internlm3", "mellum", "mimo", "nemotron", "seed_oss",
                     "starcoder2"), LLAMA_BLOCK),
    # Embeddings times sqrt(hidden): in the embeddings' dtype (gemma), rounded to bfloat16 first (gemma3).
    "gemma": Block(_llama_rest, lambda args: args.hidden_size ** 0.5),
    "gemma3_text": Block(_sandwich_rest, lambda args: mx.array(args.hidden_size ** 0.5, mx.bfloat16)),
    "granite": Block(_granite_rest, lambda args: args.embedding_multiplier),
    "glm4": Block(_glm4_rest),
}


def model_type(model) -> str | None:
    """The model's family as mlx-lm names it (its config's model_type)."""
    return getattr(getattr(model, "args", None), "model_type", None)


def family(model) -> str:
    """The model's family for a message: its model_type, else its mlx-lm module's name."""
    return model_type(model) or type(model).__module__.rsplit(".", 1)[-1]


def recomputes_in_context(model) -> bool:
    """Whether a share of the documents' tokens strictly between 0 and 1 can be recomputed in
    context for this model (its family's block is one the recompute reproduces)."""
    return model_type(model) in RECOMPUTE_FAMILIES


def check_recompute(model, recompute: float) -> None:
    """BadInput for a recompute strictly between 0 and 1 on a family whose block the recompute
    does not reproduce (0, plain concatenation, and 1, a full prefill, work for any)."""
    if 0.0 < recompute < 1.0 and not recomputes_in_context(model):
        raise _not_reproduced(model, recompute)


def _not_reproduced(model, recompute: float) -> BadInput:
    share = f"{recompute:g}" if f"{recompute:g}" not in ("0", "1") else repr(recompute)
    return BadInput(f"recompute {share} runs part of the documents through the model in context, which "
                    f"tqstore does for {', '.join(sorted(RECOMPUTE_FAMILIES))} models only, not "
                    f"{family(model)}: pass --recompute 0 (plain concatenation) "
                    "or --recompute 1 (a full prefill of the composed prompt)")


def block_of(model, budget: float) -> Block:
    """The model's block (BadInput for a family the recompute does not reproduce)."""
    block = RECOMPUTE_FAMILIES.get(model_type(model))
    if block is None:
        raise _not_reproduced(model, budget)
    return block
