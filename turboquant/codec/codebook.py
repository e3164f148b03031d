"""Exact Lloyd-Max codebooks for the coordinates of a uniformly random unit vector.

After a random rotation every coordinate of a unit vector in R^d follows
f(x) = C (1 - x^2)^((d-3)/2) on [-1, 1] (x = 2B - 1, B ~ Beta((d-1)/2, (d-1)/2)).
Every cell moment of f has a closed form, so the continuous Lloyd-Max iteration
runs without a grid; reference implementations that k-means a float32 grid are
off by up to 1.6e-3 at 4 bits (docs/turboquant.md, "Codebooks").

The iteration takes up to a second per codebook at 5 bits (and scipy a quarter of a second to
import), which every process paid for every head dim it met. The common head dims' codebooks
ship precomputed in `codebook_table.py` (written by `python tools/codebook_table.py`;
tests/test_codebook.py checks every entry bit for bit against `compute_codebook`), so a process
computes only the others, and imports scipy only then.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

MIN_DIM = 16
MAX_BITS = 5  # 5-bit keys are the default scheme's (docs/quality.md)
MAX_ITERATIONS = 10_000
TOLERANCE = 1e-15


@dataclass(frozen=True)
class Codebook:
    """Centroids and decision boundaries of one (d, bits) quantizer, float64, ascending."""

    d: int
    bits: int
    centroids: np.ndarray
    boundaries: np.ndarray
    cell_probabilities: np.ndarray
    d_mse: float

    @property
    def levels(self) -> int:
        return 1 << self.bits


def _beta_parameters(d: int) -> tuple[float, float, float]:
    """Shape a of the Beta law, exponent k of f and its normalising constant C."""
    from scipy import special

    a = (d - 1) / 2.0
    k = (d - 3) / 2.0
    log_c = special.gammaln(d / 2) - 0.5 * math.log(math.pi) - special.gammaln((d - 1) / 2)
    return a, k, math.exp(log_c)


def _cells(d: int, centroids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Boundaries (with the -1, +1 ends), cell probabilities P_i and first moments M_i."""
    from scipy import special

    a, k, c_norm = _beta_parameters(d)
    t = np.concatenate([[-1.0], (centroids[:-1] + centroids[1:]) / 2, [1.0]])
    cdf = special.betainc(a, a, (t + 1) / 2)
    p = cdf[1:] - cdf[:-1]
    one_minus = 1 - t**2
    m = c_norm * (one_minus[:-1] ** (k + 1) - one_minus[1:] ** (k + 1)) / (2 * (k + 1))
    return t, p, m


def lloyd_max_codebook(d: int, bits: int) -> Codebook:
    """Exact Lloyd-Max codebook for head dim `d` (>= 16) at `bits` bits (1..MAX_BITS).

    Iterates c_i <- M_i / P_i from the quantile start until max|dc| < 1e-15.
    """
    if isinstance(d, bool) or not isinstance(d, int) or d < MIN_DIM:
        raise ValueError(f"lloyd_max_codebook needs an integer d >= {MIN_DIM}, got {d!r}")
    if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= MAX_BITS:
        raise ValueError(f"lloyd_max_codebook supports bits 1..{MAX_BITS}, got {bits!r}")
    return _codebook(d, bits)


@functools.lru_cache(maxsize=None)
def _codebook(d: int, bits: int) -> Codebook:
    from turboquant.codec.codebook_table import TABLE

    shipped = TABLE.get((d, bits))
    if shipped is None:
        return compute_codebook(d, bits)
    centroids, boundaries, probabilities, d_mse = (np.array(v, dtype=np.float64) for v in shipped)
    return _frozen(d, bits, centroids, boundaries, probabilities, float(d_mse))


def compute_codebook(d: int, bits: int) -> Codebook:
    """The Lloyd-Max iteration itself (scipy), whatever the table holds: what
    `tools/codebook_table.py` writes and what the tests check the table against."""
    from scipy import special

    a, _, _ = _beta_parameters(d)
    levels = 1 << bits
    c = 2 * special.betaincinv(a, a, (np.arange(levels) + 0.5) / levels) - 1
    for _ in range(MAX_ITERATIONS):
        _, p, m = _cells(d, c)
        new = m / p
        converged = np.max(np.abs(new - c)) < TOLERANCE
        c = new
        if converged:
            break
    t, p, _ = _cells(d, c)
    boundaries = t[1:-1].copy()
    # The middle boundary is 0 by symmetry; drop rounding noise so ties behave the same everywhere.
    boundaries[np.abs(boundaries) < 1e-12] = 0.0
    d_mse = float(d * (1.0 / d - np.sum(p * c**2)))
    return _frozen(d, bits, c, boundaries, p, d_mse)


def _frozen(d: int, bits: int, centroids: np.ndarray, boundaries: np.ndarray, probabilities: np.ndarray,
            d_mse: float) -> Codebook:
    for arr in (centroids, boundaries, probabilities):
        arr.setflags(write=False)
    return Codebook(d=d, bits=bits, centroids=centroids, boundaries=boundaries, cell_probabilities=probabilities,
                    d_mse=d_mse)
