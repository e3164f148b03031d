import mlx.core as mx
import numpy as np
import pytest

from turboquant import NormMode, TurboCodec, lloyd_max_codebook
from turboquant.codec.rotation import Rotation


def _gaussian(rows, d, seed=0, dtype=mx.float32):
    return mx.random.normal((rows, d), key=mx.random.key(seed)).astype(dtype)


def _relative_mse(x, x_hat):
    x = x.astype(mx.float32)
    return mx.mean(mx.sum((x - x_hat) ** 2, axis=-1) / mx.sum(x * x, axis=-1)).item()


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("bits", [2, 3, 4, 5])
def test_d_mse_on_gaussian_rows_within_5_percent(d, bits):
    codec = TurboCodec(d, bits, seed=0)
    x = _gaussian(20000, d, seed=bits)
    packed, norms = codec.encode(x)
    assert _relative_mse(x, codec.decode(packed, norms)) == pytest.approx(lloyd_max_codebook(d, bits).d_mse, rel=0.05)


@pytest.mark.parametrize("d", [64, 80, 96, 128, 256, 72])
def test_shapes_and_dtypes(d):
    codec = TurboCodec(d, 3, seed=1)
    x = mx.random.normal((2, 3, 5, d), key=mx.random.key(0))
    packed, norms = codec.encode(x)
    assert packed.dtype == mx.uint32 and packed.shape == (2, 3, 5, -(-d * 3 // 32))
    assert norms.dtype == mx.float32 and norms.shape == (2, 3, 5)
    out = codec.decode(packed, norms)
    assert out.dtype == mx.float32 and out.shape == x.shape


def test_codes_equal_nearest_centroid_with_ties_to_lower():
    codec = TurboCodec(128, 4, seed=0)
    y = mx.random.normal((4000, 128), key=mx.random.key(3)) / np.sqrt(128)
    codes = np.array(codec.quantize_rotated(y))
    c = np.array(codec.centroids)
    argmin = np.argmin(np.abs(np.array(y)[..., None] - c), axis=-1)
    assert np.array_equal(codes, argmin)
    # An exact boundary value is not "strictly exceeded": it takes the lower code.
    b = codec.boundaries
    assert codec.quantize_rotated(b[None, :]).tolist() == [list(range(15))]


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16, mx.float32])
def test_input_dtypes(dtype):
    codec = TurboCodec(64, 4, seed=0)
    x = _gaussian(512, 64, dtype=dtype)
    packed, norms = codec.encode(x)
    assert _relative_mse(x, codec.decode(packed, norms)) < 2 * lloyd_max_codebook(64, 4).d_mse


def test_bfloat16_outlier_of_70000_survives():
    codec = TurboCodec(64, 4, seed=0)
    x = mx.ones((3, 64), dtype=mx.bfloat16) * mx.array(0.5, mx.bfloat16)
    x[:, 5] = 70000.0
    packed, norms = codec.encode(x)
    out = codec.decode(packed, norms)
    assert mx.all(mx.isfinite(out)).item() and mx.all(mx.isfinite(norms)).item()
    assert norms[0].item() == pytest.approx(np.linalg.norm(np.array(x[0].astype(mx.float32))), rel=1e-6)
    assert out[0, 5].item() == pytest.approx(70000, rel=0.1)


def test_zero_rows_decode_to_zero():
    codec = TurboCodec(64, 2, seed=0)
    packed, norms = codec.encode(mx.zeros((2, 64)))
    assert mx.array_equal(codec.decode(packed, norms), mx.zeros((2, 64))).item()


def test_matched_norm_preserves_row_norm():
    codec = TurboCodec(96, 3, seed=0, norm_mode=NormMode.MATCHED)
    x = _gaussian(256, 96)
    out = codec.decode(*codec.encode(x))
    np.testing.assert_allclose(np.linalg.norm(np.array(out), axis=-1), np.linalg.norm(np.array(x), axis=-1), rtol=1e-5)


def test_rotated_scale_matches_its_decode():
    codec = TurboCodec(64, 4, seed=0)
    x = _gaussian(64, 64)
    scale = mx.linspace(0.5, 2.0, 64)
    packed, norms = codec.encode(x, scale=scale)
    out = codec.decode(packed, norms, scale=scale)
    # Matched norms: the decoded row has the input's norm exactly.
    np.testing.assert_allclose(np.linalg.norm(np.array(out), axis=-1), np.linalg.norm(np.array(x), axis=-1), rtol=1e-5)


def test_from_arrays_encodes_identically():
    codec = TurboCodec(80, 3, seed=4)
    rot = codec.rotation
    rebuilt = TurboCodec.from_arrays(codec.centroids, codec.boundaries,
                                     Rotation.from_arrays(rot.kind.value, rot.signs, rot.matrix))
    x = _gaussian(100, 80, seed=9)
    a, b = codec.encode(x), rebuilt.encode(x)
    assert mx.array_equal(a[0], b[0]).item() and mx.array_equal(a[1], b[1]).item()
    assert rebuilt.bits == 3 and rebuilt.d == 80


def test_independent_seeds_differ():
    x = _gaussian(8, 128)
    assert not mx.array_equal(TurboCodec(128, 4, 0).encode(x)[0], TurboCodec(128, 4, 1).encode(x)[0]).item()


def test_rejects_wrong_width_and_malformed_codebooks():
    codec = TurboCodec(64, 2)
    with pytest.raises(ValueError, match="d=64"):
        codec.encode(mx.zeros((1, 32)))
    with pytest.raises(ValueError):
        TurboCodec.from_arrays(mx.zeros((3,)), mx.zeros((2,)), codec.rotation)
    with pytest.raises(ValueError):
        TurboCodec.from_arrays(mx.zeros((4,)), mx.zeros((2,)), codec.rotation)
