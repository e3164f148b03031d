"""Composing stored document chunks into one context, wherever each chunk sits in the prompt.

A chunk is prefilled once right after the prompt's prefix (BOS, system turn, the start of the
user turn), so its first tokens are ordinary tokens, never attention sinks, and the chunk that
directly follows the prefix is exactly what a full prefill computes. In a composed prompt
`[prefix][chunk_1]...[chunk_k]` a chunk starts D positions later than where it was prefilled.

Positions: keys are stored after RoPE. RoPE is a rotation by an angle linear in the position,
so R(p + D) = R(D) R(p): decoded keys are re-rotated by D with each layer's own frequencies
(`RopeShift`; gemma3's local and global layers have different bases). Plain, linear-scaled,
Llama-3, YaRN, LongRoPE and proportional RoPE all rotate by position x fixed frequencies; YaRN and
LongRoPE also multiply the rotated dims by a constant, applied once when the key was computed,
and a rotation of the stored key keeps it, so the shift rotates only and never multiplies again.
Dynamic NTK rescales its base with the sequence length: a key's rotation then depends on how long
the prompt was when it was computed, so it cannot be moved. The alternative, counter-rotating the
query per chunk inside attention, would need one attention pass per chunk and a kernel change for
every layout; re-rotating once into the composed cache costs one elementwise pass per chunk and
leaves decode untouched. TurboQuant's Hadamard rotation does not commute with RoPE, so the keys
are decoded first; the composed cache is raw (prefill phase) and is compressed at the first
decode step like any prefill.

Sliding windows: a chunk entry keeps every token's row of its window layers (turboquant.adapter.windows),
so a window layer is composed like any other over the whole context; the recompute's attention in
a window layer sees only the last W keys of each query (mlx-lm's window mask), and the caches keep
the last W rows of the composed context, as a prefill of it would (chunks.py settles them).

Cross-chunk attention: a chunk prefilled alone never attended to the chunks before it. A
budget of tokens is recomputed in the composed context (CacheBlend's selective recompute): the
first `full_layers` layers run over every token (exact K/V there, and the exact hidden states
to measure how far each stored token's K/V is from its composed-context value), then the tokens
whose K/V deviate most, plus each moved chunk's first tokens, run through the remaining layers
against the composed cache, and their K/V replace the stored ones in every layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import mlx.core as mx

from turboquant import TurboQuantKVCache

from tqstore.engine.compose_blocks import Block, block_of, family, model_type
from tqstore.errors import BadInput

# RoPE modules whose rotation angle is linear in the position, by class name (mlx-lm builds them
# from the config's rope_scaling) -> the kind the chunk's metadata records. Their magnitude factor,
# if any, is a constant (`RopeShift`). DynamicNTKScalingRoPE is refused (`_rope_shift`).
SHIFTABLE_ROPES = {"RoPE": "default", "Llama3RoPE": "llama3", "YarnRoPE": "yarn", "SuScaledRoPE": "longrope",
                   "ProportionalRoPE": "proportional"}
# Layers run over every token before the selected ones, for the deviation selection (layer 0's K/V
# depend on the token and its position only, so they are exact already; layer 1's deviation is
# the first that says something). The attention selection needs none: measured in docs/rag.md,
# dropping them buys a larger budget for the same time and a lower KL.
FULL_LAYERS = 2
SELECTIONS = ("attention", "deviation", "product")
SELECT = "attention"  # how recompute picks tokens beyond the first ones (see `compose`; measured in docs/rag.md)
SINK_TOKENS = 4  # first tokens of each moved chunk that are always recomputed (when the budget allows)
ATTENTION_CHUNK = 512  # most queries per attention step in the recompute
# Bytes of float32 attention scores one step may hold (queries x heads x context). The recompute's
# queries are a fifth of the context by default, so scores for all of them at once grow with the
# square of the context: 41k tokens took 12 GB and a SIGSEGV (issue 27, finding 4).
SCORE_BYTES = 64 * 2**20


@dataclass(frozen=True)
class ChunkKV:
    """One stored chunk decoded: the prefix it was prefilled after, its own tokens, and per
    layer K and V [1, H, T, D] of prefix + chunk (the chunk at positions [len(prefix), T))."""

    prefix: list[int]
    tokens: list[int]
    keys: list[mx.array]
    values: list[mx.array]

    @property
    def start(self) -> int:
        return len(self.prefix)


@dataclass(frozen=True)
class Composed:
    """Per-layer K/V of `[prefix][chunks...]` and what was reused and recomputed."""

    tokens: list[int]
    keys: list[mx.array]
    values: list[mx.array]
    reused: int  # chunk tokens whose stored K/V were kept in the later layers
    recomputed_at: frozenset[int]  # positions in `tokens` of the chunk tokens run through every layer

    @property
    def recomputed(self) -> int:
        """How many chunk tokens were run through every layer in the composed context."""
        return len(self.recomputed_at)


@dataclass(frozen=True, eq=False)  # compared by `describe()` (freqs is an array)
class RopeShift:
    """A RoPE module reduced to its rotation: the angle of rotated pair i at position p is
    p * scale / freqs[i] (freqs None: base ** (2i / dims)). `magnitude` is the constant YaRN
    (mscale) and LongRoPE multiply the rotated dims by when a key is computed; a rotation keeps it,
    so `shift` never applies it again."""

    kind: str
    dims: int
    traditional: bool
    base: float | None
    scale: float
    freqs: mx.array | None
    magnitude: float = 1.0

    def describe(self) -> str:
        """What a chunk records of the RoPE its keys were rotated with."""
        text = f"{self.kind} base={self.base} scale={self.scale} traditional={self.traditional} dims={self.dims}"
        return text if self.magnitude == 1.0 else f"{text} magnitude={self.magnitude}"

    def shift(self, keys: mx.array, delta: int) -> mx.array:
        """Keys [B, H, T, D] stored after RoPE, moved by `delta` positions (R(p + delta) = R(delta) R(p))."""
        if delta == 0:
            return keys
        B, H, T, D = keys.shape
        # One position for every row: each row becomes a length-1 sequence at position `delta`.
        moved = mx.fast.rope(keys.reshape(B * H * T, 1, D), self.dims, traditional=self.traditional,
                             base=self.base if self.freqs is None else None, scale=self.scale, offset=delta,
                             freqs=self.freqs)
        return moved.reshape(B, H, T, D)


def rope_description(model) -> str:
    """What the identity records of the model's RoPE ("default base=... scale=..."; layers with
    another RoPE, such as gemma3's global ones, listed after it); BadInput for models whose
    caches cannot be moved to another position."""
    shifts = [rope_shift(model, i) for i in range(len(model_layers(model)))]
    first = shifts[0].describe()
    others: dict[str, list[int]] = {}
    for i, shift in enumerate(shifts):
        if shift.describe() != first:
            others.setdefault(shift.describe(), []).append(i)
    return "; ".join([first] + [f"layers {','.join(map(str, at))}: {text}" for text, at in others.items()])


# Families whose stored keys are not a RoPE rotation of something position-free, so that
# rotating them by D is not the key at p + D (tests/test_compose_families.py finds them: layer 0's
# moved keys against a prefill's). Multi-head latent attention (deepseek_v3, minicpm3, ...: an
# attention with `qk_rope_head_dim`) rotates only part of each key, elsewhere than where the
# shift rotates, or keeps a latent; these by name:
UNMOVABLE_KEYS = {"afm7": "its keys are normalised after RoPE (k_norm), which a rotation does not commute with"}


def check_composable(model, caches: Sequence[Any]) -> None:
    """BadInput unless every layer is an attention layer with a shiftable RoPE, over the whole
    context or a sliding window: recurrent state is not position-free, and attention chunks
    (llama4) start at fixed positions, so their chunks cannot be moved."""
    name, layers = family(model), len(model_layers(model))
    if 0 < layers < len(caches):
        raise BadInput(f"this {name} model keeps {len(caches)} caches for its {layers} layers (layers run more than "
                       "once): stored chunks cannot be composed for it; save whole prompts instead")
    attention = getattr(model_layers(model)[0], "self_attn", None) if layers else None
    why = UNMOVABLE_KEYS.get(model_type(model) or "")
    if why is None and hasattr(attention, "qk_rope_head_dim"):
        why = "its attention is multi-head latent attention, whose keys RoPE rotates only in part"
    if why is not None:
        raise BadInput(f"stored chunks of this {name} model cannot be moved to another position: {why}; save whole "
                       "prompts instead")
    for i, cache in enumerate(caches):
        kind = type(cache).__name__
        # By class name: mlx-lm is imported only by the engine and the integration modules.
        bases = {c.__name__ for c in type(cache).__mro__}
        if "ArraysCache" in bases:
            raise BadInput(f"this {name} model has recurrent layers (layer {i}: {kind}): their state is not "
                           "position-free, so stored chunks cannot be composed; save whole prompts instead")
        if kind == "RotatingKVCache" and getattr(cache, "keep", 0):
            raise BadInput(f"layer {i} of this {name} model is a sliding window that keeps its first {cache.keep} "
                           "tokens: a composed prompt would keep a chunk's first tokens there, not the prompt's; save "
                           "whole prompts instead")
        if kind != "RotatingKVCache" and not bases & {"KVCache", "TurboQuantKVCache"}:
            raise BadInput(f"layer {i} of this {name} model uses a {kind} (attention chunks or a special cache): "
                           "stored chunks cannot be moved to another position in it; save whole prompts instead")
    rope_description(model)


def window_sizes(caches: Sequence[Any]) -> list[int | None]:
    """Per layer, the tokens a sliding-window layer attends to (None: the whole context)."""
    return [cache.max_size if type(cache).__name__ == "RotatingKVCache" else None for cache in caches]


def rope_shift(model, layer: int = 0) -> RopeShift:
    """The rotation of layer `layer`'s RoPE (BadInput when it is not a shift)."""
    layers = model_layers(model)
    attention = getattr(layers[layer], "self_attn", None) if layers else None
    rope = getattr(attention, "rope", None)
    if rope is None:
        raise BadInput(f"cannot find the RoPE of this {family(model)} model (layers[i].self_attn.rope): composing "
                       "stored chunks needs an attention layer with its own RoPE; save whole prompts instead")
    name = type(rope).__name__
    if name == "DynamicNTKScalingRoPE":
        raise BadInput(f"this {family(model)} model uses dynamic NTK RoPE scaling, whose base grows with the "
                       "sequence length: a stored key's rotation depends on how long its prompt was, so it cannot be "
                       "moved to another position; save whole prompts instead")
    if name not in SHIFTABLE_ROPES:
        raise BadInput(f"this {family(model)} model's RoPE ({name}) is not a rotation linear in the position: "
                       "stored chunks cannot be composed for it; save whole prompts instead")
    kind = SHIFTABLE_ROPES[name]
    if name == "RoPE":
        return RopeShift(kind, rope.dims, rope.traditional, rope.base, rope.scale, None)
    if name == "SuScaledRoPE":
        return RopeShift(kind, rope.dim, False, None, 1.0, rope._freqs, float(rope._scale))
    return RopeShift(kind, rope.dims, rope.traditional, None, 1.0, rope._freqs,
                     float(getattr(rope, "mscale", 1.0)))


