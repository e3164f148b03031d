//! The Metal (MSL) dialect of the decode kernels: the same macros as dialect.cuh, and the prologue
//! (Metal needs the attribute names in the kernel body itself).
//@@ header
#ifndef TQ_DECODE_HEADER
#define TQ_DECODE_HEADER

#define TQ_LN2 0.6931471805599453f

#define DEV device
#define TGMEM threadgroup
#define TQ_OUT_float32(x) (x)
#define TQ_OUT_float16(x) static_cast<half>(x)
#define TQ_OUT_bfloat16(x) static_cast<bfloat16_t>(x)
#define SYNC() threadgroup_barrier(metal::mem_flags::mem_threadgroup)
#define SHFL_XOR(x, m) metal::simd_shuffle_xor((x), (ushort)(m))
#define EXP2(x) metal::exp2(x)
#define LOG2(x) metal::log2(x)
#define FMAX(a, b) metal::max((a), (b))
#define IMIN(a, b) metal::min((a), (b))
#define AS_FLOAT(u) as_type<float>((uint32_t)(u))
#define NEG_INF as_type<float>(0xff800000u)
#define CBLOOK(tbl, off) (*(threadgroup const float*)((threadgroup const char*)(tbl) + (off)))
#define U2 uint2
#define U4 uint4
#define F4 float4
inline uint32_t tq_funnel(uint32_t lo, uint32_t hi, uint32_t sh) {
  return sh == 0 ? lo : ((lo >> sh) | (hi << (32u - sh)));
}
inline float tq_half(uint32_t bits) {
  return float(as_type<half>((ushort)bits));
}
inline void tq_h2(uint32_t w, thread float& a, thread float& b) {
  float2 f = float2(as_type<half2>(w));
  a = f.x;
  b = f.y;
}
#endif

//@@ prologue
const int tid = (int)thread_position_in_threadgroup.x;
const int blk = (int)threadgroup_position_in_grid.x;
const int gy = (int)threadgroup_position_in_grid.y;
