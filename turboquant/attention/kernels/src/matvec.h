//! A [D] x [D, D] product inside one threadgroup (turboquant.kernels.matvec explains the layout).
//! Markers: @@X@@ the [D] input in threadgroup memory, @@M@@ the row-major matrix, @@Y@@ the
//! lvalue of column e, @@POST@@ an expression tail.
//@@ matvec
constexpr int MV_C = D / 4;
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
}
