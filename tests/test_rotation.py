import mlx.core as mx
import numpy as np
import pytest

from turboquant.codec.rotation import Rotation, RotationKind, hadamard_base, orthogonality_error

DIMS = [64, 72, 80, 96, 128, 256]
EXPECTED_KIND = {64: RotationKind.HADAMARD, 72: RotationKind.DENSE, 80: RotationKind.HADAMARD_M,
                 96: RotationKind.HADAMARD_M, 128: RotationKind.HADAMARD, 256: RotationKind.HADAMARD}


@pytest.mark.parametrize("d", DIMS)
def test_orthogonal_and_invertible(d):
    rot = Rotation.create(d, seed=3)
    assert rot.kind is EXPECTED_KIND[d]
    assert orthogonality_error(rot) < 1e-5
    x = mx.random.normal((33, d), key=mx.random.key(1))
    y = rot.forward(x)
    assert mx.max(mx.abs(rot.inverse(y) - x)).item() < 1e-5
    np.testing.assert_allclose(np.linalg.norm(np.array(y), axis=-1), np.linalg.norm(np.array(x), axis=-1), rtol=1e-5)


@pytest.mark.parametrize("d", DIMS)
def test_deterministic_per_seed(d):
    a, b, c = Rotation.create(d, 7), Rotation.create(d, 7), Rotation.create(d, 8)
    x = mx.random.normal((4, d), key=mx.random.key(0))
    assert mx.array_equal(a.forward(x), b.forward(x)).item()
    assert not mx.array_equal(a.forward(x), c.forward(x)).item()


@pytest.mark.parametrize("d", DIMS)
def test_rebuilt_from_arrays_bit_exactly(d):
    rot = Rotation.create(d, seed=11)
    arrays = rot.arrays()
    if rot.kind is RotationKind.HADAMARD:
        assert set(arrays) == {"signs"}
    rebuilt = Rotation.from_arrays(rot.kind.value, arrays.get("signs"), arrays.get("matrix"))
    assert rebuilt.kind is rot.kind
    x = mx.random.normal((9, d), key=mx.random.key(2))
    assert mx.array_equal(rebuilt.forward(x), rot.forward(x)).item()
    assert mx.array_equal(rebuilt.inverse(x), rot.inverse(x)).item()


def test_hadamard_m_falls_back_to_matrix_when_mlx_differs():
    """A persisted 12/20/28-block matrix that this MLX no longer reproduces is applied densely."""
    rot = Rotation.create(80, seed=0)
    perturbed = rot.matrix * mx.array(-1.0)
    rebuilt = Rotation.from_arrays("hadamard_m", -rot.signs * mx.array(-1.0), perturbed)
    assert rebuilt.kind is RotationKind.DENSE
    x = mx.random.normal((3, 80), key=mx.random.key(5))
    np.testing.assert_allclose(np.array(rebuilt.forward(x)), np.array(x @ perturbed), atol=1e-6)


@pytest.mark.parametrize("n", [36, 72, 24 * 3, 44, 100])
def test_unsupported_sizes_never_reach_mlx_hadamard(n):
    """MLX 0.32.4 returns garbage for n=36 and aborts for n=72 on the CPU."""
    assert hadamard_base(n) is None
    assert Rotation.create(n, 0).kind is RotationKind.DENSE


@pytest.mark.parametrize("n, m", [(64, 1), (80, 20), (96, 12), (112, 28), (160, 20), (192, 12), (256, 1)])
def test_supported_sizes(n, m):
    assert hadamard_base(n) == m


def test_from_arrays_rejects_malformed():
    with pytest.raises(ValueError):
        Rotation.from_arrays("hadamard", mx.ones((6,)), None)
    with pytest.raises(ValueError):
        Rotation.from_arrays("dense", None, mx.ones((3, 4)))
    with pytest.raises(ValueError):
        Rotation.from_arrays("nonsense", None, None)
