
#if defined(__APPLE__) && !defined(_XOPEN_SOURCE)
#define _XOPEN_SOURCE 700  // macOS declares the ucontext calls only under it
#endif
#include <ucontext.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <vector>
#include <array>

#define TQ_LN2 0.6931471805599453f
#define DEV
#define TGMEM static
#define TQ_OUT_float32(x) (x)
#define TQ_OUT_float16(x) (x)
#define TQ_OUT_bfloat16(x) (x)
#define SYNC() tq_tg_bar->arrive_and_wait()
#define SHFL_XOR(x, m) tq_shfl_xor((x), (m))
#define EXP2(x) std::exp2((float)(x))
#define LOG2(x) std::log2((float)(x))
#define FMAX(a, b) std::fmax((float)(a), (float)(b))
#define IMIN(a, b) std::min((int)(a), (int)(b))
#define AS_FLOAT(u) tq_as_float((uint32_t)(u))
#define NEG_INF (-INFINITY)
#define CBLOOK(tbl, off) (*(const float*)((const char*)(tbl) + (off)))
struct U2 { uint32_t x, y; };
struct U4 { uint32_t x, y, z, w; };
struct F4 { float x, y, z, w; };

using Strides = std::array<int64_t, 10>;

struct tq_bf16 {
  uint16_t v;
  operator float() const { uint32_t u = (uint32_t)v << 16; float f; std::memcpy(&f, &u, 4); return f; }
};

// A threadgroup's GPU threads are fibers on the calling OS thread, switched only at barriers:
// a barrier costs a few context switches, where OS threads (one per GPU thread) spent most of a
// test's time waking each other, and starved whenever other work held the cores.
struct tq_barrier {
  int count = 0, arrived = 0;
  unsigned gen = 0;
  void arrive_and_wait();
};

struct tq_group {  // the threadgroup that runs now
  int nt = 0, cur = 0;
  std::vector<ucontext_t> ctx;
  std::vector<char> done;
  ucontext_t main_ctx;
  tq_barrier tg;
  std::vector<tq_barrier> warps;
  std::vector<float> slots;
  std::vector<uint32_t> uslots;
  std::function<void()> body;
};

static tq_group* tq_g;
static int tq_tid, tq_bx, tq_by;
static tq_barrier* tq_tg_bar;
static tq_barrier* tq_warp_bar;
static float* tq_warp_slots;
static uint32_t* tq_warp_u;

static void tq_enter(int t) {  // the globals the kernel text reads as its thread's own
  tq_g->cur = t;
  tq_tid = t;
  tq_tg_bar = &tq_g->tg;
  tq_warp_bar = &tq_g->warps[t / 32];
  tq_warp_slots = &tq_g->slots[(t / 32) * 32];
  tq_warp_u = &tq_g->uslots[(t / 32) * 32 * 6];
}

static int tq_next(int me) {  // the next unfinished fiber after `me`, round robin; `me` when none
  for (int i = 1; i <= tq_g->nt; ++i) {
    const int t = (me + i) % tq_g->nt;
    if (!tq_g->done[t]) return t;
  }
  return me;
}

inline void tq_barrier::arrive_and_wait() {
  const unsigned mine = gen;
  if (++arrived == count) {
    arrived = 0;
    ++gen;
    return;
  }
  while (gen == mine) {
    const int me = tq_g->cur, next = tq_next(me);
    if (next == me) {
      std::fprintf(stderr, "emulator: thread %d waits at a barrier no other thread can reach\n", me);
      std::abort();
    }
    tq_enter(next);
    swapcontext(&tq_g->ctx[me], &tq_g->ctx[next]);
    tq_enter(me);
  }
}

static void tq_fiber() {
  tq_g->body();
  const int me = tq_g->cur;
  tq_g->done[me] = 1;
  const int next = tq_next(me);
  if (next != me) {
    tq_enter(next);
    setcontext(&tq_g->ctx[next]);
  }
}  // the last one returns to tq_run_group through uc_link

static void tq_run_group(int nt, const std::function<void()>& body, char* stacks, size_t stack) {
  tq_group g;
  g.nt = nt;
  g.ctx.resize(nt);
  g.done.assign(nt, 0);
  g.tg.count = nt;
  g.warps.resize((nt + 31) / 32);
  for (auto& w : g.warps) w.count = std::min(32, nt);
  g.slots.assign(g.warps.size() * 32, 0.0f);
  g.uslots.assign(g.warps.size() * 32 * 6, 0u);
  g.body = body;
  tq_g = &g;
  for (int t = 0; t < nt; ++t) {
    getcontext(&g.ctx[t]);
    g.ctx[t].uc_stack.ss_sp = stacks + (size_t)t * stack;
    g.ctx[t].uc_stack.ss_size = stack;
    g.ctx[t].uc_link = &g.main_ctx;
    makecontext(&g.ctx[t], tq_fiber, 0);
  }
  tq_enter(0);
  swapcontext(&g.main_ctx, &g.ctx[0]);
  tq_g = nullptr;
}

