//! The key and value sides of pass 1 (turboquant.kernels.template): per-lane setup, the loads of a
//! chunk of rows into registers (@@P@@: the register set's prefix, "" or "n_" for the prefetch;
//! @@TT@@: its token array), and the parts that do not unroll per code. @@X@@ is the side, k or v.
//@@ turbo_setup

int @@X@@wi[NS];
int @@X@@wj[NS];
uint32_t @@X@@sh[NS];
#pragma unroll
for (int k = 0; k < NS; ++k) {
  const int sc = gl + k * G;
  const int bit = (sc < NSUB ? sc : 0) * @@CODE_BITS@@;
  @@X@@wi[k] = bit >> 5;
  @@X@@wj[k] = IMIN((bit >> 5) + 1, @@LAST_WORD@@);
  @@X@@sh[k] = (uint32_t)(bit & 31);
}
const int64_t @@X@@base = (int64_t)b * @@X@@_p_strides[0] + (int64_t)h * @@X@@_p_strides[1];
const int64_t @@X@@ts = @@X@@_p_strides[2];
const int64_t @@X@@nbase = (int64_t)b * @@X@@_n_strides[0] + (int64_t)h * @@X@@_n_strides[1];
const int64_t @@X@@nts = @@X@@_n_strides[2];

//@@ turbo_fill

#pragma unroll
  for (int u = 0; u < U; ++u) {
    const DEV uint32_t* p = @@X@@_p + @@X@@base + (int64_t)@@TT@@[u] * @@X@@ts;
#pragma unroll
    for (int k = 0; k < NS; ++k) {
      @@LOAD@@
    }
    @@P@@@@X@@nr[u] = @@NORM@@;
  }

//@@ affine_setup

int @@X@@wi[NS];
int @@X@@gi[NS];
#pragma unroll
for (int k = 0; k < NS; ++k) {
  const int sc = (gl + k * G) < NSUB ? (gl + k * G) : 0;
  @@X@@wi[k] = sc * @@WORDS@@;
  @@X@@gi[k] = (sc * 8) / @@GROUP@@;
}
const int64_t @@X@@base = (int64_t)b * @@X@@_w_strides[0] + (int64_t)h * @@X@@_w_strides[1];
const int64_t @@X@@ts = @@X@@_w_strides[2];
const int64_t @@X@@sbase = (int64_t)b * @@X@@_s_strides[0] + (int64_t)h * @@X@@_s_strides[1];
const int64_t @@X@@sts = @@X@@_s_strides[2];
const int64_t @@X@@bbase = (int64_t)b * @@X@@_b_strides[0] + (int64_t)h * @@X@@_b_strides[1];
const int64_t @@X@@bts = @@X@@_b_strides[2];

//@@ affine_load8
      const U2 v2 = *(const DEV U2*)(p + @@X@@wi[k]);
      @@P@@@@X@@c[u][k][0] = v2.x;
      @@P@@@@X@@c[u][k][1] = v2.y;
//@@ affine_fill

#pragma unroll
  for (int u = 0; u < U; ++u) {
    const DEV uint32_t* p = @@X@@_w + @@X@@base + (int64_t)@@TT@@[u] * @@X@@ts;
#pragma unroll
    for (int k = 0; k < NS; ++k) {
@@WLOAD@@
      @@P@@@@X@@sc[u][k] = (uint32_t)((const DEV @@RAW_T@@*)@@X@@_s)[@@X@@sbase + (int64_t)@@TT@@[u] * @@X@@sts + @@X@@gi[k]];
      @@P@@@@X@@bi[u][k] = (uint32_t)((const DEV @@RAW_T@@*)@@X@@_b)[@@X@@bbase + (int64_t)@@TT@@[u] * @@X@@bts + @@X@@gi[k]];
    }
  }

//@@ affine_key_qsum

float qsum[RMAX][NS];
#pragma unroll
for (int r = 0; r < RMAX; ++r) {
#pragma unroll
  for (int k = 0; k < NS; ++k) {
    float acc = 0.0f;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      acc += q[r][k * 8 + i];
    }
    qsum[r][k] = acc;
  }
}

//@@ native_setup

int kei[NS];
#pragma unroll
for (int k = 0; k < NS; ++k) {
  const int sc = gl + k * G;
  kei[k] = (sc < NSUB ? sc : 0) * 8;
}
const int64_t kbase = (int64_t)b * k_raw_strides[0] + (int64_t)h * k_raw_strides[1];
const int64_t kts = k_raw_strides[2];

//@@ native_fill_float32

#pragma unroll
  for (int u = 0; u < U; ++u) {
    const DEV float* p = k_raw + kbase + (int64_t)@@TT@@[u] * kts;
#pragma unroll
    for (int k = 0; k < NS; ++k) {
      const U4 a = *(const DEV U4*)(p + kei[k]);
      const U4 c = *(const DEV U4*)(p + kei[k] + 4);
      @@P@@kx[u][k][0] = AS_FLOAT(a.x); @@P@@kx[u][k][1] = AS_FLOAT(a.y); @@P@@kx[u][k][2] = AS_FLOAT(a.z);
      @@P@@kx[u][k][3] = AS_FLOAT(a.w); @@P@@kx[u][k][4] = AS_FLOAT(c.x); @@P@@kx[u][k][5] = AS_FLOAT(c.y);
      @@P@@kx[u][k][6] = AS_FLOAT(c.z); @@P@@kx[u][k][7] = AS_FLOAT(c.w);
    }
  }

//@@ native_fill_half

#pragma unroll
  for (int u = 0; u < U; ++u) {
    const DEV uint32_t* p = (const DEV uint32_t*)(k_raw + kbase + (int64_t)@@TT@@[u] * kts);
#pragma unroll
    for (int k = 0; k < NS; ++k) {
      const U4 a = *(const DEV U4*)(p + kei[k] / 2);
      @@P@@kh[u][k][0] = a.x; @@P@@kh[u][k][1] = a.y; @@P@@kh[u][k][2] = a.z; @@P@@kh[u][k][3] = a.w;
    }
  }

//@@ native_score
    float acc[RMAX];
#pragma unroll
    for (int r = 0; r < RMAX; ++r) { acc[r] = 0.0f; }
#pragma unroll
    for (int k = 0; k < NS; ++k) {
@@DECL@@@@CONV@@
#pragma unroll
      for (int i = 0; i < 8; ++i) {
#pragma unroll
        for (int r = 0; r < RMAX; ++r) { acc[r] += q[r][k * 8 + i] * @@ELEM@@; }
      }
    }
#pragma unroll
    for (int r = 0; r < RMAX; ++r) { s[u][r] = acc[r]; }
//@@ affine_value_state
float ob[RMAX][NS];
#pragma unroll
for (int r = 0; r < RMAX; ++r) {
#pragma unroll
  for (int k = 0; k < NS; ++k) { ob[r][k] = 0.0f; }
}
//@@ affine_value_rescale
#pragma unroll
      for (int k = 0; k < NS; ++k) { ob[r][k] *= a; }