def model_layers(model) -> list:
    """The model's decoder layers (a list; plamo keeps it inside a module of its own)."""
    inner = getattr(model, "model", model)
    for layers in (getattr(inner, "layers", None), getattr(model, "layers", None)):
        if layers is not None and not isinstance(layers, (list, tuple)):
            layers = getattr(layers, "layers", None)
        if isinstance(layers, (list, tuple)) and layers:
            return list(layers)
    return []


def decoded_kv(cache) -> tuple[mx.array, mx.array]:
    """K and V [1, H, T, D] held by one restored layer cache, decoded (model dtype)."""
    if isinstance(cache, TurboQuantKVCache):
        keys, values = cache.dequantized()
        dtype = cache.native_dtype
        return keys.astype(dtype), values.astype(dtype)
    return cache.keys[..., :cache.offset, :], cache.values[..., :cache.offset, :]


def shift_keys(model, keys: mx.array, delta: int, layer: int = 0) -> mx.array:
    """Keys [B, H, T, D] of layer `layer` stored after RoPE, moved by `delta` positions."""
    return rope_shift(model, layer).shift(keys, delta)


def compose(model, chunks: Sequence[ChunkKV], budget: float, *, full_layers: int | None = None,
            sink_tokens: int = SINK_TOKENS, tail_tokens: int = 0, question: Sequence[int] | None = None,
            select: str = SELECT, windows: Sequence[int | None] | None = None) -> Composed:
    """The K/V of `[prefix][chunk_1]...[chunk_k]` from stored chunks (all prefilled after the same
    prefix), with `budget` (a fraction of the chunk tokens, 0 to 1) recomputed in context.

    The first chunk sits where it was prefilled, so its K/V are kept as stored; the others are
    moved, and recompute goes to them: first each one's first `sink_tokens`, then the last
    chunk's last `tail_tokens`, then by `select`: "deviation" (CacheBlend: the K/V furthest from
    their in-context value after the first layers), or, given the `question` tokens that follow,
    "attention" (the tokens the question attends to most in a pilot pass over the composed
    cache) or "product" (attention times deviation: what the question reads and is wrong).
    `full_layers` (None: 0 for "attention", FULL_LAYERS otherwise) run over every token first. A
    full recompute is the caller's plain prefill. `windows` gives each layer's sliding window
    (`window_sizes`; None: every layer sees the whole context): the K/V of every token are
    composed in every layer, and a window layer's recompute attends to the last W keys only.
    """
    if not chunks:
        raise BadInput("no documents to compose")
    if select not in SELECTIONS:
        raise BadInput(f"unknown recompute selection {select!r}: use one of {', '.join(SELECTIONS)}")
    prefix = chunks[0].prefix
    if any(c.prefix != prefix for c in chunks):
        raise BadInput("the chunks were stored after different prefixes: store them again with the same system prompt")
    start = len(prefix)
    n_layers = len(chunks[0].keys)
    shifts = [rope_shift(model, layer) for layer in range(n_layers)]
    keys = [[chunks[0].keys[layer][:, :, :start]] for layer in range(n_layers)]
    values = [[chunks[0].values[layer][:, :, :start]] for layer in range(n_layers)]
    tokens, at, moved = list(prefix), start, []
    for chunk in chunks:
        delta = at - start
        for layer in range(n_layers):
            keys[layer].append(shifts[layer].shift(chunk.keys[layer][:, :, start:], delta))
            values[layer].append(chunk.values[layer][:, :, start:])
        if delta:
            moved.append((at, len(chunk.tokens)))
        tokens.extend(chunk.tokens)
        at += len(chunk.tokens)
    keys = [mx.concatenate(k, axis=2) for k in keys]
    values = [mx.concatenate(v, axis=2) for v in values]
    chunk_tokens = len(tokens) - start
    want = int(round(budget * chunk_tokens))
    if want <= 0 or not moved:
        mx.eval(keys, values)
        return Composed(tokens, keys, values, chunk_tokens, frozenset())
    first = [p for at, n in moved for p in range(at, at + min(sink_tokens, n))]
    if moved and tail_tokens:
        at, n = moved[-1]
        first += [p for p in range(max(at + min(sink_tokens, n), at + n - tail_tokens), at + n)]
    if select != "deviation" and not question:
        select = "deviation"
    if full_layers is None:
        full_layers = 0 if select == "attention" else FULL_LAYERS
    windows = list(windows) if windows is not None else [None] * n_layers
    chosen = _recompute(model, block_of(model, budget), tokens, keys, values, moved, want, full_layers, first,
                        question, select, windows)
    if full_layers >= n_layers:  # the full layers ran every token: nothing stored was kept
        chosen = set(range(start, len(tokens)))
    return Composed(tokens, keys, values, chunk_tokens - len(chosen), frozenset(chosen))


