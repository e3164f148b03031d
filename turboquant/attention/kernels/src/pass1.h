//! Pass 1 of the fused decode on the CUDA cores (CUDA and Metal): one threadgroup per (KV head,
//! row group, block of tokens); turboquant.kernels.template explains the structure and fills the
//! @@NAME@@ markers (constants, and the key/value side parts of pass1_sides.h).
//! Which (batch, KV head, row group) and which tokens a pass-1 threadgroup serves (both pass 1s).
//@@ block
const int T = params[0];
const int span = params[1];
const int nblk = params[2];
const int R = params[3];
const int H = params[4];
const int NG = params[5];
const int bh = gy / NG;
const int rg = gy - bh * NG;
const int b = bh / H;
const int h = bh - b * H;
const int r0 = rg * RMAX;
const int nrows = IMIN(RMAX, R - r0);
const int qrow0 = bh * R + r0;
const int t_begin = blk * span;
const int t_end = IMIN(t_begin + span, T);
//@@ pass1

constexpr int D = @@D@@;
constexpr int RMAX = @@RMAX@@;
constexpr int NS = @@NS@@;
constexpr int G = @@G@@;
constexpr int NSUB = D / 8;
constexpr int E = NS * 8;
constexpr int NT = @@NT@@;
constexpr int NGRP = NT / G;
constexpr int U = @@U@@;
constexpr int STEP = NGRP * U;
constexpr int MAXSB = @@MAXSB@@;
@@PROLOGUE@@
@@BLOCK@@
const int gl = tid % G;
const int tg = tid / G;
const int lane = tid % 32;
const int warp = tid / 32;
const int sb0 = t_begin >> 8;
@@SHARED@@
@@SETUP_SHARED@@
SYNC();

float q[RMAX][E];
#pragma unroll
for (int r = 0; r < RMAX; ++r) {
#pragma unroll
  for (int k = 0; k < NS; ++k) {
    const int sc = gl + k * G;
    const bool in = sc < NSUB;
    const F4 lo = s_q4[r * (D / 4) + 2 * (in ? sc : 0)];
    const F4 hi = s_q4[r * (D / 4) + 2 * (in ? sc : 0) + 1];
    q[r][k * 8] = in ? lo.x : 0.0f;
    q[r][k * 8 + 1] = in ? lo.y : 0.0f;
    q[r][k * 8 + 2] = in ? lo.z : 0.0f;
    q[r][k * 8 + 3] = in ? lo.w : 0.0f;
    q[r][k * 8 + 4] = in ? hi.x : 0.0f;
    q[r][k * 8 + 5] = in ? hi.y : 0.0f;
    q[r][k * 8 + 6] = in ? hi.z : 0.0f;
    q[r][k * 8 + 7] = in ? hi.w : 0.0f;
  }
}
@@KEY_SETUP@@
@@VALUE_SETUP@@
float m[RMAX];
float l[RMAX];
float o[RMAX][E];
#pragma unroll
for (int r = 0; r < RMAX; ++r) {
  m[r] = NEG_INF;
  l[r] = 0.0f;
#pragma unroll
  for (int e = 0; e < E; ++e) {
    o[r][e] = 0.0f;
  }
}
@@VALUE_STATE@@

int tt[U];
bool ok[U];
#pragma unroll
for (int u = 0; u < U; ++u) {
  const int t = t_begin + tg + u * NGRP;
  ok[u] = t < t_end;
  tt[u] = ok[u] ? t : t_begin;
}
@@KEY_DECL@@
@@VALUE_DECL@@
@@KEY_FILL@@
@@VALUE_FILL@@
for (int base = t_begin; base < t_end; base += STEP) {
  // Prefetch the next chunk's rows while this one is scored and mixed (clamped past the end).
  int ntt[U];
  bool nok[U];
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int t = base + STEP + tg + u * NGRP;
    nok[u] = t < t_end;
    ntt[u] = nok[u] ? t : t_begin;
  }
@@KEY_NDECL@@
@@VALUE_NDECL@@
@@KEY_NFILL@@
@@VALUE_NFILL@@
  float s[U][RMAX];
#pragma unroll
  for (int u = 0; u < U; ++u) {
@@KEY_SCORE@@
  }
#pragma unroll
  for (int off = G / 2; off >= 1; off /= 2) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
#pragma unroll
      for (int r = 0; r < RMAX; ++r) {
        s[u][r] += SHFL_XOR(s[u][r], off);
      }
    }
  }
