"""Pass 0 of the fused decode, the query transform (one threadgroup per query row): the query in
the codes' basis, ((q * pre) @ M) * post with the rotation as an exact float32 matrix, and the
plain scaled query for the per-block key means; one launch instead of five elementwise/Hadamard
ops. The kernel text is `src/pass0.h`."""

from __future__ import annotations

from dataclasses import dataclass

from turboquant.attention.kernels.dialects import fill, section
from turboquant.attention.kernels.matvec import matvec


@dataclass(frozen=True)
class Pass0:
    """The query transform of TurboQuant keys: q_k = ((q * pre[h]) @ M) * post[h] with the
    rotation as an exact float32 matrix (one threadgroup per query row), plus q_s = q * c for
    the key means. Replaces five elementwise/Hadamard ops with one launch."""

    d: int
    q_dtype: str
    post: bool
    qs: bool

    @property
    def threads(self) -> int:
        return 256

    @property
    def name(self) -> str:
        dt = {"float16": "f16", "bfloat16": "bf16", "float32": "f32"}[self.q_dtype]
        return f"tq_decode0_d{self.d}_{dt}_p{int(self.post)}_s{int(self.qs)}"

    def input_names(self) -> list[str]:
        return ["params", "q", "cq", "pre", "mf"] + (["post"] if self.post else [])

    def output_names(self) -> list[str]:
        return ["q_k"] + (["q_s"] if self.qs else [])



def pass0_body(v: Pass0, prologue: str) -> str:
    return fill(section("pass0.h", "pass0"), PROLOGUE=prologue, D=v.d, NT=v.threads,
                QS="  q_s[row * D + d] = x * cq[0];" if v.qs else "",
                PRODUCT=matvec("s_x", "mf", "q_k[row * D + e]", " * post[h * D + e]" if v.post else ""))