def _recompute(model, block: Block, prompt: list[int], keys: list[mx.array], values: list[mx.array],
               moved: list[tuple[int, int]], want: int, full_layers: int, first: list[int],
               question: Sequence[int] | None, select: str, windows: list[int | None]) -> set[int]:
    """Recompute `want` tokens of the moved chunks in place in `keys`/`values`; their positions."""
    layers = model_layers(model)
    full_layers = min(full_layers, len(layers))
    hidden = _embed(model, block, prompt)
    for i in range(full_layers):
        hidden, keys[i], values[i] = _full_layer(layers[i], hidden, windows[i])
    positions = [p for at, n in moved for p in range(at, at + n)]
    chosen = set(first[:want])
    if len(chosen) < want and full_layers < len(layers):
        candidates = mx.array(positions)
        score = None
        if select in ("deviation", "product"):
            exact_k, exact_v = _projected_kv(layers[full_layers], hidden)
            score = _deviation(exact_k, keys[full_layers], exact_v, values[full_layers], candidates)
        if select in ("attention", "product"):
            read = _pilot_attention(model, block, layers, question, keys, values, full_layers, windows)[candidates]
            score = read if score is None else score * read
        for i in mx.argsort(-score).tolist():
            if len(chosen) >= want:
                break
            chosen.add(positions[i])
    selected = mx.array(sorted(chosen))
    h = hidden[:, selected]
    for i in range(full_layers, len(layers)):
        h, keys[i], values[i] = _selected_layer(layers[i], block, h, selected, keys[i], values[i], windows[i])
        mx.eval(h, keys[i], values[i])
    return chosen


