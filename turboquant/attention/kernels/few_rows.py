"""x W^T for the few rows of a decode batch, in one CUDA launch that reads each weight row once.

MLX 0.32.4 on CUDA multiplies one row by a weight matrix with its own matrix-vector kernel and
two or more rows with cuBLAS, which at the 8B model's shapes and 2-16 rows runs 1.1-3.3x slower
than one row: on the H200 (bench/batch_rows.py, bfloat16, us per call) 4096 x 4096 takes 14 for
one row and 29-31 for 2-16, 14336 x 4096 25 against 56-59. A decode step of 2-8 rows therefore
cost 2.2 ms of device time where one row cost 0.8, and the server's batched steps waited on it.
Here each warp takes RW weight rows and every lane reads 16 bytes of each per step, as a
matrix-vector kernel does, and multiplies them by the same entries of every row of x (which the
threadgroup's warps read again from cache): the weights cross memory once for all rows.

`kernels.rows_matmul(x, weight)` launches it: x [..., K] with at most MMAX rows in all, weight
[N, K], both bfloat16 or both float16, K a multiple of 8; sums in float32, the output in x's
dtype. Rows are summed in the same order whatever their number, so a row's result does not
depend on the others in the launch.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from turboquant.attention.kernels.dialects import HEADERS, SHORT, fill, section

MMAX = 8  # rows per launch; more go to MLX's matmul (cuBLAS, which then pays off)
WIDE = {"bfloat16": "tq_wide_bf16", "float16": "tq_wide_f16"}
DTYPE_NAMES = {mx.float16: "float16", mx.bfloat16: "bfloat16"}


@dataclass(frozen=True)
class RowsMatmul:
    """The kernel for one dtype (rows, output and inner sizes are read at launch)."""

    dtype: str
    RW: int = 2
    NW: int = 4

    @property
    def name(self) -> str:
        return f"tq_rows_matmul_m{MMAX}_r{self.RW}_w{self.NW}_{SHORT[self.dtype]}"

    def input_names(self) -> list[str]:
        return ["x", "w", "dims"]

    def output_names(self) -> list[str]:
        return ["y"]

    def input_types(self) -> dict[str, str]:
        return {"x": self.dtype, "w": self.dtype, "dims": "int32"}

    def header(self, dialect: str) -> str:
        if dialect != "cuda":
            raise ValueError("rows_matmul is CUDA only (MLX's Metal matmul at a few rows was not measured)")
        return HEADERS[dialect] + section("few_rows.h", "helpers_cuda")

    def render(self, prologue: str) -> str:
        """The kernel body after the dialect's thread-index prologue."""
        return prologue + "\n" + fill(section("few_rows.h", "body"), MMAX=MMAX, RW=self.RW, NW=self.NW,
                                      WIDE=WIDE[self.dtype], OUT=self.dtype)

    @property
    def threads(self) -> int:
        return 32 * self.NW

    def rows_per_threadgroup(self) -> int:
        return self.RW * self.NW


def variant(x: mx.array, weight: mx.array) -> RowsMatmul | None:
    """The kernel for these operands, or None where it does not apply: more than MMAX rows,
    another dtype, mismatched inner sizes or one that is not a multiple of 8."""
    dtype = DTYPE_NAMES.get(x.dtype)
    if dtype is None or weight.dtype != x.dtype or weight.ndim != 2 or x.ndim < 1:
        return None
    K = x.shape[-1]
    if weight.shape[1] != K or K % 8 or K == 0 or x.size // K > MMAX or x.size == 0:
        return None
    return RowsMatmul(dtype)
