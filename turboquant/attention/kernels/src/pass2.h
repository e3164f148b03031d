//! Pass 2 of the fused decode, the merge (one threadgroup per query row); turboquant.kernels.merge
//! explains it and picks the sections: the body, its finish (plain, or the raw tail's attention),
//! and the attention sink's normaliser.
//@@ pass2

constexpr int D = @@D@@;
constexpr int NT = @@NT@@;
constexpr int NW = NT / 32;
constexpr int PC = D / 4;
constexpr int PS = NT / PC;
constexpr int NBMAX = @@NBMAX@@;
@@PROLOGUE@@
const int row = blk;
const int nblk = params[2];
const int lane = tid % 32;
const int warp = tid / 32;
TGMEM float s_f[NBMAX];
TGMEM float s_w[NW];
TGMEM float s_w2[NW];
TGMEM float s_part[PS * D];
TGMEM float s_y[D];
@@ROT_SHARED@@
float mloc = NEG_INF;
for (int i = tid; i < nblk; i += NT) {
  mloc = FMAX(mloc, pm[row * nblk + i]);
}
#pragma unroll
for (int off = 16; off >= 1; off /= 2) {
  mloc = FMAX(mloc, SHFL_XOR(mloc, off));
}
if (lane == 0) {
  s_w[warp] = mloc;
}
SYNC();
float M = NEG_INF;
for (int i = 0; i < NW; ++i) {
  M = FMAX(M, s_w[i]);
}
float lloc = 0.0f;
for (int i = tid; i < nblk; i += NT) {
  const float mi = pm[row * nblk + i];
  const float f = (mi == NEG_INF) ? 0.0f : EXP2(mi - M);
  s_f[i] = f;
  lloc += pl[row * nblk + i] * f;
}
#pragma unroll
for (int off = 16; off >= 1; off /= 2) {
  lloc += SHFL_XOR(lloc, off);
}
if (lane == 0) {
  s_w2[warp] = lloc;
}
SYNC();
float L = 0.0f;
for (int i = 0; i < NW; ++i) {
  L += s_w2[i];
}
@@NORMALISE@@
// Each thread owns four adjacent dims over a slice of the blocks (16-byte loads, four
// independent sums); the slices are added in a fixed order.
{
  const int pc = tid % PC;
  const int ps = tid / PC;
  if (ps < PS) {
    F4 a[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      a[k].x = 0.0f;
      a[k].y = 0.0f;
      a[k].z = 0.0f;
      a[k].w = 0.0f;
    }
    const DEV float* base = po + (int64_t)row * nblk * D + 4 * pc;
    int i = ps;
    for (; i + 3 * PS < nblk; i += 4 * PS) {
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const F4 x = *(const DEV F4*)(base + (int64_t)(i + k * PS) * D);
        const float f = s_f[i + k * PS];
        a[k].x += x.x * f;
        a[k].y += x.y * f;
        a[k].z += x.z * f;
        a[k].w += x.w * f;
      }
    }
    for (; i < nblk; i += PS) {
      const F4 x = *(const DEV F4*)(base + (int64_t)i * D);
      const float f = s_f[i];
      a[0].x += x.x * f;
      a[0].y += x.y * f;
      a[0].z += x.z * f;
      a[0].w += x.w * f;
    }
    s_part[ps * D + 4 * pc] = (a[0].x + a[1].x) + (a[2].x + a[3].x);
    s_part[ps * D + 4 * pc + 1] = (a[0].y + a[1].y) + (a[2].y + a[3].y);
    s_part[ps * D + 4 * pc + 2] = (a[0].z + a[1].z) + (a[2].z + a[3].z);
    s_part[ps * D + 4 * pc + 3] = (a[0].w + a[1].w) + (a[2].w + a[3].w);
  }
}
SYNC();
for (int d = tid; d < D; d += NT) {
  float acc = 0.0f;
#pragma unroll
  for (int k = 0; k < PS; ++k) {
    acc += s_part[k * D + d];
  }
@@STORE@@
}
@@ROTATE@@
@@FINISH@@