static inline float tq_as_float(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
static inline uint32_t tq_funnel(uint32_t lo, uint32_t hi, uint32_t sh) {
  return (uint32_t)(((((uint64_t)hi) << 32) | (uint64_t)lo) >> (sh & 31u));
}
static inline float tq_half(uint32_t bits) {
  uint16_t v = (uint16_t)bits;
  _Float16 h;
  std::memcpy(&h, &v, 2);
  return (float)h;
}
static inline void tq_h2(uint32_t w, float& a, float& b) {
  _Float16 h[2];
  std::memcpy(h, &w, 4);
  a = (float)h[0];
  b = (float)h[1];
}
static inline uint32_t tq_pack_h2(float lo, float hi) {
  _Float16 h[2] = {(_Float16)lo, (_Float16)hi};
  uint32_t w;
  std::memcpy(&w, h, 4);
  return w;
}
static inline uint32_t tq_affine8_h2(uint32_t w, uint32_t sel, uint32_t s2, uint32_t b2) {
  const uint32_t c0 = (w >> (8 * (sel & 3u))) & 0xffu, c1 = (w >> (8 * ((sel >> 8) & 3u))) & 0xffu;
  _Float16 s, bb;
  const uint16_t sv = (uint16_t)s2, bv = (uint16_t)b2;
  std::memcpy(&s, &sv, 2);
  std::memcpy(&bb, &bv, 2);
  return tq_pack_h2((float)c0 * (float)s + (float)bb, (float)c1 * (float)s + (float)bb);
}
#define LANE_TABLE const char* const
static inline const char* tq_lane_table(const uint32_t* table, uint32_t offset) {
  return (const char*)table + offset;
}
static inline uint32_t tq_pairlook(const char* table, uint32_t offset) {
  uint32_t v;
  std::memcpy(&v, table + offset, 4);
  return v;
}
static inline float tq_h2f(uint32_t w, int hi) {
  const uint16_t v = (uint16_t)(hi ? (w >> 16) : (w & 0xffffu));
  _Float16 h;
  std::memcpy(&h, &v, 2);
  return (float)h;
}
// mma.sync.m16n8k16 (row.col, fp16 in, float32 accumulate) with the PTX fragment layouts:
// lane = 4 * group + quad position; A regs (row g | g+8) x (k 2c.. | 2c+8..), B regs k 2c.. | 2c+8...
static inline void tq_mma(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                          uint32_t b1) {
  const int lane = tq_tid % 32;
  uint32_t* u = tq_warp_u;
  const uint32_t mine[6] = {a0, a1, a2, a3, b0, b1};
  for (int i = 0; i < 6; ++i) u[lane * 6 + i] = mine[i];
  tq_warp_bar->arrive_and_wait();
  const int g = lane >> 2, c = lane & 3;
  float out[4];
  for (int i = 0; i < 4; ++i) {
    const int row = g + 8 * (i >> 1), col = 2 * c + (i & 1);
    float acc = d[i];
    for (int k = 0; k < 16; ++k) {
      const int la = (row % 8) * 4 + (k % 8) / 2, ra = (row >= 8 ? 1 : 0) + (k >= 8 ? 2 : 0);
      const int lb = col * 4 + (k % 8) / 2, rb = 4 + (k >= 8 ? 1 : 0);
      acc += tq_h2f(u[la * 6 + ra], k & 1) * tq_h2f(u[lb * 6 + rb], k & 1);
    }
    out[i] = acc;
  }
  tq_warp_bar->arrive_and_wait();
  for (int i = 0; i < 4; ++i) d[i] = out[i];
}
static inline float tq_shfl_xor(float x, int m);
static inline bool tq_any(bool x) {
  float s = x ? 1.0f : 0.0f;
  for (int m = 1; m < 32; m *= 2) s += tq_shfl_xor(s, m);
  return s > 0.0f;
}
#define ANY_LANE(x) tq_any((x))
static inline uint32_t tq_shfl_idx_u32(uint32_t x, int src) {
  const int lane = tq_tid % 32;
  tq_warp_u[lane] = x;
  tq_warp_bar->arrive_and_wait();
  const uint32_t y = tq_warp_u[src];
  tq_warp_bar->arrive_and_wait();
  return y;
}
#define SHFL_IDX_U32(x, src) tq_shfl_idx_u32((uint32_t)(x), (src))
static inline float tq_shfl_xor(float x, int m) {
  const int lane = tq_tid % 32;
  tq_warp_slots[lane] = x;
  tq_warp_bar->arrive_and_wait();
  const float y = tq_warp_slots[lane ^ m];
  tq_warp_bar->arrive_and_wait();
  return y;
}