def _embed(model, block: Block, tokens: Sequence[int]) -> mx.array:
    """The hidden states the first layer takes, as the family's model code computes them."""
    h = getattr(model, "model", model).embed_tokens(mx.array(list(tokens))[None])
    if block.embed_scale is not None:
        scale = block.embed_scale(model.args)
        h = h * (scale.astype(h.dtype) if isinstance(scale, mx.array) else scale)
    return h


def _visible(queries: mx.array, keys: int, window: int | None, first: int = 0) -> mx.array:
    """Mask [Q, keys - first]: which of the keys at positions [first, keys) the queries at positions
    `queries` attend to (causal, and within the last `window` positions for a sliding-window
    layer, as mlx-lm's mask)."""
    at = mx.arange(first, keys)[None, :]
    mask = at <= queries[:, None]
    if window is not None:
        mask = mask & (at > queries[:, None] - window)
    return mask


class _Capture:
    """The mlx-lm cache protocol, just enough to run one layer over a prompt in steps and keep
    its keys and values."""

    def __init__(self) -> None:
        self.offset = 0
        self.keys: mx.array | None = None
        self.values: mx.array | None = None

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        if self.keys is None:
            self.keys, self.values = keys, values
        else:
            self.keys = mx.concatenate([self.keys, keys], axis=2)
            self.values = mx.concatenate([self.values, values], axis=2)
        self.offset += keys.shape[2]
        return self.keys, self.values


