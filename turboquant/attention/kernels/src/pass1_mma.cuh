//! Pass 1 on the tensor cores (CUDA only: mma.sync.m16n8k16); turboquant.kernels.mma explains the
//! fragment layouts and fills the markers. The emulator defines the helpers of `header` on the CPU.
//! Tensor-core helpers of the CUDA dialect (the emulator defines the same names on the CPU).
//@@ header

#ifndef TQ_MMA_HEADER
#define TQ_MMA_HEADER
__device__ __forceinline__ uint32_t tq_pack_h2(float lo, float hi) {
  __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}
__device__ __forceinline__ void tq_mma(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                       uint32_t b0, uint32_t b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
               "{%0,%1,%2,%3};\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
__device__ __forceinline__ uint32_t tq_affine8_h2(uint32_t w, uint32_t sel, uint32_t s2, uint32_t b2) {
  const uint32_t x = __byte_perm(w, 0x64646464u, sel);  // two bytes as fp16 1024 + code
  __half2 h = __hsub2(*reinterpret_cast<const __half2*>(&x), __float2half2_rn(1024.0f));
  h = __hfma2(h, *reinterpret_cast<const __half2*>(&s2), *reinterpret_cast<const __half2*>(&b2));
  return *reinterpret_cast<uint32_t*>(&h);
}
// A lane's copy of a pair table as one shared-memory address the compiler cannot take apart:
// given the copy's offset as an expression, it OR-ed the offset into every lookup again where it
// re-masked it (a fourth instruction per lookup), so a lookup is shift, mask, add and load.
#define LANE_TABLE const uint32_t
__device__ __forceinline__ uint32_t tq_lane_table(const uint32_t* table, uint32_t offset) {
  uint32_t a = (uint32_t)__cvta_generic_to_shared(table) + offset;
  asm("" : "+r"(a));
  return a;
}
__device__ __forceinline__ uint32_t tq_pairlook(uint32_t table, uint32_t offset) {
  uint32_t v;
  asm volatile("ld.shared.b32 %0, [%1];" : "=r"(v) : "r"(table + offset));
  return v;
}
#define ANY_LANE(x) __any_sync(0xffffffffu, (x))
#define SHFL_IDX_U32(x, src) __shfl_sync(0xffffffffu, (uint32_t)(x), (src))
#endif

//@@ body

constexpr int D = @@D@@;
constexpr int NQ = @@NQ@@;  // tiles of 8 query rows: every K/V element a warp decodes serves all of them
constexpr int RMAX = 8 * NQ;
constexpr int NT = @@NT@@;
constexpr int NW = NT / 32;
constexpr int KS = D / 16;
constexpr int CK = D / 4;
constexpr int NM = D / 16;
constexpr int CV = D / 8;
constexpr int MAXSB = @@MAXSB@@;
@@PROLOGUE@@
@@BLOCK@@
const int lane = tid % 32;
const int warp = tid / 32;
const int g = lane >> 2;
const int c = lane & 3;
const int sb0 = t_begin >> 8;
@@EARLY@@
TGMEM float s_o[RMAX * D];
TGMEM float s_m[NW * RMAX];
TGMEM float s_l[NW * RMAX];
@@SHARED@@
@@SETUP_SHARED@@
SYNC();

// Query fragments (B operand of the score MMA) of tile q: row 8q + g at dims c*CK + 4s + {0, 1}
// (b0) and c*CK + 4s + {2, 3} (b1) of k-step s, in fp16.
uint32_t qh[NQ][KS][2];
#pragma unroll
for (int q = 0; q < NQ; ++q) {
#pragma unroll
  for (int s = 0; s < KS; ++s) {
    const F4 x = s_q4[(8 * q + g) * (D / 4) + c * (CK / 4) + s];
    qh[q][s][0] = tq_pack_h2(x.x, x.y);
    qh[q][s][1] = tq_pack_h2(x.z, x.w);
  }
}
@@KEY_SETUP@@
@@VALUE_SETUP@@
// This lane's softmax state: rows 8q + 2c and 8q + 2c + 1 of each tile q.
float m[NQ][2];
float l[NQ][2];
float o[NQ][NM][4];
#pragma unroll
for (int q = 0; q < NQ; ++q) {
  m[q][0] = NEG_INF;
  m[q][1] = NEG_INF;
  l[q][0] = 0.0f;
  l[q][1] = 0.0f;
#pragma unroll
  for (int j = 0; j < NM; ++j) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      o[q][j][i] = 0.0f;
    }
  }
}
const int src0 = 4 * (2 * c) + (g >> 1);
const int src1 = 4 * (2 * c + 1) + (g >> 1);

