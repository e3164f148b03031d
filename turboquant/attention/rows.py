"""One decode step's attention for several rows' compressed storage at once, in plain MLX ops.

The rows arrive stacked (turboquant/cache/rows.py): stored rows [G, H, S, ...] with each row's
own count `stored[g]` (S the longest), raw tails [G, H, T, D] with `tails[g]`, per-row key
calibrations ([G, H, D]) in the key side and per-row block means ([G, H, blocks, D]).

Each row's arithmetic is what `compressed_attention` does for it alone: its scores are laid
out as they would be alone (its stored rows, then its tail, then masked padding), so the
softmax sees its own values in its own order and exact zeros after them, and the mixes give
the padding weight zero. With MLX's CPU backend the result is bit for bit the row's own
(tests/test_attention_rows.py).
"""

from __future__ import annotations

import mlx.core as mx

from turboquant.codec.sides import Side


def rows_attention(queries: mx.array, key_side: Side, value_side: Side, arrays: dict[str, mx.array],
                   stored: list[int], shifts: mx.array | None, tail: tuple[mx.array, mx.array] | None,
                   tails: list[int], scale: float) -> mx.array:
    """softmax(q K^T * scale) V of one query token per row, queries [G, Hq, 1, D], each row over
    its own first `stored[g]` stored rows and `tails[g]` tail rows; [G, Hq, 1, D] in the
    queries' dtype."""
    G, Hq, L, D = queries.shape
    H = next(iter(arrays.values())).shape[1]
    R = Hq // H
    q = (queries.astype(mx.float32) * scale).reshape(G, H, R * L, D)
    parts = [key_side.scores(arrays, q, shifts)]
    S = parts[0].shape[-1]
    if tail is not None:
        parts.append(q @ tail[0].astype(mx.float32).swapaxes(-1, -2))
    parts.append(mx.full((G, H, R * L, 1), mx.finfo(mx.float32).min))
    scores = mx.concatenate(parts, axis=-1)
    padding = scores.shape[-1] - 1
    first = mx.array(stored)[:, None]
    end = first + mx.array(tails)[:, None]
    width = max(s + t for s, t in zip(stored, tails))
    j = mx.arange(width)[None, :]
    # Row g's own order: its stored rows, its tail rows (which sit after the longest stored part),
    # then the masked column.
    order = mx.where(j < first, j, mx.where(j < end, S + j - first, padding))
    scores = mx.take_along_axis(scores, order[:, None, None, :], axis=-1)
    weights = mx.softmax(scores.reshape(G, H, R, L, width), axis=-1, precise=True).reshape(G, H, R * L, width)
    own = mx.arange(S)[None, :] < first
    out = value_side.mix(arrays, mx.where(own[:, None, None, :], weights[..., :S], 0.0))
    if tail is not None:
        t = mx.arange(tail[1].shape[2])[None, :]
        at = mx.minimum(first + t, width - 1)
        picked = mx.take_along_axis(weights, at[:, None, None, :], axis=-1)
        out = out + mx.where((t < end - first)[:, None, None, :], picked, 0.0) @ tail[1].astype(mx.float32)
    return out.reshape(G, Hq, L, out.shape[-1]).astype(queries.dtype)
