import itertools

import mlx.core as mx
import numpy as np
import pytest

from turboquant.codec.packing import pack, packed_width, unpack


def test_golden_vector():
    words = pack(mx.array([0, 1, 2, 3, 4, 5, 6, 7, 7, 6, 5, 4]), 3)
    assert words.dtype == mx.uint32
    assert words.tolist() == [0x77FAC688, 0x00000009]


@pytest.mark.parametrize("d, bits, width", [(128, 4, 16), (128, 3, 12), (128, 1, 4), (80, 3, 8), (96, 3, 9),
                                            (64, 2, 4), (256, 3, 24), (80, 2, 5), (128, 8, 32)])
def test_packed_width(d, bits, width):
    assert packed_width(d, bits) == width


def _reference_pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """Bit-by-bit LSB-first stream, the definition the packer must match."""
    d = codes.shape[-1]
    out = np.zeros(codes.shape[:-1] + (packed_width(d, bits),), dtype=np.uint64)
    for j in range(d):
        for b in range(bits):
            bit = (codes[..., j].astype(np.uint64) >> b) & 1
            pos = j * bits + b
            out[..., pos // 32] |= bit << (pos % 32)
    return out.astype(np.uint32)


@pytest.mark.parametrize("d", [1, 7, 31, 32, 33, 64, 80, 96, 128, 256])
@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 8])
def test_matches_bitwise_definition_and_round_trips(d, bits):
    rng = np.random.default_rng(d * 10 + bits)
    codes = rng.integers(0, 1 << bits, size=(2, 3, d))
    words = pack(mx.array(codes), bits)
    np.testing.assert_array_equal(np.array(words), _reference_pack(codes, bits))
    assert mx.array_equal(unpack(words, bits, d), mx.array(codes.astype(np.uint32))).item()


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5])
def test_exhaustive_code_pairs(bits):
    """Every code value at every position of a 32-code chunk (incl. straddling fields)."""
    levels = 1 << bits
    rows = np.array(list(itertools.product(range(levels), repeat=2)))  # all pairs
    codes = np.zeros((len(rows) * 32, 34), dtype=np.int64)
    for pos in range(32):
        codes[pos * len(rows):(pos + 1) * len(rows), pos:pos + 2] = rows
    words = pack(mx.array(codes), bits)
    assert mx.array_equal(unpack(words, bits, 34), mx.array(codes.astype(np.uint32))).item()


def test_rejects_bad_bits_and_widths():
    with pytest.raises(ValueError):
        pack(mx.zeros((4,), mx.uint32), 6)
    with pytest.raises(ValueError, match="words per row"):
        unpack(mx.zeros((3,), mx.uint32), 3, 128)
