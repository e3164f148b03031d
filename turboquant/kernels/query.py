"""Pass 0 of the fused decode, the query transform (one threadgroup per query row): the query in
the codes' basis, ((q * pre) @ M) * post with the rotation as an exact float32 matrix, and the
plain scaled query for the per-block key means; one launch instead of five elementwise/Hadamard
ops."""

from __future__ import annotations

from dataclasses import dataclass

from .dialects import fill


@dataclass(frozen=True)
class Pass0:
    """The query transform of TurboQuant keys: q_k = ((q * pre[h]) @ M) * post[h] with the
    rotation as an exact float32 matrix (one threadgroup per query row), plus q_s = q * c for
    the key means. Replaces five elementwise/Hadamard ops with one launch."""

    d: int
    q_dtype: str
    post: bool
    qs: bool
    matrix: bool = True  # False: affine keys, q_k = q * pre (no rotation)

    @property
    def threads(self) -> int:
        return 256 if self.d > 128 else 128

    @property
    def name(self) -> str:
        dt = {"float16": "f16", "bfloat16": "bf16", "float32": "f32"}[self.q_dtype]
        return f"tq_decode0_d{self.d}_{dt}_p{int(self.post)}_s{int(self.qs)}_m{int(self.matrix)}"

    def input_names(self) -> list[str]:
        return ["params", "q", "cq", "pre"] + (["mf"] if self.matrix else []) + (["post"] if self.post else [])

    def output_names(self) -> list[str]:
        return ["q_k"] + (["q_s"] if self.qs else [])


_PASS0 = """
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
"""

# Four independent sums over an unrolled loop keep many loads of the matrix in flight (a single
# running sum waits for every load in turn).
_PASS0_MATRIX = """for (int e = tid; e < D; e += NT) {
  float a0 = 0.0f, a1 = 0.0f, a2 = 0.0f, a3 = 0.0f;
#pragma unroll 4
  for (int j = 0; j < D; j += 4) {
    a0 += s_x[j] * mf[j * D + e];
    a1 += s_x[j + 1] * mf[(j + 1) * D + e];
    a2 += s_x[j + 2] * mf[(j + 2) * D + e];
    a3 += s_x[j + 3] * mf[(j + 3) * D + e];
  }
  q_k[row * D + e] = ((a0 + a1) + (a2 + a3))@@POST@@;
}"""

_PASS0_SCALE = """for (int e = tid; e < D; e += NT) {
  q_k[row * D + e] = s_x[e];
}"""


def pass0_body(v: Pass0, prologue: str) -> str:
    return fill(_PASS0, PROLOGUE=prologue, D=v.d, NT=v.threads,
                QS="  q_s[row * D + d] = x * cq[0];" if v.qs else "",
                PRODUCT=fill(_PASS0_MATRIX if v.matrix else _PASS0_SCALE,
                             POST=" * post[h * D + e]" if v.post else ""))
