"""LSB-first bit-stream packing of small unsigned codes into uint32 words.

Code j of a row occupies bits [j*b, j*b + b) of the row's little-endian bit stream, so a
3-bit field may straddle two words; a row of d codes takes ceil(d*b/32) words. Any 32
consecutive codes fill exactly b words, which lets the packer work on 32-code chunks with
static per-column (word, shift) tables: vectorized, no loop over rows or columns.
"""

from __future__ import annotations

import functools

import mlx.core as mx
import numpy as np

SUPPORTED_BITS = (1, 2, 3, 4, 5, 8)
CHUNK = 32


def packed_width(d: int, bits: int) -> int:
    """Words per packed row: ceil(d * bits / 32)."""
    _check_bits(bits)
    return -(-d * bits // 32)


def _check_bits(bits: int) -> None:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"packing supports bits {SUPPORTED_BITS}, got {bits!r}")


@functools.lru_cache(maxsize=None)
def _layout(bits: int) -> tuple[mx.array, mx.array, mx.array, mx.array]:
    """Per column of a 32-code chunk: word index, shift, spill flag, spill shift."""
    offsets = np.arange(CHUNK) * bits
    word = offsets // 32
    shift = offsets % 32
    spill = shift + bits > 32
    spill_shift = np.where(spill, 32 - shift, 0)
    return (
        mx.array(word.astype(np.uint32)),
        mx.array(shift.astype(np.uint32)),
        mx.array(spill),
        mx.array(spill_shift.astype(np.uint32)),
    )


def pack(indices: mx.array, bits: int) -> mx.array:
    """Pack codes [..., d] (each < 2**bits) into uint32 words [..., ceil(d*bits/32)].

    Code j's bit i is bit j*b + i of the row's stream, so the codes' bit planes laid out code by
    code are the stream itself: 32 of them at a time make one word. A handful of whole-array
    operations whatever `bits` is; the per-word masked sums this replaced took four per bit,
    each a kernel launch on a GPU. Where b divides 32 the codes themselves fill words."""
    _check_bits(bits)
    d = indices.shape[-1]
    lead = indices.shape[:-1]
    n_chunks = -(-d // CHUNK)
    codes = _padded(indices.astype(mx.uint32), n_chunks * CHUNK)
    if 32 % bits == 0:
        fields = codes.reshape(*lead, n_chunks * bits, 32 // bits)
        shifts = mx.arange(0, 32, bits, dtype=mx.uint32)
    else:
        planes = mx.right_shift(codes[..., None], mx.arange(bits, dtype=mx.uint32)) & mx.array(1, mx.uint32)
        fields = planes.reshape(*lead, n_chunks * bits, 32)
        shifts = mx.arange(32, dtype=mx.uint32)
    # Fields never overlap, so summing a word's shifted fields equals OR-ing them.
    out = mx.sum(mx.left_shift(fields, shifts), axis=-1).astype(mx.uint32)
    return out[..., : packed_width(d, bits)]


def _padded(a: mx.array, size: int) -> mx.array:
    """`a` with zeros appended along its last axis up to `size` (whole chunks)."""
    short = size - a.shape[-1]
    return a if short == 0 else mx.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, short)])


def unpack(words: mx.array, bits: int, d: int) -> mx.array:
    """Unpack uint32 words [..., ceil(d*bits/32)] into codes [..., d] (uint32)."""
    _check_bits(bits)
    width = packed_width(d, bits)
    if words.shape[-1] != width:
        raise ValueError(f"expected {width} words per row for d={d}, bits={bits}, got {words.shape[-1]}")
    lead = words.shape[:-1]
    n_chunks = -(-d // CHUNK)
    words = _padded(words.astype(mx.uint32), n_chunks * bits).reshape(*lead, n_chunks, bits)
    word, shift, spill, spill_shift = _layout(bits)
    low = mx.right_shift(mx.take(words, word, axis=-1), shift)
    next_word = mx.take(words, mx.minimum(word + 1, bits - 1), axis=-1)
    high = mx.where(spill, mx.left_shift(next_word, spill_shift), mx.array(0, mx.uint32))
    mask = mx.array((1 << bits) - 1, mx.uint32)
    codes = mx.bitwise_and(mx.bitwise_or(low, high), mask)
    return codes.reshape(*lead, n_chunks * CHUNK)[..., :d]
