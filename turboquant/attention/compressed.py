"""Attention over compressed storage in plain MLX ops: the reference path and the CPU path.

Queries are grouped by KV head (query head h reads KV head h // R, as in mlx-lm), scored in
float32 against whatever the key side stores, softmaxed in float32, mixed with whatever the
value side stores, and returned in the activation dtype so later layers are never promoted.
"""

from __future__ import annotations

import mlx.core as mx

from turboquant.attention.kernels import fused_decode, fused_prefill
from turboquant.attention.prefill import prefill_attention
from turboquant.codec.sides import Side

MaskLike = None | str | mx.array


def causal_mask(L: int, T: int) -> mx.array:
    """[L, T] bool: query i (absolute position T - L + i) sees keys t <= T - L + i."""
    return mx.arange(T)[None, :] <= (T - L + mx.arange(L))[:, None]


def _grouped_mask(mask: mx.array, B: int, H: int, R: int) -> mx.array:
    """Bring an mlx-lm mask ([L, T], [B, L, T] or [B, 1 | Hq, L, T]) to [B, H, R, L, T] broadcasting."""
    if mask.ndim <= 2:
        return mask
    if mask.ndim == 3:
        return mask[:, None, None]
    if mask.shape[1] == 1:
        return mx.expand_dims(mask, 2)
    return mask.reshape(mask.shape[0], H, R, *mask.shape[2:])


def apply_mask(scores: mx.array, mask: MaskLike) -> mx.array:
    """Mask scores [B, H, R, L, T] (bool: True attends; float: added)."""
    if mask is None:
        return scores
    B, H, R, L, T = scores.shape
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"unknown mask {mask!r}; expected None, 'causal' or an array")
        if L == 1:
            return scores
        mask = causal_mask(L, T)
    else:
        mask = _grouped_mask(mask, B, H, R)
    if mask.dtype == mx.bool_:
        return mx.where(mask, scores, mx.finfo(mx.float32).min)
    return scores + mask.astype(mx.float32)


def compressed_attention(
    queries: mx.array,
    key_side: Side,
    value_side: Side,
    arrays: dict[str, mx.array],
    scale: float,
    mask: MaskLike = None,
    shifts: mx.array | None = None,
    tail: tuple[mx.array, mx.array] | None = None,
    rows: int | None = None,
    tail_rows: int | None = None,
    sinks: mx.array | None = None,
    memo: dict | None = None,
) -> mx.array:
    """softmax(q K^T * scale + mask) V for queries [B, Hq, L, D].

    Keys and values are the stored rows (`arrays`, read through the sides; `shifts` are the
    per-block key means of calibrated keys) followed by an optional raw tail (K, V native,
    [B, H, n, D]) of the newest rows that do not yet fill a block. `rows` / `tail_rows`: the
    arrays / the tail are buffers of which only the first `rows` / `tail_rows` tokens count
    (None: all). `sinks` ([Hq] logits, gpt-oss): one more score per query head that joins the
    softmax normaliser and mixes no value, as in mx.fast.scaled_dot_product_attention.
    `memo`: a dict owned with the buffers, where a GPU call (a decode step, a question) is kept
    and replayed (`kernels.fused_decode`).
    """
    B, Hq, L, D = queries.shape
    some = next(iter(arrays.values())) if arrays else tail[0]
    H = some.shape[1]
    if Hq % H:
        raise ValueError(f"{Hq} query heads cannot share {H} KV heads evenly")
    R = Hq // H
    if L == 1 and arrays and (mask is None or (isinstance(mask, str) and mask == "causal")):
        # One query token: the fused GPU kernels over the stored rows and the raw tail (None on
        # the CPU, or when no kernel fits).
        fused = fused_decode(queries, key_side, value_side, arrays, scale, shifts, tail, rows, tail_rows, sinks,
                             memo=memo)
        if fused is not None:
            return fused[0]
    if L > 1 and arrays and sinks is None:
        # A question or a prefill chunk: the decode kernels with its tokens as more query rows
        # (None on the CPU, or when a mask must reach into the stored rows).
        fused = fused_prefill(queries, key_side, value_side, arrays, scale, mask, shifts, tail, rows, tail_rows,
                              memo=memo)
        if fused is not None:
            return fused
    if rows is not None:
        arrays = {n: a[:, :, :rows] for n, a in arrays.items()}
    if tail is not None and tail_rows is not None:
        tail = (tail[0][:, :, :tail_rows], tail[1][:, :, :tail_rows])
    if L > 1 and arrays:
        # Otherwise decode the stored rows once and run the fused SDPA (turboquant/attention/prefill.py).
        return prefill_attention(queries, key_side, value_side, arrays, scale, mask, shifts, tail, sinks)
    q = (queries.astype(mx.float32) * scale).reshape(B, H, R * L, D)
    parts = []
    if arrays:
        parts.append(key_side.scores(arrays, q, shifts))
    if tail is not None:
        parts.append(q @ tail[0].astype(mx.float32).swapaxes(-1, -2))
    scores = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=-1)
    T = scores.shape[-1]
    scores = apply_mask(scores.reshape(B, H, R, L, T), mask)
    if sinks is not None:
        # The sink column takes its share of the normaliser and is dropped before the mix.
        sink = mx.broadcast_to(sinks.astype(mx.float32).reshape(1, H, R, 1, 1), (B, H, R, L, 1))
        scores = mx.concatenate([scores, sink], axis=-1)
    weights = mx.softmax(scores, axis=-1, precise=True)[..., :T].reshape(B, H, R * L, T)
    stored = T - (tail[0].shape[2] if tail is not None else 0)
    out = value_side.mix(arrays, weights[..., :stored]) if arrays else 0.0
    if tail is not None:
        out = out + weights[..., stored:] @ tail[1].astype(mx.float32)
    return out.reshape(B, Hq, L, out.shape[-1]).astype(queries.dtype)
