"""The dialects the kernel texts are written over: CUDA (NVRTC) and Metal (MSL) headers that
define the same macros (shuffles, barriers, address spaces, bit casts, output conversions), the
prologues that read the thread and threadgroup indices, and the marker substitution the
templates use."""

from __future__ import annotations

import re

MARK = "@@"
DIALECTS = ("cuda", "metal")
SHORT = {"float16": "f16", "bfloat16": "bf16", "float32": "f32"}


def pow2ceil(n: int) -> int:
    p = 1
    while p < n:
        p *= 2
    return p


_COMMON_MACROS = """
#define TQ_LN2 0.6931471805599453f
"""

CUDA_HEADER = _COMMON_MACROS + """
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
"""

METAL_HEADER = _COMMON_MACROS + """
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
"""

PROLOGUE = {
    "cuda": """const int tid = (int)threadIdx.x;
const int blk = (int)blockIdx.x;
const int gy = (int)blockIdx.y;""",
    "metal": """const int tid = (int)thread_position_in_threadgroup.x;
const int blk = (int)threadgroup_position_in_grid.x;
const int gy = (int)threadgroup_position_in_grid.y;""",
}

def _guard(text: str) -> str:
    return "#ifndef TQ_DECODE_HEADER\n#define TQ_DECODE_HEADER\n" + text + "#endif\n"


HEADERS = {"cuda": _guard(CUDA_HEADER), "metal": _guard(METAL_HEADER)}


def fill(text: str, **values) -> str:
    for k, v in values.items():
        text = text.replace(f"{MARK}{k}{MARK}", str(v))
    return text


def leftover_markers(text: str) -> list[str]:
    return re.findall(re.escape(MARK) + r"\w*" + re.escape(MARK) + "?", text)
