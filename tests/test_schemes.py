import pytest

from turboquant import parse_scheme
from turboquant.codec.schemes import SCHEMES, Format

# docs/turboquant.md ("Schemes" table): bytes per token per KV head at d=128, fp16 activations, f32 norms.
BYTES_D128 = {"raw": 512, "affine8": 272, "affine4": 144, "turbo0v4": 324, "turbo0v3": 308, "turbo0v2": 292,
              "turbo8v4": 204, "turbo8v3": 188, "turbo8v2": 172, "turbo4": 136, "turbo3": 104, "turbo2": 72,
              "turbo4v2": 104}


@pytest.mark.parametrize("name, nbytes", sorted(BYTES_D128.items()))
def test_bytes_per_token_match_turboquant_md(name, nbytes):
    spec = parse_scheme(name)
    assert spec.bytes_per_token(128) == nbytes
    assert spec.compression(128) == pytest.approx(512 / nbytes)


def test_formats_and_bits():
    s = parse_scheme("turbo8v3")
    assert (s.name, s.key_format, s.value_format, s.key_bits, s.value_bits) == \
        ("turbo8v3", Format.AFFINE, Format.TURBO, 8, 3)
    s = parse_scheme("turbo0v4")
    assert (s.key_format, s.key_bits, s.value_format, s.value_bits) == (Format.NATIVE, 0, Format.TURBO, 4)
    s = parse_scheme("affine4")
    assert (s.key_format, s.value_format, s.key_bits) == (Format.AFFINE, Format.AFFINE, 4)
    s = parse_scheme("turbo4v2")
    assert (s.key_bits, s.value_bits, s.calibrated) == (4, 2, True)


@pytest.mark.parametrize("alias, canonical", [("turbo4v4", "turbo4"), ("TURBO3V3", "turbo3"), (" turbo8v3 ", "turbo8v3"),
                                              ("Raw", "raw")])
def test_canonical_names(alias, canonical):
    assert parse_scheme(alias).name == canonical


@pytest.mark.parametrize("name, fragile", [("raw", False), ("affine8", False), ("affine4", False),
                                           ("turbo0v4", False), ("turbo0v3", False), ("turbo0v2", True),
                                           ("turbo8v3", False), ("turbo8v2", True), ("turbo4", True),
                                           ("turbo2v4", True)])
def test_fragility(name, fragile):
    assert parse_scheme(name).fragile is fragile


def test_calibrated_only_with_turbo_keys():
    assert {n for n, s in SCHEMES.items() if s.calibrated} == {n for n, s in SCHEMES.items()
                                                               if s.key_format is Format.TURBO}


@pytest.mark.parametrize("bad", ["turbo5", "turbo5v5", "turbo6v4", "turbo0v8", "turbo8", "affine3", "", "turbo1", "turbo4v1", None, 4])
def test_unknown_names_list_valid_ones(bad):
    with pytest.raises(ValueError) as err:
        parse_scheme(bad)
    if isinstance(bad, str):
        assert "turbo8v3" in str(err.value) and "affine8" in str(err.value)


def test_head_dim_without_group_size_stays_native():
    # d = 80: no MLX affine group size, so affine-key layers keep fp16 K and V.
    assert parse_scheme("turbo8v3").bytes_per_token(80) == 320
    assert parse_scheme("turbo0v4").bytes_per_token(80) == 160 + 4 * 10 + 4


def test_ratios_are_against_fp16_whatever_the_dtype():
    spec = parse_scheme("raw")
    assert spec.compression(128, dtype_bytes=4) == pytest.approx(0.5)