// Each warp takes chunks of 16 tokens, NW chunks apart. Tokens past the block's end read
// token t_begin (finite) and get probability 0.
@@DECL@@
@@NDECL@@
int base = t_begin + warp * 16;
@@PRE@@
for (; base < t_end; base += NW * 16) {
  {
@@TOP@@
  }
  // Scores S^T = K Q^T (tokens x rows) per tile q: sc = (token g, rows 2c, 2c+1), (token g+8,
  // rows 2c, 2c+1) of the tile; the K fragments are decoded once for every tile.
  float sc0[NQ][4];
  float sc1[NQ][4];
#pragma unroll
  for (int q = 0; q < NQ; ++q) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      sc0[q][i] = 0.0f;
      sc1[q][i] = 0.0f;
    }
  }
@@KEY_STEPS@@
  uint32_t pb0[NQ];
  uint32_t pb1[NQ];
#pragma unroll
  for (int q = 0; q < NQ; ++q) {
  float sc[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    sc[i] = sc0[q][i] + sc1[q][i];
  }
  float pv[2][2];  // [row i][token tt]: probability times the token's value norm
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    float x[2];
#pragma unroll
    for (int tt = 0; tt < 2; ++tt) {
      float y = sc[2 * tt + i];
@@KEY_FINISH@@
      x[tt] = (base + g + 8 * tt < t_end) ? y : NEG_INF;
    }
    float mx = FMAX(x[0], x[1]);
    mx = FMAX(mx, SHFL_XOR(mx, 4));
    mx = FMAX(mx, SHFL_XOR(mx, 8));
    mx = FMAX(mx, SHFL_XOR(mx, 16));
    const float mn = FMAX(m[q][i], mx);
    const float alpha = (m[q][i] == NEG_INF) ? 0.0f : EXP2(m[q][i] - mn);
    const float p0 = (x[0] == NEG_INF) ? 0.0f : EXP2(x[0] - mn);
    const float p1 = (x[1] == NEG_INF) ? 0.0f : EXP2(x[1] - mn);
    l[q][i] = l[q][i] * alpha + p0 + p1;
    if (ANY_LANE(alpha != 1.0f)) {
#pragma unroll
      for (int j = 0; j < NM; ++j) {
        o[q][j][i] *= alpha;
        o[q][j][2 + i] *= alpha;
      }
    }
    m[q][i] = mn;
    pv[i][0] = p0 * vn[0];
    pv[i][1] = p1 * vn[1];
  }
  // P^T as the B operand of the value MMA: lane (g, c) needs row g at tokens 2c, 2c+1 (b0) and
  // 2c+8, 2c+9 (b1); they live in lanes (2c, g/2) and (2c+1, g/2) as (token g', g'+8) pairs.
  const uint32_t w0 = tq_pack_h2(pv[0][0], pv[0][1]);
  const uint32_t w1 = tq_pack_h2(pv[1][0], pv[1][1]);
  const uint32_t y00 = SHFL_IDX_U32(w0, src0);
  const uint32_t y01 = SHFL_IDX_U32(w1, src0);
  const uint32_t y10 = SHFL_IDX_U32(w0, src1);
  const uint32_t y11 = SHFL_IDX_U32(w1, src1);
  const uint32_t x0 = (g & 1) ? y01 : y00;
  const uint32_t x1 = (g & 1) ? y11 : y10;
  pb0[q] = (x0 & 0xffffu) | (x1 << 16);
  pb1[q] = (x0 >> 16) | (x1 & 0xffff0000u);
  }
  // O^T += V^T P^T (dims x rows): m-tile j holds run dims 2j (index g) and 2j+1 (index g+8) of
  // lane g's run, for tokens 2c, 2c+1 (a0, a1) and 2c+8, 2c+9 (a2, a3).
@@VALUE_STEPS@@
@@COPY@@
}

