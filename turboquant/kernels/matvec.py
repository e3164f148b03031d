"""A [D] x [D, D] product inside one threadgroup, written for memory-level parallelism.

Passes 0 and 2 apply a dense float32 rotation to one row per threadgroup. A loop in which each
thread walks a whole column keeps only a few loads of the matrix in flight and pays a memory
round trip per few elements; here every thread owns four adjacent columns over a slice of the
rows, so all its loads are independent 16-byte loads issued up front (one round trip), and the
slices are summed in threadgroup memory in a fixed order (repeated runs are bit-identical)."""

from __future__ import annotations

from .dialects import fill

_MATVEC = """constexpr int MV_C = D / 4;
constexpr int MV_S = NT / MV_C;
constexpr int MV_K = (D + MV_S - 1) / MV_S;
TGMEM float mv_part[MV_S * D];
{
  const int mv_c = tid % MV_C;
  const int mv_s = tid / MV_C;
  if (mv_s < MV_S) {
    float a0 = 0.0f, a1 = 0.0f, a2 = 0.0f, a3 = 0.0f;
#pragma unroll
    for (int i = 0; i < MV_K; ++i) {
      const int k = mv_s * MV_K + i;
      if (k < D) {
        const F4 w = *(const DEV F4*)(@@M@@ + k * D + 4 * mv_c);
        const float xk = @@X@@[k];
        a0 += xk * w.x;
        a1 += xk * w.y;
        a2 += xk * w.z;
        a3 += xk * w.w;
      }
    }
    mv_part[mv_s * D + 4 * mv_c] = a0;
    mv_part[mv_s * D + 4 * mv_c + 1] = a1;
    mv_part[mv_s * D + 4 * mv_c + 2] = a2;
    mv_part[mv_s * D + 4 * mv_c + 3] = a3;
  }
}
SYNC();
for (int e = tid; e < D; e += NT) {
  float y = 0.0f;
#pragma unroll
  for (int s = 0; s < MV_S; ++s) {
    y += mv_part[s * D + e];
  }
  @@Y@@ = y@@POST@@;
}"""


def matvec(x: str, m: str, y: str, post: str = "") -> str:
    """Kernel text that sets `y` (an lvalue naming the column `e`) to (x @ m)[e] followed by the
    expression tail `post`, for every e < D. `x` is a [D] float array in threadgroup memory,
    written before a barrier; `m` a dense row-major [D, D] float32 device array. Needs D % 4 == 0
    and NT >= D / 4; every thread of the threadgroup must reach it (it has a barrier). Once per
    kernel (its names are kernel-scope)."""
    return fill(_MATVEC, X=x, M=m, Y=y, POST=post)
