import mlx.core as mx
import numpy as np
import pytest

from turboquant import TurboCodec
from turboquant.calibration import CALIBRATION_TOKENS, CalibrationConfig, KeyCalibration, fit_key_calibration


def _anisotropic_keys(T=512, H=2, D=64, seed=0):
    """Keys whose channels differ 10x in spread and carry large constant offsets (k_proj bias)."""
    rng = np.random.default_rng(seed)
    spread = np.geomspace(1.0, 10.0, D)[rng.permutation(D)]
    offset = np.zeros(D)
    offset[rng.choice(D, 3, replace=False)] = [150.0, -90.0, 60.0]
    k = rng.standard_normal((1, H, T, D)) * spread + offset
    return mx.array(k.astype(np.float32))


def _key_mse(keys, codec, calib):
    k_in = calib.keys_in(keys) if calib else keys
    scale = calib.codec_scale() if calib else None
    packed, norms = codec.encode(k_in, scale=scale)
    k_hat = codec.decode(packed, norms, scale=scale)
    if calib:
        k_hat = calib.keys_out(k_hat)
    return mx.mean((keys - k_hat) ** 2).item()


@pytest.mark.parametrize("config", [CalibrationConfig(True, False, False), CalibrationConfig(True, True, False),
                                    CalibrationConfig(True, True, True)])
def test_calibration_lowers_mse_on_10x_anisotropic_keys(config):
    keys = _anisotropic_keys()
    codec = TurboCodec(64, 4, seed=0)
    calib = fit_key_calibration(keys, codec.rotation, config)
    assert calib is not None
    assert _key_mse(keys, codec, calib) < 0.5 * _key_mse(keys, codec, None)


def test_rotated_scale_alone_does_not_worsen_mse():
    keys = _anisotropic_keys(seed=2)
    codec = TurboCodec(64, 3, seed=0)
    calib = fit_key_calibration(keys, codec.rotation, CalibrationConfig(False, False, True))
    if calib is not None:
        assert _key_mse(keys, codec, calib) <= 1.05 * _key_mse(keys, codec, None)


def test_scores_unchanged_in_form():
    """q.k over calibrated keys equals the plain score up to a per-query constant (q.mu)."""
    keys = _anisotropic_keys(T=300)
    codec = TurboCodec(64, 4, seed=0)
    calib = fit_key_calibration(keys, codec.rotation, CalibrationConfig(True, True, False))
    q = mx.random.normal((1, 2, 3, 64), key=mx.random.key(1))  # GQA 3 over 2 KV heads, grouped
    folded = calib.query_in(q) @ calib.keys_in(keys).transpose(0, 1, 3, 2)
    plain = q @ keys.transpose(0, 1, 3, 2)
    diff = np.array(plain - folded)
    # Constant along the key axis: softmax cannot tell the two apart.
    np.testing.assert_allclose(diff - diff[..., :1], 0, atol=2e-3 * np.abs(np.array(plain)).max())


def test_uses_only_the_first_block_of_tokens():
    keys = _anisotropic_keys(T=600)
    rot = TurboCodec(64, 4).rotation
    cfg = CalibrationConfig(True, True, True)
    a = fit_key_calibration(keys, rot, cfg)
    altered = mx.concatenate([keys[..., :CALIBRATION_TOKENS, :], keys[..., CALIBRATION_TOKENS:, :] * 3], axis=2)
    b = fit_key_calibration(altered, rot, cfg)
    for name, arr in a.arrays().items():
        assert mx.array_equal(arr, b.arrays()[name]).item()


def test_skipped_when_too_few_rows_or_disabled():
    rot = TurboCodec(64, 4).rotation
    assert fit_key_calibration(_anisotropic_keys(T=31, H=1), rot, CalibrationConfig()) is None
    assert fit_key_calibration(_anisotropic_keys(), rot, CalibrationConfig(False, False, False)) is None


def test_flat_scales_are_dropped():
    # Every channel holds exactly 128 values of +1 and 128 of -1: zero mean, RMS exactly 1.
    rng = np.random.default_rng(0)
    signs = np.stack([rng.permutation(np.repeat([1.0, -1.0], 128)) for _ in range(64)], axis=-1)
    keys = mx.array(signs[None, None].astype(np.float32))
    calib = fit_key_calibration(keys, TurboCodec(64, 4).rotation, CalibrationConfig(True, True, False))
    assert calib.scale is None and calib.shift is not None
    assert mx.max(mx.abs(calib.shift)).item() == 0.0


def test_arrays_round_trip():
    keys = _anisotropic_keys()
    calib = fit_key_calibration(keys, TurboCodec(64, 4).rotation, CalibrationConfig(True, True, True))
    rebuilt = KeyCalibration.from_arrays(calib.arrays())
    for name, arr in calib.arrays().items():
        assert mx.array_equal(arr, rebuilt.arrays()[name]).item()
    with pytest.raises(ValueError):
        KeyCalibration.from_arrays({"bogus": mx.zeros((2,))})
