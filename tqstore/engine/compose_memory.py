"""The peak memory of composing documents, estimated before any of the work is done.

A composition holds, at its peak, the decoded K/V of every distinct chunk, the composed context
(about twice while keys are moved and concatenated, once more while the caches copy it), the
hidden states of the whole prompt for the recompute, bounded attention steps, and then the
question's prefill over the composed caches. Every term below is one of those allocations from
the model's shapes and the token counts, with the element sizes MLX uses; the sum is an upper
bound of the measured peak (tests/test_compose_memory.py measures it in a subprocess), so a
composition that would exhaust the machine is refused with `OverMemoryBudget` instead of being
killed half way (issue 27: 100 documents, 41k tokens, died at 12 GB).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import mlx.core as mx
from mlx.utils import tree_flatten

from tqstore.engine.compose import model_layers, query_step
from tqstore.engine.defaults import PREFILL_CHUNK
from tqstore.errors import OverMemoryBudget
from tqstore.units import format_size

F32 = 4
# Fixed costs of any composition that do not grow with the tokens (the pilot pass's small
# arrays, MLX's kernels and per-op scratch).
OVERHEAD = 32 * 2**20


@dataclass(frozen=True)
class ModelShape:
    """What a model's memory per token depends on."""

    layers: int
    heads: int  # query heads
    kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int
    vocab: int
    dtype_bytes: int  # the K/V and activations' element size

    @classmethod
    def of(cls, model) -> "ModelShape":
        """The shape of an mlx-lm model, from its first layer's attention and its args (a
        wrapper's text config too), under the names mlx-lm's families give them (`n_heads`,
        `num_heads`, `num_attention_heads`, ...)."""
        layers = model_layers(model)
        first = layers[0] if layers else None
        attention = getattr(first, "self_attn", None) or getattr(first, "attention", None)
        args = getattr(model, "args", None) or getattr(model, "config", None)
        text = getattr(args, "text_config", None)
        sources = [attention, args, text]
        hidden = (_first(sources[1:], "hidden_size", "d_model", "n_embd", "dim", "model_dim", "hidden_dim")
                  or _first(sources[:1], "hidden_size") or 0)
        heads = _first(sources, "n_heads", "num_heads", "num_attention_heads", "n_head") or 1
        kv_heads = _first(sources, "n_kv_heads", "num_key_value_heads", "num_kv_heads", "multi_query_group_num")
        return cls(layers=len(layers), heads=heads, kv_heads=kv_heads or heads,
                   head_dim=_first(sources, "head_dim") or hidden // heads, hidden=hidden,
                   intermediate=_first(sources[1:], "intermediate_size", "ffn_hidden_size", "ffn_dim") or 4 * hidden,
                   vocab=_first(sources[1:], "vocab_size") or 0, dtype_bytes=_float_bytes(first) if layers else F32)

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token in every layer, decoded."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes


def _first(sources, *names: str) -> int | None:
    """The first positive whole number under one of `names` in `sources` (objects or dicts)."""
    for source in sources:
        for name in names:
            value = source.get(name) if isinstance(source, dict) else getattr(source, name, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


def _float_bytes(layer) -> int:
    """The element size of the layer's floating-point parameters (a quantized layer's scales)."""
    for _, value in tree_flatten(layer.parameters()):
        if mx.issubdtype(value.dtype, mx.floating):
            return value.dtype.size
    return F32


def composition_bytes(shape: ModelShape, prefix: int, chunks: Sequence[int], distinct: Sequence[int], *,
                      question: int, recompute: float, step: int = PREFILL_CHUNK) -> int:
    """Estimated peak bytes of composing `[prefix][chunks...]` and prefilling `question` tokens
    after it: `chunks` are the documents' token counts in prompt order, `distinct` those of each
    different document (restored once however often it is given), `recompute` the share of chunk
    tokens recomputed (1: a plain prefill of the whole), `step` the tokens of one prefill step."""
    per_token = shape.kv_bytes_per_token
    context = prefix + sum(chunks)
    largest = prefix + max(distinct)
    # Prompts are prefilled in steps of `step` tokens (the question over the composed caches, or
    # the whole prompt at recompute 1); mlx-lm's attention holds one step's scores.
    # One chunk restored (or prefilled and stored) at a time: its compressed objects, caches and
    # a float32 decode before the cast to the model's dtype, or one prefill step's scores.
    restoring = largest * per_token * (2 + 2 * F32 // shape.dtype_bytes) + 4 * shape.heads * min(
        largest, step) * largest * F32
    # One attention step of the recompute (compose.query_step's rows over the whole context):
    # its scores, their masked and softmaxed copies, and the mask.
    step_scores = 4 * query_step(shape.heads, context + question) * shape.heads * (context + question) * F32
    question_scores = 4 * shape.heads * min(question, step) * (context + question) * F32
    caches = (context + question + 256) * per_token  # the caches grow in steps of 256 tokens
    # The question's prefill: hidden states, MLP activations and logits of one step, and the
    # compression of the caches at the first decode step (never larger than the raw caches).
    answering = caches * 2 + question_scores + min(question, step) * (
        4 * shape.hidden + 3 * shape.intermediate + shape.vocab) * F32
    if recompute >= 1.0:  # a plain prefill of the whole prompt
        rows = min(context, step)
        prefill = caches + 4 * shape.heads * rows * context * F32 + rows * (
            4 * shape.hidden + 3 * shape.intermediate + shape.vocab) * F32
        return OVERHEAD + restoring + max(prefill, answering)
    held = sum(prefix + n for n in distinct) * per_token
    composed = context * per_token
    selected = int(round(recompute * sum(chunks)))
    layer = composed // shape.layers
    # Recompute (none at a share of 0): every token's hidden state, the selected tokens'
    # activations, one layer's K/V rewritten and one layer's K/V with the question's appended
    # (the pilot pass).
    recomputing = 0 if selected == 0 else (
        context * shape.hidden * F32 + selected * (4 * shape.hidden + 3 * shape.intermediate
                                                   + 2 * shape.heads * shape.head_dim) * F32
        + 2 * layer + step_scores + question_scores)
    # Composing: the moved keys and the concatenation beside the chunks, then the recompute;
    # filling the caches: the composed context and its copy (the chunks are released first).
    composing = held + 2 * composed + max(restoring, recomputing)
    filling = composed + caches
    return OVERHEAD + max(composing, filling, answering)


def check_budget(estimate: int, budget: int, *, documents: int, tokens: int) -> None:
    """OverMemoryBudget when a composition of `documents` (`tokens` in all) is estimated to need
    more than `budget` bytes at its peak."""
    if estimate <= budget:
        return
    raise OverMemoryBudget(
        f"composing {documents} documents ({tokens} tokens) would need about {format_size(estimate)} of memory "
        f"at its peak, over the budget of {format_size(budget)} (store.compose_budget): pass fewer or shorter "
        "documents, or raise the budget (`tqstore config set store.compose_budget SIZE`, or "
        "TQSTORE_COMPOSE_BUDGET) if this machine has the memory")
