"""The numpy stages of the codec (turboquant/codec/numpy_stages.py) against the MLX reference, bit for bit."""

import mlx.core as mx
import numpy as np
import pytest

from turboquant.codec import numpy_stages as host
from turboquant.codec.turbo import TurboCodec
from turboquant.codec.packing import SUPPORTED_BITS, pack, unpack


@pytest.mark.parametrize("bits", SUPPORTED_BITS)
@pytest.mark.parametrize("d", [64, 80, 96, 128])
def test_pack_and_unpack_match_the_reference(d, bits):
    rng = np.random.default_rng(d * 10 + bits)
    codes = rng.integers(0, 1 << bits, size=(2, 3, 5, d)).astype(np.uint8)
    words = host.pack_codes(codes, bits)
    assert np.array_equal(words, np.asarray(pack(mx.array(codes), bits)))
    assert np.array_equal(host.unpack_codes(words, bits, d), codes)
    assert np.array_equal(host.unpack_codes(np.asarray(pack(mx.array(codes), bits)), bits, d),
                          np.asarray(unpack(mx.array(words), bits, d)))


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5])
def test_count_below_matches_the_reference_on_ties_and_extremes(bits):
    """Both searches (numpy's on the host, MLX's binary search) against each other and against
    the definition, comparing with every boundary."""
    codec = TurboCodec(64, bits)
    b = np.asarray(codec.boundaries)
    special = np.concatenate([b, np.nextafter(b, np.float32(1)), np.nextafter(b, np.float32(-1)),
                              [0.0, -0.0, 1e30, -1e30, np.inf, -np.inf, np.nan]]).astype(np.float32)
    rows = np.random.default_rng(bits).normal(0, 0.15, size=(3, 70_001)).astype(np.float32)
    for y in (special, rows):
        every = np.sum(y[..., None] > b, axis=-1)
        assert np.array_equal(host.count_below(y, b), every)
        assert np.array_equal(np.asarray(codec.quantize_rotated(mx.array(y))), every)


@pytest.mark.parametrize("bits", [2, 3, 4, 5])
@pytest.mark.parametrize("d", [64, 96])
def test_centroid_values_match_the_reference(d, bits):
    codec = TurboCodec(d, bits)
    packed, _ = codec.encode(mx.random.normal((1, 2, 9, d), key=mx.random.key(bits)))
    want = codec.centroids[codec.codes(packed)]
    got = host.centroid_values(np.asarray(codec.centroids), np.asarray(packed), bits, d)
    assert np.array_equal(got, np.asarray(want))


@pytest.mark.parametrize("norm_mode", ["raw", "matched"])
@pytest.mark.parametrize("bits", [3, 4, 5])
def test_encode_on_the_host_matches_the_mlx_path(monkeypatch, bits, norm_mode):
    codec = TurboCodec(64, bits, seed=3, norm_mode=norm_mode)
    x = mx.random.normal((1, 2, 300, 64), key=mx.random.key(7)) * 3
    scale = mx.random.uniform(0.5, 2.0, (2, 1, 64), key=mx.random.key(8))
    for s in (None, scale):
        words, norms = codec.encode(x, s)
        decoded = codec.decode_rotated(words, norms, s)
        monkeypatch.setattr(host, "on_host", lambda: False)
        ref_words, ref_norms = codec.encode(x, s)
        ref_decoded = codec.decode_rotated(words, norms, s)
        monkeypatch.undo()
        assert mx.array_equal(words, ref_words) and mx.array_equal(decoded, ref_decoded)
        np.testing.assert_allclose(np.asarray(norms), np.asarray(ref_norms), rtol=1e-6)
