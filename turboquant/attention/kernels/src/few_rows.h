//! y = x W^T for a few rows of x (turboquant/attention/kernels/few_rows.py): a decode batch's
//! projections, each weight row read once for every row of x. x [M, K] and W [N, K] row-major
//! (bfloat16 or float16, K a multiple of 8), dims = {M, N, K} (M at most MMAX). Each warp takes
//! RW weight rows; a lane reads 8 consecutive weights (16 bytes) per row and step and the same 8
//! entries of every row of x, which every warp of the threadgroup reads again (from cache).
//! Filled in: MMAX, RW (weight rows per warp), NW (warps), WIDE (the dtype's 8-value convert), OUT.
//! The CUDA helpers (the emulator's are in tests/kernel_support/emulator.h):
//@@ helpers_cuda
#ifndef TQ_ROWS_MATMUL_HELPERS
#define TQ_ROWS_MATMUL_HELPERS
__device__ __forceinline__ void tq_wide_bf16(uint4 u, float* f) {  // 8 bfloat16 values, widened exactly
  const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = __uint_as_float(w[i] << 16);
    f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
  }
}
__device__ __forceinline__ void tq_wide_f16(uint4 u, float* f) {  // 8 float16 values
  tq_h2(u.x, f[0], f[1]);
  tq_h2(u.y, f[2], f[3]);
  tq_h2(u.z, f[4], f[5]);
  tq_h2(u.w, f[6], f[7]);
}
#endif
//@@ body
  constexpr int MMAX = @@MMAX@@;
  constexpr int RW = @@RW@@;
  constexpr int NW = @@NW@@;
  const int M = dims[0];
  const int N = dims[1];
  const int K = dims[2];
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int n0 = (blk * NW + warp) * RW;
  float acc[RW][MMAX];
#pragma unroll
  for (int r = 0; r < RW; ++r) {
#pragma unroll
    for (int m = 0; m < MMAX; ++m) {
      acc[r][m] = 0.0f;
    }
  }
  for (int k = 8 * lane; k < K; k += 256) {
    float wf[RW][8];
#pragma unroll
    for (int r = 0; r < RW; ++r) {
      const int n = IMIN(n0 + r, N - 1);
      const U4 u = *(const DEV U4*)(w + (int64_t)n * K + k);
      @@WIDE@@(u, wf[r]);
    }
#pragma unroll
    for (int m = 0; m < MMAX; ++m) {
      if (m < M) {
        float xf[8];
        const U4 u = *(const DEV U4*)(x + (int64_t)m * K + k);
        @@WIDE@@(u, xf);
#pragma unroll
        for (int r = 0; r < RW; ++r) {
#pragma unroll
          for (int e = 0; e < 8; ++e) {
            acc[r][m] += wf[r][e] * xf[e];
          }
        }
      }
    }
  }
#pragma unroll
  for (int r = 0; r < RW; ++r) {
#pragma unroll
    for (int m = 0; m < MMAX; ++m) {
      float s = acc[r][m];
#pragma unroll
      for (int off = 16; off >= 1; off /= 2) {
        s += SHFL_XOR(s, off);
      }
      if (lane == 0 && m < M && n0 + r < N) {
        y[(int64_t)m * N + n0 + r] = TQ_OUT_@@OUT@@(s);
      }
    }
  }