// Merge the warps: (m, l) per row in threadgroup memory, then each warp adds its scaled outputs
// in turn (a fixed order, so repeated runs are bit-identical).
#pragma unroll
for (int q = 0; q < NQ; ++q) {
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    l[q][i] += SHFL_XOR(l[q][i], 4);
    l[q][i] += SHFL_XOR(l[q][i], 8);
    l[q][i] += SHFL_XOR(l[q][i], 16);
    if (g == 0) {
      s_m[warp * RMAX + 8 * q + 2 * c + i] = m[q][i];
      s_l[warp * RMAX + 8 * q + 2 * c + i] = l[q][i];
    }
  }
}
SYNC();
float fac[NQ][2];
#pragma unroll
for (int q = 0; q < NQ; ++q) {
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    float M = NEG_INF;
    for (int w = 0; w < NW; ++w) {
      M = FMAX(M, s_m[w * RMAX + 8 * q + 2 * c + i]);
    }
    fac[q][i] = (m[q][i] == NEG_INF) ? 0.0f : EXP2(m[q][i] - M);
  }
}
// Two rounds: warps 0 and 2 store their scaled outputs, then warps 1 and 3 add theirs, pairs
// (0, 1) into s_o and (2, 3) into the query staging (dead since the fragments were built); the
// write-out adds the two (a fixed order, so repeated runs are bit-identical). Fragment element
// k = 2 * (dim parity) + (row parity) of m-tile j of a lane is word (4j + k) * 32 +
// (lane ^ (4j + k) % 32) of its row tile's 8 * D words: each merge access of a warp is one bank
// wavefront (the row-major layout took sixteen), and the XOR spreads the write-out's reads.
static_assert(NW == 4, "the merge pairs four warps");
float* const s_o2 = (float*)s_q4;
for (int round = 0; round < 2; ++round) {
  if ((warp & 1) == round) {
    float* const dst = (warp & 2) ? s_o2 : s_o;
#pragma unroll
    for (int q = 0; q < NQ; ++q) {
#pragma unroll
      for (int j = 0; j < NM; ++j) {
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          const int at = q * 8 * D + (4 * j + k) * 32 + (lane ^ ((4 * j + k) & 31));
          const float x = o[q][j][k] * fac[q][k & 1];
          dst[at] = (round == 0) ? x : dst[at] + x;
        }
      }
    }
  }
  SYNC();
}
for (int i = tid; i < nrows * D; i += NT) {
  const int r = i / D;
  const int d = i - r * D;
  const int run = d / CV;
  const int jk = 4 * ((d - run * CV) >> 1) + 2 * (d & 1) + (r & 1);
  const int at = (r >> 3) * 8 * D + jk * 32 + ((4 * run + ((r & 7) >> 1)) ^ (jk & 31));
  po[((int64_t)(qrow0 + r) * nblk + blk) * D + d] = s_o[at] + s_o2[at];
}
if (tid < nrows) {
  float M = NEG_INF;
  for (int w = 0; w < NW; ++w) {
    M = FMAX(M, s_m[w * RMAX + tid]);
  }
  float L = 0.0f;
  for (int w = 0; w < NW; ++w) {
    const float mw = s_m[w * RMAX + tid];
    L += (mw == NEG_INF) ? 0.0f : s_l[w * RMAX + tid] * EXP2(mw - M);
  }
  const int prow = (qrow0 + tid) * nblk + blk;
  pm[prow] = M;
  pl[prow] = L;
}

//@@ turbo_setup

const int64_t @@X@@base = (int64_t)b * @@X@@_p_strides[0] + (int64_t)h * @@X@@_p_strides[1];
const int64_t @@X@@ts = @@X@@_p_strides[2];
const int64_t @@X@@nbase = (int64_t)b * @@X@@_n_strides[0] + (int64_t)h * @@X@@_n_strides[1];
const int64_t @@X@@nts = @@X@@_n_strides[2];
//@@ affine_setup
const int64_t kbase = (int64_t)b * k_w_strides[0] + (int64_t)h * k_w_strides[1];
const int64_t kts = k_w_strides[2];
const int64_t ksbase = (int64_t)b * k_s_strides[0] + (int64_t)h * k_s_strides[1];
const int64_t ksts = k_s_strides[2];
const int64_t kbbase = (int64_t)b * k_b_strides[0] + (int64_t)h * k_b_strides[1];
const int64_t kbts = k_b_strides[2];
const int kg0 = (c * CK) / @@GROUP@@;
//@@ shift_finish
      y += s_qmu[(8 * q + 2 * c + i) * MAXSB + (base >> 8) - sb0];
