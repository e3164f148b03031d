import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from turboquant import lloyd_max_codebook
from turboquant.codec.codebook import MAX_BITS, compute_codebook
from turboquant.codec.codebook_table import TABLE

GOLDEN = json.loads((Path(__file__).parent / "golden" / "codebooks.json").read_text())

# docs/turboquant.md (the `python -m turboquant` tables), d = 128: positive halves, positive boundaries, D_mse.
D128 = {
    1: ([0.07066157], [], 0.3609),
    2: ([0.03999160, 0.13304152], [0.08651656], 0.1160),
    3: ([0.02160431, 0.06658561, 0.11813977, 0.18839719], [0.04409496, 0.09236269, 0.15326848], 0.03397),
    4: (
        [0.01130250, 0.03415157, 0.05777230, 0.08282846, 0.11028837, 0.14180520, 0.18083596, 0.23766383],
        [0.02272703, 0.04596193, 0.07030038, 0.09655841, 0.12604678, 0.16132058, 0.20924990],
        0.009315,
    ),
}

# docs/turboquant.md (the `python -m turboquant` tables), other head dims, positive halves.
OTHER_DIMS = {
    64: {2: [.05651487, .18749685], 3: [.03046918, .09383226, .16616786, .26391393],
         4: [.01591902, .04808978, .08131177, .11648675, .15492553, .19885614, .25291373, .33079631]},
    80: {2: [.05056349, .16793555], 3: [.02728252, .08404558, .14894882, .23694914],
         4: [.01426169, .04308710, .07286699, .10442106, .13894249, .17846298, .22721799, .29775697]},
    96: {2: [.04616703, .15344551], 3: [.02492369, .07679550, .13616858, .21685293],
         4: [.01303326, .03937822, .06660322, .09546459, .12706434, .16328110, .20803663, .27297115]},
    256: {2: [.02828860, .09423778], 3: [.01529749, .04716671, .08376546, .13385429],
          4: [.00800837, .02420088, .04094920, .05873211, .07824931, .10069801, .12858820, .16941044]},
}


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_d128_tables_match_turboquant_md(bits):
    cb = lloyd_max_codebook(128, bits)
    c_pos, t_pos, d_mse = D128[bits]
    half = cb.levels // 2
    np.testing.assert_allclose(cb.centroids[half:], c_pos, atol=1e-7, rtol=0)
    np.testing.assert_allclose(cb.centroids[:half], -np.array(c_pos[::-1]), atol=1e-7, rtol=0)
    np.testing.assert_allclose(cb.boundaries[half:], t_pos, atol=1e-7, rtol=0)
    assert cb.boundaries[half - 1] == 0.0
    digits = len(f"{d_mse}".split(".")[1])
    assert round(cb.d_mse, digits + 1) == pytest.approx(d_mse, abs=10 ** -digits)


def test_d128_cell_probabilities_at_4_bits():
    cb = lloyd_max_codebook(128, 4)
    expected = [0.0087, 0.0252, 0.0434, 0.0609, 0.0761, 0.0882, 0.0966, 0.1009]
    np.testing.assert_allclose(cb.cell_probabilities[:8], expected, atol=5e-5)
    assert cb.cell_probabilities.sum() == pytest.approx(1.0, abs=1e-12)