#pragma unroll
  for (int u = 0; u < U; ++u) {
#pragma unroll
    for (int r = 0; r < RMAX; ++r) {
      float x = s[u][r];
@@KEY_FINISH@@
      s[u][r] = ok[u] ? x : NEG_INF;
    }
  }
#pragma unroll
  for (int r = 0; r < RMAX; ++r) {
    float mx = s[0][r];
#pragma unroll
    for (int u = 1; u < U; ++u) {
      mx = FMAX(mx, s[u][r]);
    }
    if (mx > m[r]) {
      const float a = EXP2(m[r] - mx);
      l[r] *= a;
#pragma unroll
      for (int e = 0; e < E; ++e) {
        o[r][e] *= a;
      }
@@VALUE_RESCALE@@
      m[r] = mx;
    }
  }
  float w[U][RMAX];
#pragma unroll
  for (int u = 0; u < U; ++u) {
#pragma unroll
    for (int r = 0; r < RMAX; ++r) {
      const float p = ok[u] ? EXP2(s[u][r] - m[r]) : 0.0f;
      l[r] += p;
      w[u][r] = p;
    }
  }
#pragma unroll
  for (int u = 0; u < U; ++u) {
@@VALUE_ACCUM@@
  }
#pragma unroll
  for (int u = 0; u < U; ++u) {
    tt[u] = ntt[u];
    ok[u] = nok[u];
  }
@@KEY_COPY@@
@@VALUE_COPY@@
}

// Merge the token groups of this threadgroup (SIMD shuffles, then one slot per SIMD group),
// then write (o, m, l) of each row for this block.
TGMEM float s_m[NGRP * RMAX];
TGMEM float s_l[NGRP * RMAX];
TGMEM float s_red[(NT / 32) * D];
if (gl == 0) {
#pragma unroll
  for (int r = 0; r < RMAX; ++r) {
    s_m[tg * RMAX + r] = m[r];
    s_l[tg * RMAX + r] = l[r];
  }
}
SYNC();
#pragma unroll
for (int r = 0; r < RMAX; ++r) {
  if (r < nrows) {
    float M = NEG_INF;
    for (int j = 0; j < NGRP; ++j) {
      M = FMAX(M, s_m[j * RMAX + r]);
    }
    const float fac = (m[r] == NEG_INF) ? 0.0f : EXP2(m[r] - M);
#pragma unroll
    for (int k = 0; k < NS; ++k) {
      const int sc = gl + k * G;
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        float val = (@@VALUE_OUT@@) * fac;
#pragma unroll
        for (int off = G; off < 32; off *= 2) {
          val += SHFL_XOR(val, off);
        }
        if (lane < G && sc < NSUB) {
          s_red[warp * D + sc * 8 + i] = val;
        }
      }
    }
    SYNC();
    const int prow = (qrow0 + r) * nblk + blk;
    for (int d = tid; d < D; d += NT) {
      float acc = 0.0f;
#pragma unroll
      for (int j = 0; j < NT / 32; ++j) {
        acc += s_red[j * D + d];
      }
      po[prow * D + d] = acc;
    }
    if (tid == 0) {
      float L = 0.0f;
      for (int j = 0; j < NGRP; ++j) {
        const float mj = s_m[j * RMAX + r];
        L += (mj == NEG_INF) ? 0.0f : s_l[j * RMAX + r] * EXP2(mj - M);
      }
      pm[prow] = M;
      pl[prow] = L;
    }
    SYNC();
  }
}

//! The query rows of this threadgroup are staged once in threadgroup memory (zero past the last
//! row), both pass 1s: the setup's global loads are independent and coalesced, one round trip,
//! where per-lane loads under a row guard became a chain of round trips. With key means, the
//! plain scaled rows too, then q . mean for every (row, 256-token block) of the span, one pair
//! per thread with independent 16-byte loads of the mean rows.
//@@ query_stage

constexpr int QI = (RMAX * D / 4 + NT - 1) / NT;
@@POST_DECL@@
#pragma unroll
for (int qi = 0; qi < QI; ++qi) {
  const int i = tid + qi * NT;
  const int r = i / (D / 4);
  const int d = 4 * (i - r * (D / 4));
@@INIT@@
  if (r < nrows) {
@@SET@@
  }
@@POST_LOAD@@
  if (i < RMAX * D / 4) {
@@STORE@@
  }
}
SYNC();