def query_step(heads: int, context: int) -> int:
    """Queries per attention step over `context` keys: at most ATTENTION_CHUNK, and few enough
    that the step's scores stay within SCORE_BYTES."""
    return max(1, min(ATTENTION_CHUNK, SCORE_BYTES // (4 * heads * max(context, 1))))


def _full_layer(layer, hidden: mx.array, window: int | None) -> tuple[mx.array, mx.array, mx.array]:
    """One layer over every token (the model's own code): hidden out, K, V."""
    capture = _Capture()
    out = []
    step = query_step(layer.self_attn.n_heads, hidden.shape[1])
    for at in range(0, hidden.shape[1], step):
        n = min(step, hidden.shape[1] - at)
        mask = "causal" if window is None else _visible(mx.arange(at, at + n), at + n, window)
        part = layer(hidden[:, at:at + step], mask=mask, cache=capture)
        mx.eval(part, capture.keys, capture.values)
        out.append(part)
    return mx.concatenate(out, axis=1), capture.keys, capture.values


def _heads(attention, x: mx.array, n_heads: int, proj, norm_name: str) -> mx.array:
    B, L, _ = x.shape
    out = proj(x).reshape(B, L, n_heads, -1)
    norm = getattr(attention, norm_name, None)
    if norm is not None:
        out = norm(out)
    return out.transpose(0, 2, 1, 3)


def _rope_at(attention, x: mx.array, positions: mx.array | None) -> mx.array:
    """RoPE on x [1, H, L, D] with token i at positions[i] (None: 0..L-1)."""
    if positions is None:
        return attention.rope(x)
    # Each token as its own batch element: mx.fast.rope takes one offset per batch element.
    return attention.rope(x.transpose(2, 1, 0, 3), offset=positions).transpose(2, 1, 0, 3)


def _projected_kv(layer, hidden: mx.array) -> tuple[mx.array, mx.array]:
    """K and V of this layer for every token of `hidden` (no attention needed)."""
    attention = layer.self_attn
    x = layer.input_layernorm(hidden)
    keys = _rope_at(attention, _heads(attention, x, attention.n_kv_heads, attention.k_proj, "k_norm"), None)
    values = _heads(attention, x, attention.n_kv_heads, attention.v_proj, "v_norm")
    return keys, values


def _deviation(exact_k: mx.array, keys: mx.array, exact_v: mx.array, values: mx.array,
               positions: mx.array) -> mx.array:
    """Per position: squared K and V error relative to the layer's mean square (so that neither
    side dominates by scale)."""
    def relative(exact, stored):
        exact = exact[:, :, positions].astype(mx.float32)
        error = mx.sum(mx.square(exact - stored[:, :, positions].astype(mx.float32)), axis=(0, 1, 3))
        return error / mx.mean(mx.sum(mx.square(exact), axis=(0, 1, 3)))
    return relative(exact_k, keys) + relative(exact_v, values)


def _pilot_attention(model, block: Block, layers, question: Sequence[int], keys: list[mx.array],
                     values: list[mx.array], from_layer: int, windows: list[int | None]) -> mx.array:
    """Attention mass each context position gets from the question's tokens, summed over heads,
    queries and the layers from `from_layer` on, in a pass of the question over the composed
    cache (what the answer will read)."""
    n = keys[0].shape[2]
    positions = mx.arange(n, n + len(question))
    h = _embed(model, block, question)
    mass = mx.zeros((n,), dtype=mx.float32)
    for i, layer in enumerate(layers):
        attention = layer.self_attn
        x = layer.input_layernorm(h)
        q = _rope_at(attention, _heads(attention, x, attention.n_heads, attention.q_proj, "q_norm"), positions)
        k = _rope_at(attention, _heads(attention, x, attention.n_kv_heads, attention.k_proj, "k_norm"), positions)
        v = _heads(attention, x, attention.n_kv_heads, attention.v_proj, "v_norm")
        all_k = mx.concatenate([keys[i], k.astype(keys[i].dtype)], axis=2)
        all_v = mx.concatenate([values[i], v.astype(values[i].dtype)], axis=2)
        B, hq, L, D = q.shape
        groups = hq // attention.n_kv_heads
        outs = []
        step = query_step(hq, n + L)
        for at in range(0, L, step):
            rows = q[:, :, at:at + step]
            scores = (rows * attention.scale).reshape(B, attention.n_kv_heads, groups, rows.shape[2], D) @ \
                all_k[:, :, None].swapaxes(-1, -2)
            visible = _visible(positions[at:at + step], n + L, windows[i])
            probs = mx.softmax(mx.where(visible, scores.astype(mx.float32), -mx.inf), axis=-1)
            if i >= from_layer:
                mass = mass + mx.sum(probs[..., :n], axis=(0, 1, 2, 3))
            outs.append((probs.astype(all_v.dtype) @ all_v[:, :, None]).reshape(B, hq, rows.shape[2], -1))
            mx.eval(outs[-1], mass)
        out = mx.concatenate(outs, axis=2)
        h = block.rest(layer, h, attention.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1)))
        mx.eval(h, mass)
    return mass