@pytest.mark.parametrize("d", sorted(OTHER_DIMS))
@pytest.mark.parametrize("bits", [2, 3, 4])
def test_other_head_dims_match_turboquant_md(d, bits):
    cb = lloyd_max_codebook(d, bits)
    np.testing.assert_allclose(cb.centroids[cb.levels // 2:], OTHER_DIMS[d][bits], atol=1e-7, rtol=0)


@pytest.mark.parametrize("rec", GOLDEN, ids=lambda r: f"d{r['d']}b{r['bits']}")
def test_matches_reference_script_output(rec):
    """tests/golden/codebooks.json is `lloyd_max.py --json` for d in 16..256, bits 1..4."""
    cb = lloyd_max_codebook(rec["d"], rec["bits"])
    np.testing.assert_allclose(cb.centroids, rec["centroids"], atol=1e-12, rtol=0)
    np.testing.assert_allclose(cb.boundaries, rec["boundaries"], atol=1e-12, rtol=0)
    np.testing.assert_allclose(cb.cell_probabilities, rec["cell_probs"], atol=1e-12, rtol=0)
    assert cb.d_mse == pytest.approx(rec["d_mse"], abs=1e-12)


@pytest.mark.parametrize("d", [16, 17, 64, 100, 128, 4096])
@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_structure(d, bits):
    cb = lloyd_max_codebook(d, bits)
    c, t = cb.centroids, cb.boundaries
    assert c.dtype == np.float64 and t.dtype == np.float64
    assert c.shape == (1 << bits,) and t.shape == ((1 << bits) - 1,)
    assert np.all(np.diff(c) > 0) and np.all(np.abs(c) < 1)
    np.testing.assert_allclose(t, (c[:-1] + c[1:]) / 2, atol=1e-13)  # the middle one is snapped to 0
    np.testing.assert_allclose(c, -c[::-1], atol=1e-13)
    # Lloyd-Max D_mse lies between the paper's lower bound 4^-b and its upper bound.
    assert 4.0 ** -bits < cb.d_mse < np.sqrt(3) * np.pi / 2 * 4.0 ** -bits


def test_gaussian_limit_codebooks():
    """c * sqrt(d) tends to the Gaussian Lloyd-Max codebook (sqrt(2/pi) at 1 bit)."""
    cb = lloyd_max_codebook(4096, 1)
    assert cb.centroids[1] * np.sqrt(4096) == pytest.approx(np.sqrt(2 / np.pi), rel=1e-3)


@pytest.mark.parametrize("d, bits", [(15, 2), (8, 3), (64, 0), (64, 6), (64.0, 2)])
def test_rejects_bad_arguments(d, bits):
    with pytest.raises(ValueError, match="lloyd_max_codebook"):
        lloyd_max_codebook(d, bits)


def test_arrays_are_read_only():
    cb = lloyd_max_codebook(64, 2)
    with pytest.raises(ValueError):
        cb.centroids[0] = 0.0


def _same(shipped, computed):
    """The table holds the iteration's result to within the iteration's own noise: at 5 bits it
    never reaches TOLERANCE (its steps stay at 4-13e-15, d = 128) and stops at MAX_ITERATIONS,
    wherever rounding has walked it, so machines whose libm and scipy round differently land
    apart: an AMD EPYC computes up to 1.7e-14 from the table (written on another machine) and
    D_mse 2.7e-13 relative. Hence 1e-12 and 1e-11; the table itself is what every machine uses."""
    for name in ("centroids", "boundaries", "cell_probabilities"):
        a, b = getattr(shipped, name), getattr(computed, name)
        assert a.dtype == b.dtype == np.float64 and a.shape == b.shape, name
        assert np.max(np.abs(a - b)) <= 1e-12, name
    assert shipped.d_mse == pytest.approx(computed.d_mse, rel=1e-11, abs=0)


def _shipped(d, bits):
    from turboquant.codec.codebook import _codebook

    return _codebook.__wrapped__(d, bits)


@pytest.mark.parametrize("d", sorted({d for d, _ in TABLE}))
def test_shipped_table_is_the_computation_below_5_bits(d):
    """turboquant/codec/codebook_table.py (tools/codebook_table.py) holds what the iteration
    computes (`_same`); 5 bits (about a second each) for d = 128 only here, every dim in the slow
    test."""
    for bits in (1, 2, 3, 4, *((5,) if d == 128 else ())):
        _same(_shipped(d, bits), compute_codebook(d, bits))


@pytest.mark.slow
@pytest.mark.parametrize("d, bits", sorted(TABLE))
def test_shipped_table_is_the_computation(d, bits):
    _same(_shipped(d, bits), compute_codebook(d, bits))


def test_table_covers_the_common_head_dims_and_every_bit_width():
    assert {(d, b) for d in (32, 64, 80, 96, 128, 256) for b in range(1, MAX_BITS + 1)} <= set(TABLE)


def test_shipped_codebooks_need_no_scipy():
    """A process that meets only common head dims never imports scipy (0.25-1 s of a fresh CLI
    call); another head dim still computes its codebook."""
    code = ("import sys; from turboquant.codec.codebook import lloyd_max_codebook\n"
            "for bits in range(1, 6): lloyd_max_codebook(128, bits); lloyd_max_codebook(64, bits)\n"
            "assert 'scipy' not in sys.modules, 'scipy imported'\n"
            "lloyd_max_codebook(100, 3)\n"
            "assert 'scipy' in sys.modules\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
