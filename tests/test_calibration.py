import mlx.core as mx
import numpy as np
import pytest

from turboquant import TurboCodec
from turboquant.codec.calibration import (CALIBRATION_TOKENS, CalibrationConfig, KeyCalibration, block_mean,
                                          fit_key_calibration)


def _anisotropic_keys(T=512, H=2, D=64, seed=0):
    """Keys whose channels differ 10x in spread and carry large constant offsets (k_proj bias)."""
    rng = np.random.default_rng(seed)
    spread = np.geomspace(1.0, 10.0, D)[rng.permutation(D)]
    offset = np.zeros(D)
    offset[rng.choice(D, 3, replace=False)] = [150.0, -90.0, 60.0]
    k = rng.standard_normal((1, H, T, D)) * spread + offset
    return mx.array(k.astype(np.float32))


def _round_trip(keys, codec, calib, center):
    shift = block_mean(keys)[None, :, None, :] if center else 0.0
    x = keys - shift
    if calib:
        x = calib.keys_in(x)
    scale = calib.codec_scale() if calib else None
    out = codec.decode(*codec.encode(x, scale=scale), scale=scale)
    if calib:
        out = calib.keys_out(out)
    return out + shift


@pytest.mark.parametrize("config", [CalibrationConfig(True, False, False), CalibrationConfig(True, True, False),
                                    CalibrationConfig(True, True, True)])
def test_calibration_lowers_mse_on_10x_anisotropic_keys(config):
    keys = _anisotropic_keys()
    codec = TurboCodec(64, 4, seed=0)
    calib = fit_key_calibration(keys, codec.rotation, config)
    plain = mx.mean((keys - _round_trip(keys, codec, None, False)) ** 2).item()
    calibrated = mx.mean((keys - _round_trip(keys, codec, calib, config.center)) ** 2).item()
    assert calibrated < 0.5 * plain


def test_query_aware_scales_lower_the_score_error():
    """s = sqrt(rms_k / rms_q) minimises E[(q . dk)^2] for isotropic quantization noise."""
    rng = np.random.default_rng(1)
    keys = _anisotropic_keys(seed=1)
    q_spread = np.geomspace(0.1, 10.0, 64)[rng.permutation(64)]
    queries = mx.array((rng.standard_normal((1, 2, 512, 64)) * q_spread).astype(np.float32))
    codec = TurboCodec(64, 3, seed=0)
    cfg = CalibrationConfig(True, True, False)
    power = mx.mean(queries[:, :, :256] ** 2, axis=(0, 2))
    errors = {}
    for label, p in (("keys only", None), ("query-aware", power)):
        calib = fit_key_calibration(keys, codec.rotation, cfg, p)
        dk = keys - _round_trip(keys, codec, calib, True)
        errors[label] = mx.mean(mx.sum(queries * dk, axis=-1) ** 2).item()
    assert errors["query-aware"] < 0.8 * errors["keys only"]


def test_scale_folds_into_the_query_exactly():
    keys = _anisotropic_keys(T=300)
    calib = fit_key_calibration(keys, None, CalibrationConfig(True, True, False))
    q = mx.random.normal((1, 2, 3, 64), key=mx.random.key(1))  # grouped by KV head
    folded = calib.query_in(q) @ calib.keys_in(keys).transpose(0, 1, 3, 2)
    plain = q @ keys.transpose(0, 1, 3, 2)
    np.testing.assert_allclose(np.array(folded), np.array(plain), rtol=1e-4, atol=1e-3)


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
    assert fit_key_calibration(_anisotropic_keys(), rot, CalibrationConfig(True, False, False)) is None


def test_flat_scales_are_dropped():
    # Every channel holds exactly 128 values of +1 and 128 of -1: zero mean, RMS exactly 1.
    rng = np.random.default_rng(0)
    signs = np.stack([rng.permutation(np.repeat([1.0, -1.0], 128)) for _ in range(64)], axis=-1)
    keys = mx.array(signs[None, None].astype(np.float32))
    assert fit_key_calibration(keys, TurboCodec(64, 4).rotation, CalibrationConfig(True, True, False)) is None


def test_rotated_scale_needs_the_rotation():
    with pytest.raises(ValueError, match="rotation"):
        fit_key_calibration(_anisotropic_keys(), None, CalibrationConfig(True, False, True))


def test_arrays_round_trip():
    keys = _anisotropic_keys()
    calib = fit_key_calibration(keys, TurboCodec(64, 4).rotation, CalibrationConfig(True, True, True))
    rebuilt = KeyCalibration.from_arrays(calib.arrays())
    for name, arr in calib.arrays().items():
        assert mx.array_equal(arr, rebuilt.arrays()[name]).item()
    with pytest.raises(ValueError):
        KeyCalibration.from_arrays({"bogus": mx.zeros((2,))})
