"""Random orthogonal rotations applied to row vectors: y = x @ M.

`mx.hadamard_transform` covers n = m * 2^k for m in {1, 12, 20, 28}. MLX 0.32.4 does not
validate other sizes on the CPU (n=36 returns a non-orthogonal result, n=72 aborts the
process), so the size is checked here before MLX is called.

A rotation is described by arrays that are persisted with every cache: the sign vector
(all Hadamard kinds) and, where the transform is not a Sylvester matrix built from the
signs alone, the dense matrix M. Rebuilding from those arrays never touches a random
generator.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

HADAMARD_BASES = (1, 12, 20, 28)
# 2^k limits of mx.hadamard_transform for float32 inputs (16384 for half types).
MAX_POW2_F32 = 8192
SEED_STRIDE = 7919


class RotationKind(str, enum.Enum):
    """How the rotation is applied; recorded with every persisted rotation."""

    HADAMARD = "hadamard"  # d = 2^k: Sylvester H, self-inverse, described by the signs alone
    HADAMARD_M = "hadamard_m"  # d = m * 2^k, m in {12, 20, 28}: fast forward, dense inverse
    DENSE = "dense"  # any other d: sign-fixed QR of a Gaussian matrix


def hadamard_base(d: int) -> int | None:
    """The m of d = m * 2^k that mx.hadamard_transform supports, or None."""
    for m in HADAMARD_BASES:
        if d % m == 0:
            q = d // m
            if q & (q - 1) == 0 and q <= MAX_POW2_F32:
                return m
    return None


def _signs(d: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed + SEED_STRIDE * d)
    return rng.choice(np.array([-1.0, 1.0], dtype=np.float32), size=d)


def _dense_matrix(d: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed + SEED_STRIDE * d)
    q, r = np.linalg.qr(rng.standard_normal((d, d)))
    # Fix the sign ambiguity of QR so the matrix is a deterministic function of the seed.
    q = q * np.sign(np.diag(r))[None, :]
    return q.astype(np.float32)


@dataclass(frozen=True)
class Rotation:
    """An orthogonal map on row vectors, y = x @ matrix, and its inverse x = y @ matrix.T."""

    kind: RotationKind
    d: int
    signs: mx.array | None
    matrix: mx.array | None

    @classmethod
    def create(cls, d: int, seed: int) -> "Rotation":
        """The rotation for head dim `d` and `seed` (randomized Hadamard where MLX has one)."""
        m = hadamard_base(d)
        if m is None:
            return cls(RotationKind.DENSE, d, None, mx.array(_dense_matrix(d, seed)))
        signs = mx.array(_signs(d, seed))
        if m == 1:
            return cls(RotationKind.HADAMARD, d, signs, None)
        return cls(RotationKind.HADAMARD_M, d, signs, _hadamard_matrix(signs))

    @classmethod
    def from_arrays(cls, kind: str, signs: mx.array | None, matrix: mx.array | None) -> "Rotation":
        """Rebuild a persisted rotation from its arrays (no random generator involved)."""
        kind = RotationKind(kind)
        if kind is RotationKind.HADAMARD:
            if signs is None or signs.ndim != 1:
                raise ValueError("a hadamard rotation needs a 1-D sign vector")
            if hadamard_base(signs.shape[0]) != 1:
                raise ValueError(f"a hadamard rotation needs d = 2^k, got {signs.shape[0]}")
            return cls(kind, signs.shape[0], signs.astype(mx.float32), None)
        if matrix is None or matrix.ndim != 2 or matrix.shape[0] != matrix.shape[1]:
            raise ValueError(f"a {kind.value} rotation needs a square matrix")
        d = matrix.shape[0]
        matrix = matrix.astype(mx.float32)
        if kind is RotationKind.HADAMARD_M:
            if signs is None or signs.shape != (d,):
                raise ValueError("a hadamard_m rotation needs its sign vector")
            # The m = 12/20/28 blocks are MLX internals: use the fast transform only when this
            # MLX reproduces the persisted matrix exactly, otherwise apply the matrix itself.
            if hadamard_base(d) is None or not mx.array_equal(_hadamard_matrix(signs), matrix).item():
                return cls(RotationKind.DENSE, d, None, matrix)
            return cls(kind, d, signs.astype(mx.float32), matrix)
        return cls(kind, d, None, matrix)

    def arrays(self) -> dict[str, mx.array]:
        """The arrays that describe this rotation (what a snapshot persists)."""
        out = {}
        if self.signs is not None:
            out["signs"] = self.signs
        if self.matrix is not None:
            out["matrix"] = self.matrix
        return out

    def forward(self, x: mx.array) -> mx.array:
        """Rotate rows: x [..., d] -> x @ M, in float32."""
        x = x.astype(mx.float32)
        if self.kind is RotationKind.DENSE:
            return x @ self.matrix
        return mx.hadamard_transform(x * self.signs)

    def inverse(self, y: mx.array) -> mx.array:
        """Undo `forward`: y [..., d] -> y @ M.T, in float32."""
        y = y.astype(mx.float32)
        if self.kind is RotationKind.HADAMARD:
            return mx.hadamard_transform(y) * self.signs
        return y @ self.matrix.T


def _hadamard_matrix(signs: mx.array) -> mx.array:
    return mx.hadamard_transform(mx.diag(signs.astype(mx.float32)))


def orthogonality_error(rotation: Rotation) -> float:
    """max |M M^T - I| of the rotation's matrix (as applied), for tests and selftest."""
    eye = mx.eye(rotation.d, dtype=mx.float32)
    m = rotation.forward(eye)
    return float(mx.max(mx.abs(m @ m.T - eye)).item())
