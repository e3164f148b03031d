//! Pass 0, the query transform (one threadgroup per query row): q_k = ((q * pre[h]) @ M) * post[h],
//! and q_s = q * cq for the key means.
//@@ pass0

constexpr int D = @@D@@;
constexpr int NT = @@NT@@;
@@PROLOGUE@@
const int row = blk;
const int R = params[3];
const int H = params[4];
const int h = (row / R) % H;
TGMEM float s_x[D];
for (int d = tid; d < D; d += NT) {
  const float x = static_cast<float>(q[row * D + d]);
  s_x[d] = x * pre[h * D + d];
@@QS@@
}
SYNC();
@@PRODUCT@@