//@@ finish
SYNC();
for (int e = tid; e < D; e += NT) {
  out[row * D + e] = @@OUT@@(s_y[e]);
}
if (tid == 0) {
  lse[row] = (M + LOG2(L)) * TQ_LN2;
}
//! The raw tail (n <= 256 native rows of this row's KV head) joins the stored rows' softmax: one
//! score per thread, block max and sum, then every output element mixes the n value rows. A
//! question's L tokens run as L query rows each (params[8] = L > 1): row l of a query head sees
//! the tail's first n - L + 1 + l rows (the causal mask; every stored row precedes them). Both
//! loops are latency chains when they run alone (a decode step waits for them), so every load of
//! a score is independent (the head dim unrolled into eight sums; 16-byte loads where the rows are
//! contiguous and aligned) and the value rows are split over VS slices of threads (two dims per
//! thread, sixteen rows in flight, then eight), merged in a fixed order: each sum takes the same
//! terms in the same order on every path.
//@@ tail
{
  const int n = params[8] > 1 ? params[7] - params[8] + 1 + row % params[8] : params[7];
  const int R = params[3];
  const int H = params[4];
  const int bh = row / R;
  const int b = bh / H;
  const int h = bh - b * H;
  constexpr int VP = @@VP@@;
  constexpr int VS = NT / VP;
  TGMEM float s_q[D];
  TGMEM float s_e[NT];
  TGMEM float s_r[NW];
  TGMEM float s_r2[NW];
  TGMEM float s_v[VS * 2 * VP];
  const int64_t qb = (int64_t)b * tq_strides[0] + (int64_t)(row - b * H * R) * tq_strides[1];
  for (int i = tid; i < D; i += NT) {
    s_q[i] = static_cast<float>(tq[qb + (int64_t)i * tq_strides[3]]) * cq[0];
  }
  SYNC();
  const int64_t kb = (int64_t)b * t_k_strides[0] + (int64_t)h * t_k_strides[1];
  const int64_t vb = (int64_t)b * t_v_strides[0] + (int64_t)h * t_v_strides[1];
  float st = NEG_INF;
  if (tid < n) {
    const int64_t kr = kb + (int64_t)tid * t_k_strides[2];
    float a[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
    if (@@KVEC@@) {
      const DEV U4* p = (const DEV U4*)(t_k + kr);
#pragma unroll
      for (int c = 0; c < @@KWORDS@@; ++c) {
        const U4 w = p[c];
        float x[@@KPER@@];
@@KCONV@@
#pragma unroll
        for (int i = 0; i < @@KPER@@; ++i) {
          a[(c * @@KPER@@ + i) % 8] += s_q[c * @@KPER@@ + i] * x[i];
        }
      }
    } else {
#pragma unroll
      for (int i = 0; i < D; ++i) {
        a[i % 8] += s_q[i] * static_cast<float>(t_k[kr + (int64_t)i * t_k_strides[3]]);
      }
    }
    st = ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
  }
  float mt = st;
#pragma unroll
  for (int off = 16; off >= 1; off /= 2) {
    mt = FMAX(mt, SHFL_XOR(mt, off));
  }
  if (lane == 0) {
    s_r[warp] = mt;
  }
  SYNC();
  float M2 = M;
  for (int i = 0; i < NW; ++i) {
    M2 = FMAX(M2, s_r[i]);
  }
  const float fs = EXP2(M - M2) * L;
  const float et = (tid < n) ? EXP2(st - M2) : 0.0f;
  s_e[tid] = et;
  float se = et;
#pragma unroll
  for (int off = 16; off >= 1; off /= 2) {
    se += SHFL_XOR(se, off);
  }
  if (lane == 0) {
    s_r2[warp] = se;
  }
  SYNC();
  float den = fs;
  for (int i = 0; i < NW; ++i) {
    den += s_r2[i];
  }
  {
    const int e2 = tid % VP;
    const int js = tid / VP;
    float a[8][2];
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      a[k][0] = 0.0f;
      a[k][1] = 0.0f;
    }
    if (2 * e2 < D) {
      const int64_t vc = vb + (int64_t)(2 * e2) * t_v_strides[3];
      int t = js;
      for (; t + 15 * VS < n; t += 16 * VS) {
        float x0[16];
        float x1[16];
#pragma unroll
        for (int k = 0; k < 16; ++k) {
          const int64_t at = vc + (int64_t)(t + k * VS) * t_v_strides[2];
          x0[k] = static_cast<float>(t_v[at]);
          x1[k] = static_cast<float>(t_v[at + t_v_strides[3]]);
        }
#pragma unroll
        for (int k = 0; k < 16; ++k) {
          a[k % 8][0] += s_e[t + k * VS] * x0[k];
          a[k % 8][1] += s_e[t + k * VS] * x1[k];
        }
      }
      for (; t + 7 * VS < n; t += 8 * VS) {
#pragma unroll
        for (int k = 0; k < 8; ++k) {
          const int64_t at = vc + (int64_t)(t + k * VS) * t_v_strides[2];
          a[k][0] += s_e[t + k * VS] * static_cast<float>(t_v[at]);
          a[k][1] += s_e[t + k * VS] * static_cast<float>(t_v[at + t_v_strides[3]]);
        }
      }
      for (; t < n; t += VS) {
        const int64_t at = vc + (int64_t)t * t_v_strides[2];
        a[0][0] += s_e[t] * static_cast<float>(t_v[at]);
        a[0][1] += s_e[t] * static_cast<float>(t_v[at + t_v_strides[3]]);
      }
    }
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      s_v[(js * VP + e2) * 2 + c] = ((a[0][c] + a[1][c]) + (a[2][c] + a[3][c])) +
                                    ((a[4][c] + a[5][c]) + (a[6][c] + a[7][c]));
    }
  }
  SYNC();
  for (int e = tid; e < D; e += NT) {
    float acc = fs * s_y[e];
    for (int j = 0; j < VS; ++j) {
      acc += s_v[(j * VP + e / 2) * 2 + e % 2];
    }
    out[row * D + e] = @@OUT@@(acc / den);
  }
  if (tid == 0) {
    lse[row] = (M2 + LOG2(den)) * TQ_LN2;
  }
}
//! The sink of this row's query head (row = b * Hq + h) as one more block: the running max
//! includes it (a large sink cannot overflow the sums), the stored sums are rescaled to that max.
//@@ sink
float inv;
{
  const float sk = sinks[row % (params[3] * params[4])] * 1.4426950408889634f;
  const float Ms = FMAX(M, sk);
  const float fm = EXP2(M - Ms);
  L = L * fm + EXP2(sk - Ms);
  M = Ms;
  inv = fm / L;
}
