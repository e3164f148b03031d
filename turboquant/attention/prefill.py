"""Multi-token attention over compressed storage (a question's prefill after a restore).

The plain-ops path (attention.compressed_attention) scores grouped queries against codebook
values and mixes values through the sides, several passes and a softmax of its own per layer.
A prefill chunk has many queries, so here every layer's stored rows are decoded once per chunk
into dense rows in the basis the scores live in, and MLX's fused scaled_dot_product_attention
does the rest, as it does for a raw cache:

- TurboQuant keys stay rotated: q' = rotate(query_in(q)) * r and k' = c[code] * norm + m', with
  the block mean of calibrated keys carried into the same basis (m' = rotate(mean / s) / r), so
  q' . k' = q . k~ (exactly the scores of the plain path, up to float rounding);
- affine keys add mean / s to the dequantized rows (qc . (k + mean / s) = qc . k + q . mean);
- TurboQuant values are mixed rotated and the output rotated back once per row.

Decoding only needs the byte-table lookup and two elementwise passes per side, never an
inverse rotation of the stored rows.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from turboquant.codec import numpy_stages as host
from turboquant.codec.turbo import TurboCodec
from turboquant.codec.sides import SHIFT_BLOCK, AffineSide, NativeSide, Side, TurboSide, per_token_shifts


def _key_rows(side: Side, arrays: dict[str, mx.array], q: mx.array,
              shifts: mx.array | None) -> tuple[mx.array, mx.array]:
    """(queries, keys) in one basis where q' . k' equals the plain path's score."""
    if isinstance(side, NativeSide):
        return q, side.decode(arrays).astype(mx.float32)
    if isinstance(side, AffineSide):
        k = side._stored(arrays).astype(mx.float32)
        qc = q if side.calibration is None else side.calibration.query_in(q)
        if shifts is not None:
            k = k + per_token_shifts(_unscale(side, shifts), k.shape[2])
        return qc, k
    packed, norms = (arrays[n] for n in side._names())
    mean = None
    if shifts is not None:
        mean = side.codec.rotation.forward(_unscale(side, shifts))
        scale = side._scale()
        if scale is not None:
            mean = mean / scale
    # The rotated channel scale r lives in q' (rotate_queries), not in the rows.
    return side.rotate_queries(q), _rotated_rows(side.codec, packed, norms, mean)


def _value_rows(side: Side, arrays: dict[str, mx.array]) -> mx.array:
    """Stored values as dense float32 rows (rotated for TurboQuant values)."""
    if isinstance(side, TurboSide):
        packed, norms = (arrays[n] for n in side._names())
        return _rotated_rows(side.codec, packed, norms)
    return side.decode(arrays).astype(mx.float32)


def _rotated_rows(codec: TurboCodec, packed: mx.array, norms: mx.array, mean: mx.array | None = None) -> mx.array:
    """c[code] * norm (+ the block mean [H, blocks, D] of each row's block), float32 [B, H, T, D].

    On the CPU in place in numpy (one lookup, one multiply, one add per block), not as MLX ops
    that each allocate a [B, H, T, D] array (and a repeated mean).
    """
    if not host.on_host():
        rows = codec.centroid_values(packed) * norms[..., None]
        return rows if mean is None else rows + per_token_shifts(mean, rows.shape[2])
    rows = host.centroid_values(np.asarray(codec.centroids), np.asarray(packed), codec.bits, codec.d)
    rows *= np.asarray(norms)[..., None]
    if mean is not None:
        means = np.asarray(mean)
        for b in range(means.shape[1]):
            rows[:, :, b * SHIFT_BLOCK:(b + 1) * SHIFT_BLOCK] += means[None, :, b, None, :]
    return mx.array(rows)


def prefill_attention(
    queries: mx.array,
    key_side: Side,
    value_side: Side,
    arrays: dict[str, mx.array],
    scale: float,
    mask,
    shifts: mx.array | None,
    tail: tuple[mx.array, mx.array] | None,
    sinks: mx.array | None = None,
) -> mx.array:
    """softmax(q K^T * scale + mask) V for queries [B, Hq, L > 1, D] over stored rows (`arrays`,
    sliced to the rows that count) and an optional raw tail; same contract as
    compressed_attention, `sinks` [Hq] included (logits that join the normaliser only)."""
    B, Hq, L, D = queries.shape
    H = next(iter(arrays.values())).shape[1]
    R = Hq // H
    q = (queries.astype(mx.float32) * scale).reshape(B, H, R * L, D)
    q, k = _key_rows(key_side, arrays, q, shifts)
    v = _value_rows(value_side, arrays)
    rotated_values = isinstance(value_side, TurboSide)
    if tail is not None:
        tk, tv = (t.astype(mx.float32) for t in tail)
        if not isinstance(key_side, NativeSide) or rotated_values:
            # A raw tail row must land in the stored rows' basis: keys through the same query map.
            tk = _tail_keys(key_side, tk)
            if rotated_values:
                tv = value_side.codec.rotation.forward(tv)
        k = mx.concatenate([k, tk], axis=2)
        v = mx.concatenate([v, tv], axis=2)
    q = q.reshape(B, Hq, L, q.shape[-1])
    if isinstance(mask, mx.array) and mask.dtype != mx.bool_:
        mask = mask.astype(mx.float32)
    if sinks is not None:
        sinks = sinks.astype(mx.float32)
    out = mx.fast.scaled_dot_product_attention(q, k, v, scale=1.0, mask=mask, sinks=sinks)
    if rotated_values:
        out = value_side.codec.rotation.inverse(out)
    return out.astype(queries.dtype)


def _unscale(side: AffineSide | TurboSide, rows: mx.array) -> mx.array:
    """Original-basis rows [H, n, D] divided by the key channel scales (what q * s meets)."""
    calibration = side.calibration
    if calibration is None or calibration.scale is None:
        return rows
    return rows / calibration.scale[:, None, :]


def _tail_keys(side: Side, tk: mx.array) -> mx.array:
    """Raw keys mapped so that q' . k' = q . k: the inverse of the side's query map."""
    if isinstance(side, NativeSide):
        return tk
    tk = _unscale(side, tk)
    if isinstance(side, AffineSide):
        return tk
    tk = side.codec.rotation.forward(tk)
    scale = side._scale()
    return tk if scale is None else tk / scale
