"""One template, two dialects: the source of pass 1 of the fused decode for CUDA and Metal.

The kernel bodies (`src/pass1.h`, the key and value sides in `src/pass1_sides.h`) are written
once, in C++ that both `mx.fast.cuda_kernel` (NVRTC) and
`mx.fast.metal_kernel` (MSL, C++14) accept, over a few dialect macros (shuffles, barriers,
address spaces, bit casts) that each dialect's header defines, and a prologue that reads the
thread and threadgroup indices (Metal needs the attribute names in the body itself). A variant's
structure (head dim, formats, bits, rows per threadgroup) is baked into its source as
constants and into its name; runtime sizes (tokens, block span, block count, GQA ratio) travel
in the `params` input, so a growing cache never compiles a new kernel.

Pass 1 (one threadgroup per (KV head, row group, block of tokens)): G lanes share one token,
each lane owns 8*NS dims; every K row (packed codes + norm, or affine words + scales, or native
rows) and every V row is read once for all RMAX query rows of the KV head; scores in float32 in
the log2 domain (the host multiplies the queries by log2(e)); per token-group online softmax with
a lazy rescale once per U tokens; values accumulated in the rotated basis (TurboQuant) or as
codes (affine); the next U tokens' rows are loaded (raw words) while the current ones are
used. The groups are merged in threadgroup memory; each (row, block) writes its unnormalised
output, its max m and its sum l.

Pass 0 (the query transform) is in `query.py`, pass 2 (the merge) in `merge.py`, the dialect
headers in `src/dialect.cuh` and `src/dialect.metal`, read by `dialects.py`. This module fills
the bodies' `@@NAME@@` markers: constants, and code it unrolls per code or per dim.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from turboquant.attention.kernels.dialects import (DIALECTS, HEADERS, PROLOGUE, SHORT, fill, pow2ceil, section, sections)
from turboquant.attention.kernels.merge import OUTPUTS2, Pass2, pass2_body
from turboquant.attention.kernels.query import Pass0, pass0_body
from turboquant.attention.kernels.ragged import Ragged

THREADS = 128  # pass 1 threadgroup size (4 SIMD groups)
MAX_SHIFT_BLOCKS = 18  # 256-token key-mean blocks one pass-1 block may touch
SHIFT_BLOCK = 256
MAX_SPAN = (MAX_SHIFT_BLOCKS - 2) * SHIFT_BLOCK  # tokens per pass-1 block: touches <= 17 key-mean blocks
KEY_FORMATS = ("native", "affine", "turbo")
VALUE_FORMATS = ("affine", "turbo")
NATIVE_DTYPES = ("float16", "bfloat16", "float32")
TURBO_BITS = (1, 2, 3, 4, 5)
# TurboQuant row norms as stored: "" is float32 (read as is), else converted from their raw bits
NORM_DTYPES = ("", "float16", "bfloat16")
AFFINE_BITS = (4, 8)
AFFINE_GROUPS = (32, 64, 128)
ROW_BUCKETS = (1, 2, 4, 8)
PASS1_FILE = "pass1.h"  # the body and the query staging
SIDES_FILE = "pass1_sides.h"  # the key and value sides


def rows_bucket(r: int) -> int:
    """Query rows one threadgroup serves (compile time): the next power of two, at most 8."""
    for b in ROW_BUCKETS:
        if r <= b:
            return b
    return ROW_BUCKETS[-1]


def lane_shape(d: int, rmax: int) -> tuple[int, int]:
    """(NS, G): sub-chunks of 8 dims per lane and lanes per token (a power of two <= 32).

    A lane keeps RMAX * 8 * NS query values and as many accumulators in registers, so NS
    shrinks as the row bucket grows; among the allowed NS the one with the least padding wins
    (ties: more dims per lane, fewer shuffles)."""
    nsub = d // 8
    best = None
    for ns in range(1, max(1, 4 // rmax) + 1):
        g = pow2ceil(-(-nsub // ns))
        if g > 32:
            continue
        key = (g * ns - nsub, -ns)
        if best is None or key < best[0]:
            best = (key, ns, g)
    if best is None:
        raise ValueError(f"head dim {d} needs more than 32 lanes per token")
    return best[1], best[2]


def packed_words(d: int, bits: int) -> int:
    return -(-d * bits // 32)


@dataclass(frozen=True)
class Pass1:
    """The structure of one pass-1 kernel (everything that changes its source)."""

    d: int
    key: str  # native | affine | turbo
    key_bits: int  # 0 for native keys
    key_group: int  # affine group size, else 0
    key_dtype: str  # native K dtype or affine K scale dtype; "" for turbo keys
    value: str  # affine | turbo
    value_bits: int
    value_group: int
    value_dtype: str  # affine V scale dtype; "" for turbo values
    rmax: int
    shifts: bool  # calibrated keys: add q . mean of each token's 256-token block
    unroll: int = 0  # tokens per group per iteration; 0 = by rmax
    ns: int = 0  # 0 = by lane_shape
    # "" : the query arrives transformed (pass 0's q_k, q_s in float32). A dtype: pass 1 reads the
    # raw query [B, Hq, 1, D] of that dtype through its strides and transforms it itself, so the
    # step needs no pass-0 kernel: q_k = q * pre[h] for keys without a rotation; for TurboQuant
    # keys (d a power of two, a Hadamard rotation) q_k = H(q * pre[h]) * post[h], with the
    # rotation's signs and 1/sqrt(d) folded into pre; q_s = q * cq.
    q_dtype: str = ""
    # TurboQuant row norms of the key / value side: "" float32, or "float16" / "bfloat16" (the
    # turbo5vN and autoB schemes store float16 norms); part of the source and the name.
    key_norm: str = ""
    value_norm: str = ""

    def __post_init__(self):
        check_pass1(self)

    @property
    def lanes(self) -> tuple[int, int]:
        ns, g = lane_shape(self.d, self.rmax)
        if self.ns:
            ns, g = self.ns, pow2ceil(-(-(self.d // 8) // self.ns))
        return ns, g

    @property
    def u(self) -> int:
        return self.unroll or (4 if self.rmax <= 2 else 2)

    @property
    def groups(self) -> int:
        """Token groups per threadgroup."""
        return THREADS // self.lanes[1]

    @property
    def step(self) -> int:
        """Tokens a threadgroup consumes per loop iteration."""
        return self.groups * self.u

    @property
    def name(self) -> str:
        def side(fmt, bits, group, dtype):
            s = f"{fmt[0]}{bits}"
            if fmt == "affine":
                s += f"g{group}"
            if dtype:
                s += "_" + {"float16": "f16", "bfloat16": "bf16", "float32": "f32"}[dtype]
            return s

        ns, g = self.lanes
        return (f"tq_decode1_{side(self.key, self.key_bits, self.key_group, self.key_dtype)}_"
                f"{side(self.value, self.value_bits, self.value_group, self.value_dtype)}_d{self.d}_r{self.rmax}"
                f"_n{ns}_u{self.u}_s{int(self.shifts)}{query_suffix(self)}{norm_suffix(self)}")

    def render(self, prologue: str) -> str:
        """The kernel body after `prologue` (the dialect's thread indices)."""
        return pass1_body(self, prologue)

    def header(self, dialect: str) -> str:
        return HEADERS[dialect]

    def input_names(self) -> list[str]:
        if self.q_dtype:
            names = ["params", "q_raw", "pre", "cq"] + (["post"] if self.key == "turbo" else [])
            names += ["mu"] if self.shifts else []
        else:
            names = ["params", "q_k"] + (["q_s", "mu"] if self.shifts else [])
        names += {"native": ["k_raw"], "affine": ["k_w", "k_s", "k_b"], "turbo": ["k_p", "k_n", "k_cb"]}[self.key]
        names += {"affine": ["v_w", "v_s", "v_b"], "turbo": ["v_p", "v_n", "v_cb"]}[self.value]
        return names


OUTPUTS1 = ["po", "pm", "pl"]


def check_pass1(v: Pass1) -> None:
    if v.d % 8 or not 8 <= v.d <= 256:
        raise ValueError(f"head dim must be a multiple of 8 in [8, 256], got {v.d}")
    if v.key not in KEY_FORMATS or v.value not in VALUE_FORMATS:
        raise ValueError(f"unsupported formats {v.key}/{v.value}")
    if v.rmax not in ROW_BUCKETS:
        raise ValueError(f"rmax must be one of {ROW_BUCKETS}")
    for fmt, bits, group, dtype in ((v.key, v.key_bits, v.key_group, v.key_dtype),
                                    (v.value, v.value_bits, v.value_group, v.value_dtype)):
        if fmt == "turbo" and (bits not in TURBO_BITS or dtype):
            raise ValueError(f"turbo side: bits {bits}, dtype {dtype!r}")
        if fmt == "affine" and (bits not in AFFINE_BITS or group not in AFFINE_GROUPS or v.d % group
                                or dtype not in NATIVE_DTYPES):
            raise ValueError(f"affine side: bits {bits}, group {group}, dtype {dtype!r}")
        if fmt == "native" and (bits or dtype not in NATIVE_DTYPES):
            raise ValueError(f"native side: bits {bits}, dtype {dtype!r}")
    if v.shifts and v.key == "native":
        raise ValueError("native keys carry no key means")
    check_norms(v)
    check_raw_query(v)
    ns, g = v.lanes
    if g > 32 or v.u < 1:
        raise ValueError("bad lane shape")


def check_raw_query(v: Pass1) -> None:
    """A raw query needs an activation dtype, and with TurboQuant keys a power-of-two head dim
    (the transform in pass 1 is a Hadamard butterfly)."""
    if v.q_dtype and (v.q_dtype not in NATIVE_DTYPES or (v.key == "turbo" and v.d & (v.d - 1))):
        raise ValueError(f"raw query of dtype {v.q_dtype!r} with {v.key} keys at d={v.d}")


def check_norms(v: Pass1) -> None:
    """Norm widths other than float32 only on TurboQuant sides, of a known dtype."""
    for fmt, norm in ((v.key, v.key_norm), (v.value, v.value_norm)):
        if norm not in NORM_DTYPES or (norm and fmt != "turbo"):
            raise ValueError(f"{fmt} side with norms {norm!r}")


def norm_suffix(v: Pass1) -> str:
    return "".join(f"_{x}n{SHORT[n]}" for x, n in (("k", v.key_norm), ("v", v.value_norm)) if n)


def norm_load(x: str, index: str, dtype: str) -> str:
    """C expression: the float norm of side `x` at element `index` of `x`_n, stored as `dtype`
    ("" float32; half widths are read as raw bits and converted, the same in every dialect)."""
    if not dtype:
        return f"{x}_n[{index}]"
    return _scale(f"(uint32_t)((const DEV uint16_t*){x}_n)[{index}]", dtype)


def query_suffix(v: Pass1) -> str:
    return f"_q{SHORT[v.q_dtype]}" if v.q_dtype else ""


def _raw_query(row: str, dim: str) -> str:
    return (f"static_cast<float>(q_raw[(int64_t)b * q_raw_strides[0] + (int64_t)(({row}) - b * H * R) * "
            f"q_raw_strides[1] + (int64_t)({dim}) * q_raw_strides[3]])")


def query_key(v: Pass1, row: str, dim: str) -> str:
    """C expression: element `dim` of query row `row` in the keys' basis (log2 units)."""
    if v.q_dtype:
        return f"({_raw_query(row, dim)} * pre[h * D + ({dim})])"
    return f"q_k[({row}) * D + ({dim})]"


def query_plain(v: Pass1, row: str, dim: str) -> str:
    """C expression: element `dim` of query row `row`, scaled only (the key means' query)."""
    if v.q_dtype:
        return f"({_raw_query(row, dim)} * cq[0])"
    return f"q_s[({row}) * D + ({dim})]"


def query_setup(v: Pass1) -> tuple[str, str]:
    """(threadgroup declarations, setup text) of the staged query rows `s_q4` (keys' basis), and
    with key means `s_qs4` (plain scaled) and `s_qmu` (q . mean per row and block). Every
    global load of the setup (key-mean rows, query, its rotation's channel factors) is issued
    before the first barrier: one round trip instead of one per step."""
    arrays = [("s_q4", query_key)] + ([("s_qs4", query_plain)] if v.shifts else [])
    shared = [f"TGMEM F4 {n}[RMAX * D / 4];" for n, _ in arrays]
    init, set_, store = [], [], []
    for k, (n, expr) in enumerate(arrays):
        init.append(f"  F4 x{k};\n" + "".join(f"  x{k}.{c} = 0.0f;\n" for c in "xyzw"))
        set_.append("".join(f"    x{k}.{c} = {expr(v, 'qrow0 + r', f'd + {j}')};\n"
                            for j, c in enumerate("xyzw")))
        store.append(f"    {n}[i] = x{k};")
    src = sections(PASS1_FILE)
    fused = bool(v.q_dtype) and v.key == "turbo"
    if fused:
        store[0] = src["fwht4"] + store[0]
    text = fill(src["query_stage"], INIT="".join(init).rstrip("\n"), SET="".join(set_).rstrip("\n"),
                STORE="\n".join(store), POST_DECL=src["post_decl"] if fused else "",
                POST_LOAD=src["post_load"] if fused else "")
    if fused:
        text += src["fwht_stages"]
    if v.shifts:
        shared.append("TGMEM float s_qmu[RMAX * MAXSB];")
        text = src["shift_loads"] + text + src["shift_pairs"]
    return "\n".join(shared), text


def _turbo_parts(side: str, bits: int, d: int, norm: str = "") -> dict[str, str]:
    """Setup / load code of a TurboQuant side (`k` or `v`): per lane, NS sub-chunks of 8 codes;
    sub-chunk sc starts at bit sc*8*bits of the row's LSB-first bit stream. `words` declares the
    sub-chunk's code words and `codes[i]` is code i's byte offset into the float codebook: at 5
    bits a sub-chunk is 40 bits from a byte-aligned start, so two words always hold it (codes
    0-5 in the funnel-shifted low word, 6-7 across its top bits and the next word)."""
    x = side
    pw = packed_words(d, bits)
    ncb = max(16, 1 << bits)
    shared = f"TGMEM float s_{x}cb[{ncb}];"
    setup_shared = f"if (tid < {ncb}) {{ s_{x}cb[tid] = {x}_cb[IMIN(tid, {(1 << bits) - 1})]; }}"
    setup = fill(section(SIDES_FILE, "turbo_setup"), X=x, CODE_BITS=8 * bits, LAST_WORD=pw - 1)
    # Buffers hold the raw words; shifts happen where the codes are used, so a prefetch is never
    # waited for before the next chunk.
    if bits in (3, 5):
        arrays = [("uint32_t", f"{x}c", "[U][NS][2]"), ("float", f"{x}nr", "[U]")]
        load = f"@@P@@{x}c[u][k][0] = p[{x}wi[k]]; @@P@@{x}c[u][k][1] = p[{x}wj[k]];"
        word = f"tq_funnel({x}c[u][k][0], {x}c[u][k][1], {x}sh[k])"
    else:
        arrays = [("uint32_t", f"{x}c", "[U][NS]"), ("float", f"{x}nr", "[U]")]
        load = f"@@P@@{x}c[u][k] = p[{x}wi[k]];"
        word = f"{x}c[u][k]" if bits == 4 else f"({x}c[u][k] >> {x}sh[k])"
    words = f"      const uint32_t cw = {word};"
    codes = [_code_offset("cw", i, bits) for i in range(8)]
    if bits == 5:
        words += f"\n      const uint32_t ch = (cw >> 30) | (({x}c[u][k][1] >> {x}sh[k]) << 2);"
        codes[6:] = [_code_offset("ch", i, bits) for i in range(2)]
    nload = norm_load(x, f"{x}nbase + (int64_t)@@TT@@[u] * {x}nts", norm)
    fill_ = fill(section(SIDES_FILE, "turbo_fill"), X=x, LOAD=load, NORM=nload)
    return {"shared": shared, "setup_shared": setup_shared, "setup": setup, "arrays": arrays, "fill": fill_,
            "words": words, "codes": codes}


def _code_offset(word: str, i: int, bits: int) -> str:
    """Byte offset into a float codebook of code i of `word`: ((word >> i*bits) & mask) * 4."""
    mask4 = ((1 << bits) - 1) << 2
    sh = i * bits - 2
    if sh < 0:
        return f"(({word} << {-sh}) & {mask4}u)"
    if sh == 0:
        return f"({word} & {mask4}u)"
    return f"(({word} >> {sh}) & {mask4}u)"


def _affine_parts(side: str, bits: int, group: int, d: int, dtype: str) -> dict[str, str]:
    x = side
    words_per_sub = bits // 4  # 8 codes: 2 words at 8 bits, 1 word at 4 bits
    setup = fill(section(SIDES_FILE, "affine_setup"), X=x, WORDS=words_per_sub, GROUP=group)
    if bits == 8:
        wload = fill(section(SIDES_FILE, "affine_load8"), X=x)
    else:
        wload = f"      @@P@@{x}c[u][k][0] = p[{x}wi[k]];"
    arrays = [("uint32_t", f"{x}c", f"[U][NS][{words_per_sub}]"), ("uint32_t", f"{x}sc", "[U][NS]"),
              ("uint32_t", f"{x}bi", "[U][NS]")]
    raw_t = "uint32_t" if dtype == "float32" else "uint16_t"
    fill_ = fill(section(SIDES_FILE, "affine_fill"), X=x, WLOAD=wload, RAW_T=raw_t)
    return {"setup": setup, "arrays": arrays, "fill": fill_}


def _scale(raw: str, dtype: str) -> str:
    """A float from the raw bits of an affine scale or bias."""
    if dtype == "float32":
        return f"AS_FLOAT({raw})"
    if dtype == "bfloat16":
        return f"AS_FLOAT({raw} << 16)"
    return f"tq_half({raw})"


def _affine_code(x: str, i: int, bits: int) -> str:
    """Code i (0..7) of the current sub-chunk as an exact float (magic-number conversion)."""
    if bits == 8:
        word, sh = f"{x}c[u][k][{i // 4}]", 8 * (i % 4)
        mask = 0xFF
    else:
        word, sh = f"{x}c[u][k][0]", 4 * i
        mask = 0xF
    shifted = word if sh == 0 else f"({word} >> {sh})"
    return f"(AS_FLOAT(0x4B000000u | ({shifted} & {mask}u)) - 8388608.0f)"


def _key_parts(v: Pass1) -> dict[str, str]:
    if v.key == "turbo":
        p = _turbo_parts("k", v.key_bits, v.d, v.key_norm)
        lines = ["    float acc[RMAX];",
                 "#pragma unroll",
                 "    for (int r = 0; r < RMAX; ++r) { acc[r] = 0.0f; }",
                 "#pragma unroll",
                 "    for (int k = 0; k < NS; ++k) {",
                 p["words"]]
        for i in range(8):
            lines.append(f"      {{ const float c = CBLOOK(s_kcb, {p['codes'][i]});")
            lines.append("#pragma unroll")
            lines.append(f"        for (int r = 0; r < RMAX; ++r) {{ acc[r] += q[r][k * 8 + {i}] * c; }} }}")
        lines += ["    }",
                  "#pragma unroll",
                  "    for (int r = 0; r < RMAX; ++r) { s[u][r] = acc[r]; }"]
        return {**p, "score": "\n".join(lines), "finish": "      x *= knr[u];"}
    if v.key == "affine":
        p = _affine_parts("k", v.key_bits, v.key_group, v.d, v.key_dtype)
        setup = p["setup"] + section(SIDES_FILE, "affine_key_qsum")
        lines = ["    float acc[RMAX];",
                 "#pragma unroll",
                 "    for (int r = 0; r < RMAX; ++r) { acc[r] = 0.0f; }",
                 "#pragma unroll",
                 "    for (int k = 0; k < NS; ++k) {",
                 "      float dot[RMAX];",
                 "#pragma unroll",
                 "      for (int r = 0; r < RMAX; ++r) { dot[r] = 0.0f; }"]
        for i in range(8):
            lines.append(f"      {{ const float c = {_affine_code('k', i, v.key_bits)};")
            lines.append("#pragma unroll")
            lines.append(f"        for (int r = 0; r < RMAX; ++r) {{ dot[r] += q[r][k * 8 + {i}] * c; }} }}")
        lines += ["      const float sk = " + _scale("ksc[u][k]", v.key_dtype) + ";",
                  "      const float bk = " + _scale("kbi[u][k]", v.key_dtype) + ";",
                  "#pragma unroll",
                  "      for (int r = 0; r < RMAX; ++r) { acc[r] += sk * dot[r] + bk * qsum[r][k]; }",
                  "    }",
                  "#pragma unroll",
                  "    for (int r = 0; r < RMAX; ++r) { s[u][r] = acc[r]; }"]
        return {"shared": "", "setup_shared": "", "setup": setup, "arrays": p["arrays"], "fill": p["fill"],
                "score": "\n".join(lines), "finish": ""}
    # native keys: 8 contiguous elements per sub-chunk
    dt = v.key_dtype
    setup = section(SIDES_FILE, "native_setup")
    if dt == "float32":
        fill_ = section(SIDES_FILE, "native_fill_float32")
        arrays = [("float", "kx", "[U][NS][8]")]
    else:
        # keep the raw words (half the registers); convert when scoring
        fill_ = section(SIDES_FILE, "native_fill_half")
        arrays = [("uint32_t", "kh", "[U][NS][4]")]
    if dt == "float32":
        conv = ""
    elif dt == "float16":
        conv = "\n".join(f"      tq_h2(kh[u][k][{j}], kx[{2 * j}], kx[{2 * j + 1}]);" for j in range(4))
    else:  # bfloat16: the high half of a float32
        conv = "\n".join(f"      kx[{2 * j}] = AS_FLOAT(kh[u][k][{j}] << 16); "
                         f"kx[{2 * j + 1}] = AS_FLOAT(kh[u][k][{j}] & 0xffff0000u);" for j in range(4))
    elem = "kx[u][k][i]" if dt == "float32" else "kx[i]"
    decl = "" if dt == "float32" else "      float kx[8];\n"
    score = fill(section(SIDES_FILE, "native_score"), DECL=decl, CONV=conv, ELEM=elem)
    return {"shared": "", "setup_shared": "", "setup": setup, "arrays": arrays, "fill": fill_, "score": score,
            "finish": ""}


def _value_parts(v: Pass1) -> dict[str, str]:
    if v.value == "turbo":
        p = _turbo_parts("v", v.value_bits, v.d, v.value_norm)
        lines = ["#pragma unroll",
                 "    for (int r = 0; r < RMAX; ++r) { w[u][r] *= vnr[u]; }",
                 "#pragma unroll",
                 "    for (int k = 0; k < NS; ++k) {",
                 p["words"]]
        for i in range(8):
            lines.append(f"      {{ const float c = CBLOOK(s_vcb, {p['codes'][i]});")
            lines.append("#pragma unroll")
            lines.append(f"        for (int r = 0; r < RMAX; ++r) {{ o[r][k * 8 + {i}] += w[u][r] * c; }} }}")
        lines.append("    }")
        return {**p, "state": "", "rescale": "", "accum": "\n".join(lines), "out": "o[r][k * 8 + i]"}
    p = _affine_parts("v", v.value_bits, v.value_group, v.d, v.value_dtype)
    # element = scale * code + bias: sum_t p*scale*code per dim, and sum_t p*bias once per sub-chunk
    state = section(SIDES_FILE, "affine_value_state")
    rescale = section(SIDES_FILE, "affine_value_rescale")
    lines = ["#pragma unroll",
             "    for (int k = 0; k < NS; ++k) {",
             "      float ws[RMAX];",
             "#pragma unroll",
             "      const float sv = " + _scale("vsc[u][k]", v.value_dtype) + ";",
             "      const float bv = " + _scale("vbi[u][k]", v.value_dtype) + ";",
             "#pragma unroll",
             "      for (int r = 0; r < RMAX; ++r) { ws[r] = w[u][r] * sv; ob[r][k] += w[u][r] * bv; }"]
    for i in range(8):
        lines.append(f"      {{ const float c = {_affine_code('v', i, v.value_bits)};")
        lines.append("#pragma unroll")
        lines.append(f"        for (int r = 0; r < RMAX; ++r) {{ o[r][k * 8 + {i}] += ws[r] * c; }} }}")
    lines.append("    }")
    return {"shared": "", "setup_shared": "", "setup": p["setup"], "arrays": p["arrays"], "fill": p["fill"],
            "state": state,
            "rescale": rescale, "accum": "\n".join(lines), "out": "o[r][k * 8 + i] + ob[r][k]"}


def pass1_body(v: Pass1, prologue: str) -> str:
    ns, g = v.lanes
    kp, vp = _key_parts(v), _value_parts(v)
    shared = [kp["shared"], vp["shared"]]
    q_shared, q_setup = query_setup(v)
    shared.append(q_shared)
    setup_shared = [q_setup, kp["setup_shared"], vp["setup_shared"]]
    src = sections(PASS1_FILE)
    finish = kp["finish"] + ("\n" + src["shift_finish"] if v.shifts else "")

    def decl(parts, prefix):
        return "\n".join(f"  {t} {prefix}{n}{dims};" for t, n, dims in parts["arrays"])

    def filled(parts, prefix, tt):
        return fill(parts["fill"], P=prefix, TT=tt)

    def copy(parts):
        lines = []
        for _, n, dims in parts["arrays"]:
            sizes = re.findall(r"\[(\w+)\]", dims)
            idx = "".join(f"[i{j}]" for j in range(len(sizes)))
            loops = "".join(f"#pragma unroll\n  for (int i{j} = 0; i{j} < {n_}; ++i{j})\n"
                            for j, n_ in enumerate(sizes))
            lines.append(f"{loops}    {n}{idx} = n_{n}{idx};")
        return "\n".join(lines)

    body = fill(
        src["pass1"],
        PROLOGUE=prologue, BLOCK=src["block"], D=v.d, RMAX=v.rmax, NS=ns, G=g, NT=THREADS, U=v.u,
        MAXSB=MAX_SHIFT_BLOCKS,
        SHARED="\n".join(s for s in shared if s), SETUP_SHARED="\n".join(s for s in setup_shared if s),
        KEY_SETUP=kp["setup"], VALUE_SETUP=vp["setup"], VALUE_STATE=vp["state"],
        KEY_DECL=decl(kp, ""), VALUE_DECL=decl(vp, ""), KEY_FILL=filled(kp, "", "tt"),
        VALUE_FILL=filled(vp, "", "tt"), KEY_NDECL=decl(kp, "n_"), VALUE_NDECL=decl(vp, "n_"),
        KEY_NFILL=filled(kp, "n_", "ntt"), VALUE_NFILL=filled(vp, "n_", "ntt"), KEY_COPY=copy(kp),
        VALUE_COPY=copy(vp), KEY_SCORE=kp["score"], KEY_FINISH=finish,
        VALUE_RESCALE=vp["rescale"], VALUE_ACCUM=vp["accum"], VALUE_OUT=vp["out"],
    )
    return body


def body(v: Pass0 | Pass1 | Pass2 | Ragged, prologue: str) -> str:
    if isinstance(v, Pass0):
        return pass0_body(v, prologue)
    return v.render(prologue) if isinstance(v, (Pass1, Ragged)) else pass2_body(v, prologue)


def source(v: Pass0 | Pass1 | Pass2 | Ragged, dialect: str) -> tuple[str, str]:
    if dialect not in DIALECTS:
        raise ValueError(f"dialect must be one of {DIALECTS}")
    header = v.header(dialect) if isinstance(v, Pass1) else HEADERS[dialect]
    return header, body(v, PROLOGUE[dialect])


def output_names(v: Pass0 | Pass1 | Pass2 | Ragged) -> list[str]:
    if isinstance(v, (Pass0, Ragged)):
        return v.output_names()
    return OUTPUTS1 if isinstance(v, Pass1) else OUTPUTS2