//! The Hadamard transform of the staged query rows (Sylvester order, as mx.hadamard_transform):
//! the butterflies inside each float4 as it is staged (fwht4), then one pass per wider stride over
//! float4 pairs, then the per-channel `post` scale (loaded with the query, into registers).
//@@ fwht4
    {
      const float a0 = x0.x + x0.y, a1 = x0.x - x0.y, a2 = x0.z + x0.w, a3 = x0.z - x0.w;
      x0.x = a0 + a2;
      x0.y = a1 + a3;
      x0.z = a0 - a2;
      x0.w = a1 - a3;
    }

//@@ post_decl
F4 pst[QI];
//@@ post_load
  pst[qi].x = post[h * D + d];
  pst[qi].y = post[h * D + d + 1];
  pst[qi].z = post[h * D + d + 2];
  pst[qi].w = post[h * D + d + 3];
//@@ fwht_stages

for (int hq = 1; hq < D / 4; hq *= 2) {
  for (int p = tid; p < RMAX * D / 8; p += NT) {
    const int r = p / (D / 8);
    const int j = p - r * (D / 8);
    const int i = r * (D / 4) + (j / hq) * 2 * hq + (j % hq);
    const F4 fa = s_q4[i];
    const F4 fb = s_q4[i + hq];
    F4 s0;
    F4 s1;
    s0.x = fa.x + fb.x;
    s0.y = fa.y + fb.y;
    s0.z = fa.z + fb.z;
    s0.w = fa.w + fb.w;
    s1.x = fa.x - fb.x;
    s1.y = fa.y - fb.y;
    s1.z = fa.z - fb.z;
    s1.w = fa.w - fb.w;
    s_q4[i] = s0;
    s_q4[i + hq] = s1;
  }
  SYNC();
}
#pragma unroll
for (int qi = 0; qi < QI; ++qi) {
  const int i = tid + qi * NT;
  if (i < RMAX * D / 4) {
    F4 x = s_q4[i];
    x.x *= pst[qi].x;
    x.y *= pst[qi].y;
    x.z *= pst[qi].z;
    x.w *= pst[qi].w;
    s_q4[i] = x;
  }
}
SYNC();

//! q . mean per (row, key-mean block): one SIMD group per block, a lane per 4 dims and every row
//! reduced by shuffles. The blocks' mean rows are loaded before the query is staged, so both
//! round trips overlap (a thread-per-pair loop held a whole mean row in registers: ~30 more
//! registers for the whole kernel).
//@@ shift_loads

constexpr int MU_SW = NT / 32;
constexpr int MU_JW = (MAXSB + MU_SW - 1) / MU_SW;
constexpr int MU_DL = (D / 4 + 31) / 32;
const int mu_nsb = ((t_end - 1) >> 8) - sb0 + 1;
const int mu_sl = tid & 31;
const int mu_sw = tid >> 5;
F4 mu4[MU_JW][MU_DL];
{
  const int mu_nb = params[6];
#pragma unroll
  for (int k = 0; k < MU_JW; ++k) {
    const int j = mu_sw + k * MU_SW;
#pragma unroll
    for (int e = 0; e < MU_DL; ++e) {
      const int d4 = mu_sl + 32 * e;
      mu4[k][e].x = 0.0f;
      mu4[k][e].y = 0.0f;
      mu4[k][e].z = 0.0f;
      mu4[k][e].w = 0.0f;
      if (j < mu_nsb && d4 < D / 4) {
        mu4[k][e] = ((const DEV F4*)(mu + ((int64_t)h * mu_nb + sb0 + j) * D))[d4];
      }
    }
  }
}

//@@ shift_pairs

#pragma unroll
for (int k = 0; k < MU_JW; ++k) {
  const int j = mu_sw + k * MU_SW;
  if (j < mu_nsb) {
    for (int r = 0; r < RMAX; ++r) {
      float acc = 0.0f;
#pragma unroll
      for (int e = 0; e < MU_DL; ++e) {
        const int d4 = IMIN(mu_sl + 32 * e, D / 4 - 1);
        const F4 a = s_qs4[r * (D / 4) + d4];
        acc += a.x * mu4[k][e].x + a.y * mu4[k][e].y + a.z * mu4[k][e].z + a.w * mu4[k][e].w;
      }
      acc += SHFL_XOR(acc, 16);
      acc += SHFL_XOR(acc, 8);
      acc += SHFL_XOR(acc, 4);
      acc += SHFL_XOR(acc, 2);
      acc += SHFL_XOR(acc, 1);
      if (mu_sl == 0) {
        s_qmu[r * MAXSB + j] = acc;
      }
    }
  }
}

//@@ shift_finish
      x += s_qmu[r * MAXSB + (tt[u] >> 8) - sb0];
