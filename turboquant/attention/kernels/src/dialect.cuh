//! The CUDA (NVRTC) dialect of the decode kernels: the macros every kernel body is written over
//! (shuffles, barriers, address spaces, bit casts, output conversions), and the prologue that
//! reads the thread and threadgroup indices. dialect.metal defines the same names for Metal.
//! Sections (`//@@ name`) are cut out verbatim by turboquant.kernels.dialects.section; `//!`
//! lines are notes for readers and are dropped.
//@@ header
#ifndef TQ_DECODE_HEADER
#define TQ_DECODE_HEADER

#define TQ_LN2 0.6931471805599453f

#define DEV
#define TGMEM __shared__
#define TQ_OUT_float32(x) (x)
#define TQ_OUT_float16(x) __float2half_rn(x)
#define TQ_OUT_bfloat16(x) __float2bfloat16_rn(x)
#define SYNC() __syncthreads()
#define SHFL_XOR(x, m) __shfl_xor_sync(0xffffffffu, (x), (m))
#define EXP2(x) exp2f(x)
#define LOG2(x) log2f(x)
#define FMAX(a, b) fmaxf((a), (b))
#define IMIN(a, b) min((a), (b))
#define AS_FLOAT(u) __uint_as_float(u)
#define NEG_INF __uint_as_float(0xff800000u)
#define CBLOOK(tbl, off) (*(const float*)((const char*)(tbl) + (off)))
#define U2 uint2
#define U4 uint4
#define F4 float4
__device__ __forceinline__ uint32_t tq_funnel(uint32_t lo, uint32_t hi, uint32_t sh) {
  return __funnelshift_r(lo, hi, sh);
}
__device__ __forceinline__ float tq_half(uint32_t bits) {
  return __half2float(__ushort_as_half((unsigned short)bits));
}
__device__ __forceinline__ void tq_h2(uint32_t w, float& a, float& b) {
  __half2 h = *reinterpret_cast<__half2*>(&w);
  float2 f = __half22float2(h);
  a = f.x;
  b = f.y;
}
#endif

//@@ prologue
const int tid = (int)threadIdx.x;
const int blk = (int)blockIdx.x;
const int gy = (int)blockIdx.y;
