import mlx.core as mx
import pytest

from turboquant.codec.affine import AffineCodec, UnsupportedHeadDim, affine_group_size


@pytest.mark.parametrize("d, g", [(64, 64), (128, 64), (256, 64), (96, 32), (160, 32), (32, 32)])
def test_group_size_order(d, g):
    assert affine_group_size(d) == g


@pytest.mark.parametrize("d", [80, 48, 100])
def test_no_group_size_names_d_and_the_sizes(d):
    with pytest.raises(UnsupportedHeadDim, match=rf"head dim {d}.*64, 32, 128"):
        affine_group_size(d)
    assert issubclass(UnsupportedHeadDim, ValueError)


EPS = {mx.float16: 2.0**-11, mx.bfloat16: 2.0**-8, mx.float32: 2.0**-24}


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16, mx.float32])
def test_round_trip_within_one_step(bits, dtype):
    codec = AffineCodec.for_dim(96, bits)
    x = mx.random.normal((4, 10, 96), key=mx.random.key(0)).astype(dtype)
    w, s, b = codec.encode(x)
    assert w.dtype == mx.uint32 and w.shape == (4, 10, 96 * bits // 32)
    assert s.dtype == dtype and s.shape == (4, 10, 96 // 32)
    out = codec.decode(w, s, b)
    assert out.dtype == dtype
    err = mx.abs(out.astype(mx.float32) - x.astype(mx.float32)).reshape(4, 10, 3, 32)
    step = mx.abs(s.astype(mx.float32))[..., None]
    # MLX anchors the bias at an edge of the group, so an element may sit up to one step
    # from its level (measured: 0.99 steps), plus the dtype's rounding of scale, bias and result.
    bound = step + 4 * EPS[dtype] * mx.max(mx.abs(x.astype(mx.float32)))
    assert mx.all(err <= bound).item()


def test_rejects_bad_parameters():
    with pytest.raises(ValueError):
        AffineCodec(bits=3, group_size=64)
    with pytest.raises(ValueError):
        AffineCodec(bits=8, group_size=48)
