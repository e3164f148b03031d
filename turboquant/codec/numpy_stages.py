"""The codec's per-element stages in numpy, for MLX's CPU backend.

MLX's CPU backend runs every op as its own pass over memory, so the codebook search (one
compare and one add per boundary: 30 passes over a float32 array at 4 bits), the packer (a
masked sum per word) and the centroid gather dominate encode and decode on a CPU. Here the
same results come from fewer, cache-sized passes:

- codebook search: the count of boundaries strictly below each coordinate (exactly the
  definition in codec.py), accumulated in uint8 over chunks that stay in L2;
- packing: 8 codes -> one `bits`-byte group (an LSB-first bit stream of little-endian uint32
  words is the same stream cut into bytes), so every supported width packs with eight
  shift-ors of uint32 lanes;
- centroid lookup: 4-bit rows map each byte to its two float32 values with one 8-byte gather,
  3-bit rows each 12-bit field to four values with one 16-byte gather.

Every function is bit-identical to the MLX reference (tests/test_host.py), so the same rows
encode to the same bytes on the CPU and on a GPU.
"""

from __future__ import annotations

import functools

import mlx.core as mx
import numpy as np

from turboquant.codec.packing import CHUNK, packed_width

# Coordinates per pass of the codebook search: 64K float32 + uint8 + bool stay in L2.
SEARCH_CHUNK = 1 << 16
GROUP = 8  # codes per packed group: 8 codes of b bits are b whole bytes


def on_host() -> bool:
    """Whether MLX computes on the CPU here (the numpy stages are only faster there)."""
    return mx.default_device() == mx.cpu


def count_below(y: np.ndarray, boundaries: np.ndarray) -> np.ndarray:
    """Codes uint8: for each float32 coordinate, the number of boundaries strictly below it."""
    flat = np.ascontiguousarray(y, dtype=np.float32).reshape(-1)
    codes = np.zeros(flat.shape, np.uint8)
    above = np.empty(min(SEARCH_CHUNK, flat.size), np.bool_)
    for start in range(0, flat.size, SEARCH_CHUNK):
        part = flat[start:start + SEARCH_CHUNK]
        out = codes[start:start + SEARCH_CHUNK]
        mask = above[:part.size]
        for b in np.asarray(boundaries, np.float32):
            np.greater(part, b, out=mask)
            out += mask.view(np.uint8)
    return codes.reshape(y.shape)


def _lane(bits: int) -> tuple[type, int]:
    """The integer type (and its bytes) that holds one group of 8 codes: 8 * bits bits."""
    return (np.uint32, 4) if bits <= 4 else (np.uint64, 8)


def pack_codes(codes: np.ndarray, bits: int) -> np.ndarray:
    """Codes [..., d] (uint8, each < 2**bits) -> uint32 words [..., ceil(d*bits/32)], as `packing.pack`."""
    d = codes.shape[-1]
    lead = codes.shape[:-1]
    padded = -(-d // CHUNK) * CHUNK
    if padded != d:
        codes = np.concatenate([codes, np.zeros((*lead, padded - d), codes.dtype)], axis=-1)
    if bits == 8:
        words = np.ascontiguousarray(codes, np.uint8).view(np.uint32)
    else:
        lane, width = _lane(bits)
        groups = codes.reshape(*lead, padded // GROUP, GROUP)
        acc = groups[..., 0].astype(lane)
        for k in range(1, GROUP):
            acc |= groups[..., k].astype(lane) << lane(bits * k)
        stream = acc.view(np.uint8).reshape(*lead, -1, width)[..., :bits]
        words = np.ascontiguousarray(stream).reshape(*lead, -1).view(np.uint32)
    return words[..., :packed_width(d, bits)]


def unpack_codes(words: np.ndarray, bits: int, d: int) -> np.ndarray:
    """uint32 words [..., ceil(d*bits/32)] -> codes [..., d] uint8, as `packing.unpack`."""
    lead = words.shape[:-1]
    padded = -(-d // CHUNK) * CHUNK
    full = padded * bits // 32
    words = np.ascontiguousarray(words, np.uint32)
    if words.shape[-1] != full:
        words = np.concatenate([words, np.zeros((*lead, full - words.shape[-1]), np.uint32)], axis=-1)
    raw = words.view(np.uint8)
    if bits == 8:
        return raw[..., :d]
    lane, width = _lane(bits)
    groups = raw.reshape(*lead, padded // GROUP, bits)
    lanes = np.zeros((*lead, padded // GROUP, width), np.uint8)
    lanes[..., :bits] = groups
    acc = lanes.view(lane)[..., 0]
    mask = lane((1 << bits) - 1)
    codes = np.empty((*lead, padded // GROUP, GROUP), np.uint8)
    for k in range(GROUP):
        codes[..., k] = (acc >> lane(bits * k)) & mask
    return codes.reshape(*lead, padded)[..., :d]


@functools.lru_cache(maxsize=64)
def _byte_pairs(centroids: bytes) -> np.ndarray:
    """[256] 8-byte items: the float32 centroids of a byte's low and high 4-bit codes, side by
    side. A gather of 8-byte scalars is numpy's fast path (5x a gather of [256, 2] rows)."""
    c = np.frombuffer(centroids, np.float32)
    b = np.arange(256)
    return np.ascontiguousarray(np.stack([c[b & 15], c[b >> 4]], axis=-1)).view(np.float64).reshape(256)


@functools.lru_cache(maxsize=64)
def _twelve_bit_quads(centroids: bytes) -> np.ndarray:
    """[4096] 16-byte items: the four float32 centroids of a 12-bit field of 3-bit codes."""
    c = np.frombuffer(centroids, np.float32)
    e = np.arange(4096)
    quads = np.stack([c[(e >> (3 * k)) & 7] for k in range(4)], axis=-1)
    return np.ascontiguousarray(quads).view(np.complex128).reshape(4096)


def centroid_values(centroids: np.ndarray, words: np.ndarray, bits: int, d: int) -> np.ndarray:
    """c[code] [..., d] float32 straight from packed words: one gather of 8-byte pairs per byte at
    4 bits, of 16-byte quads per 12-bit field at 3 bits (8 codes are 3 whole bytes)."""
    centroids = np.asarray(centroids, np.float32)
    lead = words.shape[:-1]
    if bits not in (3, 4) or d % CHUNK:
        return centroids[unpack_codes(words, bits, d)]
    raw = np.ascontiguousarray(words, np.uint32).view(np.uint8)
    if bits == 4:
        return np.take(_byte_pairs(centroids.tobytes()), raw).view(np.float32).reshape(*lead, d)
    groups = raw.reshape(*lead, -1, 3).astype(np.uint32)
    stream = groups[..., 0] | (groups[..., 1] << np.uint32(8)) | (groups[..., 2] << np.uint32(16))
    fields = np.stack([stream & np.uint32(0xFFF), stream >> np.uint32(12)], axis=-1)
    return np.take(_twelve_bit_quads(centroids.tobytes()), fields).view(np.float32).reshape(*lead, d)