def _query_groups(positions: list[int], step: int, window: int | None) -> list[tuple[int, int, int, int]]:
    """The selected tokens (sorted positions) in attention steps: (first, end) indices into
    `positions` and the (lo, hi) range of key positions the step reads. A step holds at most
    `step` queries and reads keys up to its last query; in a window layer it also spans less
    than `window` positions and reads from its first query's window on, so that it reads fewer
    than 2 * window keys (not the whole context: 4-8x the work on 8 chunks of 512)."""
    groups, a = [], 0
    for i in range(1, len(positions) + 1):
        if i == len(positions) or i - a >= step or (window is not None and positions[i] - positions[a] >= window):
            lo = 0 if window is None else max(0, positions[a] - window + 1)
            groups.append((a, i, lo, positions[i - 1] + 1))
            a = i
    return groups


def _selected_layer(layer, block: Block, h: mx.array, selected: mx.array, keys: mx.array, values: mx.array,
                    window: int | None) -> tuple[mx.array, mx.array, mx.array]:
    """One block for the selected tokens only, attending to the composed K/V (their own rows
    replaced by the recomputed ones first; in a window layer, to the last `window` of them)."""
    attention = layer.self_attn
    x = layer.input_layernorm(h)
    q = _rope_at(attention, _heads(attention, x, attention.n_heads, attention.q_proj, "q_norm"), selected)
    k = _rope_at(attention, _heads(attention, x, attention.n_kv_heads, attention.k_proj, "k_norm"), selected)
    v = _heads(attention, x, attention.n_kv_heads, attention.v_proj, "v_norm")
    keys[:, :, selected] = k.astype(keys.dtype)
    values[:, :, selected] = v.astype(values.dtype)
    mx.eval(keys, values)
    outs = []
    for a, b, lo, hi in _query_groups(selected.tolist(), query_step(attention.n_heads, keys.shape[2]), window):
        mask = _visible(selected[a:b], hi, window, lo)
        outs.append(mx.fast.scaled_dot_product_attention(q[:, :, a:b], keys[:, :, lo:hi], values[:, :, lo:hi],
                                                         scale=attention.scale, mask=mask))
        mx.eval(outs[-1])
    out = mx.concatenate(outs, axis=2)
    return block.rest(layer, h, attention.o_proj(out.transpose(0, 2, 1, 3).reshape(1, selected.shape[0], -1))), \
        keys, values
