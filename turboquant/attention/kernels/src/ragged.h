//! One query token per row attending over that row's first lens[b] keys of native K/V buffers
//! (turboquant/attention/kernels/ragged.py): the masked one-token SDPA of a decode batch whose
//! rows differ in length, in one launch. One threadgroup per (row, KV head); its NW warps take
//! keys t = warp, warp + NW, ... with an online softmax per query head of the group, the lanes
//! holding channels lane, lane + 32, ...; the warps' partial sums merge in threadgroup memory.
//! Filled in: D (head dim), H (KV heads), R (query heads per KV head), NW (warps), DL (channels per lane),
//! OUT (the output's dtype name), SCALE (the softmax scale times log2(e), a float literal).
//@@ body
  constexpr int D = @@D@@;
  constexpr int R = @@R@@;
  constexpr int NW = @@NW@@;
  constexpr int DL = @@DL@@;
  constexpr int NT = 32 * NW;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  constexpr int H = @@H@@;
  const int b = blk / H;
  const int h = blk - b * H;
  const int n = lens[b];
  float qv[R][DL];
  float acc[R][DL];
  float m[R];
  float l[R];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int64_t qb = (int64_t)b * q_strides[0] + (int64_t)(h * R + r) * q_strides[1];
#pragma unroll
    for (int j = 0; j < DL; ++j) {
      const int d = lane + 32 * j;
      qv[r][j] = d < D ? static_cast<float>(q[qb + (int64_t)d * q_strides[3]]) * @@SCALE@@ : 0.0f;
      acc[r][j] = 0.0f;
    }
    m[r] = NEG_INF;
    l[r] = 0.0f;
  }
  const int64_t kb = (int64_t)b * k_strides[0] + (int64_t)h * k_strides[1];
  const int64_t vb = (int64_t)b * v_strides[0] + (int64_t)h * v_strides[1];
  for (int t = warp; t < n; t += NW) {
    float kv[DL];
    float vv[DL];
#pragma unroll
    for (int j = 0; j < DL; ++j) {
      const int d = lane + 32 * j;
      kv[j] = d < D ? static_cast<float>(k[kb + (int64_t)t * k_strides[2] + (int64_t)d * k_strides[3]]) : 0.0f;
      vv[j] = d < D ? static_cast<float>(v[vb + (int64_t)t * v_strides[2] + (int64_t)d * v_strides[3]]) : 0.0f;
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {
      float s = 0.0f;
#pragma unroll
      for (int j = 0; j < DL; ++j) {
        s += qv[r][j] * kv[j];
      }
#pragma unroll
      for (int off = 16; off >= 1; off /= 2) {
        s += SHFL_XOR(s, off);
      }
      const float mn = FMAX(m[r], s);
      const float c = EXP2(m[r] - mn);
      const float p = EXP2(s - mn);
      l[r] = l[r] * c + p;
#pragma unroll
      for (int j = 0; j < DL; ++j) {
        acc[r][j] = acc[r][j] * c + p * vv[j];
      }
      m[r] = mn;
    }
  }
  TGMEM float s_m[NW * R];
  TGMEM float s_l[NW * R];
  TGMEM float s_o[NW * R * D];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    if (lane == 0) {
      s_m[warp * R + r] = m[r];
      s_l[warp * R + r] = l[r];
    }
#pragma unroll
    for (int j = 0; j < DL; ++j) {
      const int d = lane + 32 * j;
      if (d < D) {
        s_o[(warp * R + r) * D + d] = acc[r][j];
      }
    }
  }
  SYNC();
  for (int i = tid; i < R * D; i += NT) {
    const int r = i / D;
    const int d = i - r * D;
    float M = NEG_INF;
    for (int w = 0; w < NW; ++w) {
      M = FMAX(M, s_m[w * R + r]);
    }
    float L = 0.0f;
    float O = 0.0f;
    for (int w = 0; w < NW; ++w) {
      const float e = s_l[w * R + r] > 0.0f ? EXP2(s_m[w * R + r] - M) : 0.0f;
      L += s_l[w * R + r] * e;
      O += s_o[(w * R + r) * D + d] * e;
    }
    out[((int64_t)b * H * R + h * R + r) * D + d] = TQ_OUT_@@OUT@@(O / L);
  }
