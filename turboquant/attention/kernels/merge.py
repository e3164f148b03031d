"""Pass 2 of the fused decode, the merge (one threadgroup per query row): merge pass 1's blocks,
normalise, apply the inverse value rotation (dense matrix, float32 FMAs, not TF32) and write the
output (float32, or the activation dtype) and the log-sum-exp (natural log, float32). The CUDA
variant with a raw tail also attends over the newest native rows in the same softmax.

Attention sinks (gpt-oss: one logit per query head that joins the softmax normaliser and adds
nothing to the numerator) need no change to pass 1: the merge takes the sink as one more block
with sum exp(sink) and no output, so the per-block partials of either pass 1 stay as they are.
The sink variant has its own name and input; without sinks the text is the one it always was.
The log-sum-exp then covers the sink too, which is what a later merge (the raw tail, here or in
`host.merge_tail`) needs to stay exact.

The kernel text is `src/pass2.h` (body, finish, raw tail, sink); this module picks and fills it."""

from __future__ import annotations

from dataclasses import dataclass

from turboquant.attention.kernels.dialects import SHORT, fill, pow2ceil, sections
from turboquant.attention.kernels.matvec import matvec

MAX_BLOCKS = 1024  # pass 2 keeps one factor per block in threadgroup memory
OUTPUTS2 = ["out", "lse"]


@dataclass(frozen=True)
class Pass2:
    d: int
    rotate: bool  # apply a dense inverse value rotation
    tail_dtype: str = ""  # the raw tail's dtype when pass 2 also attends over it (CUDA)
    q_dtype: str = ""  # the query's dtype (with a tail)
    out_dtype: str = ""  # the output's dtype (the activations'); "" is float32
    sinks: bool = False  # a per-query-head sink logit (natural log, float32 input `sinks`) joins the normaliser

    @property
    def threads(self) -> int:
        return 256

    @property
    def name(self) -> str:
        tail = f"_t{SHORT[self.tail_dtype]}_q{SHORT[self.q_dtype]}" if self.tail_dtype else ""
        out = f"_o{SHORT[self.out_dtype]}" if self.out_dtype else ""
        sinks = "_sk" if self.sinks else ""
        return f"tq_decode2_d{self.d}_rot{int(self.rotate)}{tail}{out}{sinks}"

    def input_names(self) -> list[str]:
        names = ["params", "po", "pm", "pl"] + (["rinv"] if self.rotate else [])
        names += ["tq", "cq", "t_k", "t_v"] if self.tail_dtype else []
        return names + (["sinks"] if self.sinks else [])


def pass2_body(v: Pass2, prologue: str) -> str:
    text = sections("pass2.h")
    return fill(
        text["pass2"], PROLOGUE=prologue, D=v.d, NT=v.threads, NBMAX=MAX_BLOCKS,
        NORMALISE=text["sink"] if v.sinks else "const float inv = 1.0f / L;",
        ROT_SHARED="TGMEM float s_o[D];" if v.rotate else "",
        STORE="  s_o[d] = acc * inv;" if v.rotate else "  s_y[d] = acc * inv;",
        ROTATE="SYNC();\n" + matvec("s_o", "rinv", "s_y[e]") if v.rotate else "",
        FINISH=fill(text["tail"], OUT=f"TQ_OUT_{v.out_dtype or 'float32'}", VP=pow2ceil(v.d // 2),
                    **_tail_loads(v.d, v.tail_dtype)) if v.tail_dtype else
        fill(text["finish"], OUT=f"TQ_OUT_{v.out_dtype or 'float32'}"),
    )


def _tail_loads(d: int, dtype: str) -> dict[str, str]:
    """The raw tail's 16-byte key loads: when a row's elements are contiguous and the row starts
    on 16 bytes (a runtime check), `KWORDS` words of `KPER` elements each, converted by `KCONV`;
    else (or when d is not a whole number of words) the scalar loads."""
    per = 4 if dtype == "float32" else 8
    if d % per:
        return {"KVEC": "false", "KWORDS": "0", "KPER": str(per), "KCONV": ""}
    if dtype == "float32":
        conv = "        x[0] = AS_FLOAT(w.x); x[1] = AS_FLOAT(w.y); x[2] = AS_FLOAT(w.z); x[3] = AS_FLOAT(w.w);"
    elif dtype == "float16":
        conv = "\n".join(f"        tq_h2(w.{c}, x[{2 * j}], x[{2 * j + 1}]);" for j, c in enumerate("xyzw"))
    else:  # bfloat16: the high half of a float32
        conv = "\n".join(f"        x[{2 * j}] = AS_FLOAT(w.{c} << 16); x[{2 * j + 1}] = AS_FLOAT(w.{c} & 0xffff0000u);"
                         for j, c in enumerate("xyzw"))
    check = (f"t_k_strides[3] == 1 && kr % {per} == 0 && "
             "(unsigned long long)(const void*)t_k % 16 == 0")
    return {"KVEC": check, "KWORDS": str(d // per), "KPER": str(per), "KCONV": conv}
