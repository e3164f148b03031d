"""Pass 1 on the tensor cores (CUDA): the same contract as `template.Pass1`, other arithmetic.

The CUDA-core pass 1 spends most of its instructions on float32 FMAs, lane reductions and a
softmax repeated in every lane of a token, and streams packed rows at under 1 TB/s. Here each
warp takes 16 tokens at a time and lets `mma.sync.m16n8k16` (fp16 inputs, float32 accumulation)
do the products, with the tokens on the MMA's 16-row side and up to 8 query rows of a KV head on
its 8-column side (so no MMA work is padding at GQA 8, and a larger ratio reads K/V once per 8
rows):

- scores S^T[tokens x rows] = K Q^T: each lane decodes a quarter of the dims of two tokens'
  K rows straight into A fragments (dims are permuted within the dot product so that a lane's
  quarter is one contiguous run of the packed row); the query, in fp16, is the B operand;
- online softmax in float32 on the score fragments (a row's 16 scores live in 8 lanes);
- out^T[dims x rows] += V^T P^T: each lane decodes one eighth of the dims of four tokens'
  value rows into A fragments; the probabilities times each token's value norm are gathered
  into B fragments with four shuffles; values accumulate in the rotated basis.

The warps of a threadgroup merge in threadgroup memory and write (o, m, l) per (row, block)
exactly like `template.Pass1`, so pass 2 is shared. The query, the dequantized K and V elements
and the probabilities are rounded to fp16 before their products (relative error at most 2^-11
each, accumulated in float32): this path serves fp16/bf16 activations, whose outputs are
rounded as coarsely; float32 activations keep the CUDA-core kernel. Metal has no `mma.sync`; it
keeps `template.Pass1`.

The kernel text is `src/pass1_mma.cuh` (the tensor-core helpers and the body); this module fills
its markers and unrolls the per-step fragment code.
"""

from __future__ import annotations

from dataclasses import dataclass

from turboquant.attention.kernels.dialects import HEADERS, MARK, fill, section
from turboquant.attention.kernels.template import (MAX_SHIFT_BLOCKS, PASS1_FILE, THREADS, Pass1, _scale, check_norms, check_raw_query, norm_load, norm_suffix, packed_words, query_setup, query_suffix)

MMA_ROWS = 8  # query rows of one row tile: the MMA's N dimension
# Row tiles a threadgroup serves (rmax = 8 * tiles): each K/V element a warp decodes feeds every
# tile's MMAs, so a question's R * L rows read the stored K/V once per 8 * tiles rows. Two tiles
# hold 64 more accumulator registers a lane and twice the query and merge staging, so they are
# built for head dims up to 128 (more would pass CUDA's 48 KB of static threadgroup memory).
MMA_TILES = (1, 2)
MAX_TILED_D = 128
MMA_KEY_BITS = (1, 2, 3, 4, 5)  # TurboQuant keys: a pair table of 2^(2 * bits) entries (16 KB at 5 bits)
MMA_VALUE_BITS = (1, 2, 3, 4)
MMA_FILE = "pass1_mma.cuh"


@dataclass(frozen=True)
class MmaPass1(Pass1):
    """A tensor-core pass-1 variant (same inputs and outputs as `Pass1`). `prefetch`: how many
    chunks ahead a warp loads its rows while the current one is used (0, 1 or 2; True is 1):
    more bytes in flight for more registers. `spread`: pair tables in several interleaved copies
    (`table_copies`), fewer shared-memory bank conflicts for more threadgroup memory."""

    prefetch: int = 1
    spread: bool = True

    def __post_init__(self):
        if self.d % 16 or not 16 <= self.d <= 256:
            raise ValueError(f"head dim must be a multiple of 16 in [16, 256], got {self.d}")
        if self.key not in ("turbo", "affine") or self.value != "turbo":
            raise ValueError(f"no tensor-core kernel for {self.key}/{self.value}")
        if self.rmax not in tuple(MMA_ROWS * t for t in MMA_TILES) or (self.rmax > MMA_ROWS and self.d > MAX_TILED_D):
            raise ValueError(f"rmax {self.rmax} at d={self.d}")
        if self.key == "turbo" and self.key_bits not in MMA_KEY_BITS:
            raise ValueError(f"turbo key bits {self.key_bits}")
        if self.key == "affine" and (self.key_bits not in (4, 8) or self.key_dtype not in
                                     ("float16", "bfloat16", "float32") or self.d % self.key_group):
            raise ValueError(f"affine key bits {self.key_bits}, group {self.key_group}, dtype {self.key_dtype!r}")
        if self.value_bits not in MMA_VALUE_BITS:
            raise ValueError(f"turbo value bits {self.value_bits}")
        check_norms(self)
        check_raw_query(self)
        if int(self.prefetch) not in (0, 1, 2):
            raise ValueError(f"prefetch depth {self.prefetch}")

    @property
    def name(self) -> str:
        k = f"t{self.key_bits}" if self.key == "turbo" else f"a{self.key_bits}g{self.key_group}_{self.key_dtype}"
        return (f"tq_decode1mma_{k}_t{self.value_bits}_d{self.d}_r{self.rmax}_s{int(self.shifts)}"
                f"_p{int(self.prefetch)}{'' if self.spread else '_c1'}{query_suffix(self)}{norm_suffix(self)}")

    def render(self, prologue: str) -> str:
        return mma_body(self, prologue)

    def header(self, dialect: str) -> str:
        if dialect != "cuda":
            raise ValueError("the tensor-core pass 1 exists for CUDA only")
        return HEADERS["cuda"] + section(MMA_FILE, "header")


# A lane's value/score token k of chunk `bb` (tokens past the block's end read t_begin).
_VTOK = "(bb + {off} < t_end ? bb + {off} : t_begin)"


def _field(words: str, pos: int, width: int, nwords: int, dest: int = 0) -> str:
    """Bits [pos, pos + width) of the aligned word run `words[0..nwords)`, placed at bit `dest`
    (compile-time positions; a funnel shift when the field crosses a word)."""
    i, off = pos >> 5, pos & 31
    mask = ((1 << width) - 1) << dest
    if off + width <= 32 or i + 1 >= nwords:
        word = f"{words}[{i}]"
    elif off >= dest:  # the funnel shift lands the field at `dest`; the mask drops what is below
        return f"(tq_funnel({words}[{i}], {words}[{i + 1}], {off - dest}u) & {mask}u)"
    else:
        word, off = f"tq_funnel({words}[{i}], {words}[{i + 1}], {off}u)", 0
    shift = off - dest
    if shift > 0:
        return f"(({word} >> {shift}) & {mask}u)"
    if shift < 0:
        return f"(({word} << {-shift}) & {mask}u)"
    return f"({word} & {mask}u)"


# Threadgroup words one spread pair table may take at d <= 128 (16 KB; half that at d = 256, whose
# query and output staging take twice as much): both tables and the rest stay under the 48 KB of
# static threadgroup memory a kernel may declare.
PAIR_TABLE_WORDS = 4096


def table_copies(bits: int, d: int, spread: bool, tiles: int = 1) -> int:
    """Copies of a `bits`-bit pair table: with `spread`, as many as fit the word budget (at most
    32, one per bank; the budget shrinks with the row tiles, whose staging takes the room), else 1."""
    words = PAIR_TABLE_WORDS * 128 // max(d, 128) // tiles
    return max(1, min(32, words >> (2 * bits))) if spread else 1


def _pair_table(x: str, bits: int, copies: int) -> tuple[str, str, str, str]:
    """A table of half2 pairs (c[i & mask], c[i >> bits]) for every two codes: one lookup
    decodes two elements into a fragment register. Lanes index random entries, so one table
    serves a warp's lookup in several bank wavefronts (the tensor-core pass 1 of turbo4 ran with
    the L1/shared pipe 74% busy); `copies` interleaved copies, lane l reading copy l % copies,
    spread the lanes over the banks. Returns (declaration, early codebook loads, fill, the lane's
    table address).

    A thread stores the copies of the same few entries, so it loads their codes once, at the
    kernel's start (the fill used to reload the codebook for every word, a chain of round trips
    in the setup every threadgroup waits for)."""
    n = 1 << (2 * bits)
    total = n * copies
    per = max(1, n // THREADS)  # distinct entries a thread stores: (tid + u * NT) % n, u < per
    shared = f"TGMEM uint32_t s_{x}pair[{total}];"
    early = (f"uint32_t {x}pv[{per}];\n#pragma unroll\nfor (int u = 0; u < {per}; ++u) {{\n"
             f"  const int e = (tid + u * NT) & {n - 1};\n"
             f"  {x}pv[u] = tq_pack_h2({x}_cb[e & {(1 << bits) - 1}], {x}_cb[e >> {bits}]);\n}}")
    # word i of the fill is copy slot (k + e) % copies of entry e = i % n, k = i / n: every slot
    # of an entry once, consecutive lanes on consecutive entries (at most 2-way bank conflicts)
    guard = "" if total % THREADS == 0 else f"if (i < {total}) "
    setup = (f"#pragma unroll\nfor (int m = 0; m < {-(-total // THREADS)}; ++m) {{\n"
             f"  const int i = tid + m * NT;\n"
             f"  {guard}s_{x}pair[(i & {n - 1}) * {copies} + (((i >> {2 * bits}) + (i & {n - 1})) & {copies - 1})] = "
             f"{x}pv[m % {per}];\n}}")
    lane_table = f"LANE_TABLE s_{x}lane = tq_lane_table(s_{x}pair, (uint32_t)(lane & {copies - 1}) * 4u);"
    return shared, early, setup, lane_table


def vector_width(words: int, row_words: int) -> int:
    """Widest load (4, 2 or 1 words) that keeps a lane's run of `words` words aligned when rows
    are `row_words` apart."""
    for w in (4, 2):
        if words % w == 0 and row_words % w == 0:
            return w
    return 1


def _run_loader(arr: str, row: str, n: int, vec: int) -> list[str]:
    lines = []
    for j in range(0, n, vec):
        if vec == 4:
            lines.append(f"  {{ const U4 w = *(const DEV U4*)({row} + {j}); {arr}[{j}] = w.x; "
                         f"{arr}[{j + 1}] = w.y; {arr}[{j + 2}] = w.z; {arr}[{j + 3}] = w.w; }}")
        elif vec == 2:
            lines.append(f"  {{ const U2 w = *(const DEV U2*)({row} + {j}); {arr}[{j}] = w.x; "
                         f"{arr}[{j + 1}] = w.y; }}")
        else:
            lines.append(f"  {arr}[{j}] = {row}[{j}];")
    return lines


def run_words(chunk_bits: int) -> int:
    return -(-chunk_bits // 32)


def _chunk_loader(x: str, arr: str, chunk_bits: int, bits: int, d: int, index: str, token: str) -> str:
    """Code loading the `chunk_bits` bits that start at bit index*chunk_bits of a token's packed
    row into `arr` as an aligned word run (a funnel shift when the start is not aligned)."""
    pw = packed_words(d, bits)
    n = run_words(chunk_bits)
    lines = ["{"]
    if chunk_bits % 32 == 0:
        lines.append(f"  const DEV uint32_t* row = {x}_p + {x}base + (int64_t)({token}) * {x}ts + {index} * {n};")
        lines += _run_loader(arr, "row", n, vector_width(n, pw))
    else:
        lines += [f"  const int bit0 = {index} * {chunk_bits};",
                  "  const int w0 = bit0 >> 5;",
                  "  const uint32_t sh = (uint32_t)(bit0 & 31);",
                  f"  const DEV uint32_t* row = {x}_p + {x}base + (int64_t)({token}) * {x}ts;",
                  f"  uint32_t raw[{n + 1}];"]
        for j in range(n + 1):
            lines.append(f"  raw[{j}] = row[IMIN(w0 + {j}, {pw - 1})];")
        for j in range(n):
            lines.append(f"  {arr}[{j}] = tq_funnel(raw[{j}], raw[{j + 1}], sh);")
    lines.append("}")
    return "\n".join(lines)


def tiles(v: MmaPass1) -> int:
    return v.rmax // MMA_ROWS


def _turbo_side(x: str, bits: int, copies: int) -> tuple[str, str, str, str]:
    shared, early, setup_shared, lane_table = _pair_table(x, bits, copies)
    setup = lane_table + fill(section(MMA_FILE, "turbo_setup"), X=x)
    return shared, early, setup_shared, setup


def _score_step(s: int, pair) -> str:
    """k-step s of the score MMA; pair(tt, i) is run dims i, i+1 of token g + 8*tt as a half2."""
    frag = [pair(0, 4 * s), pair(1, 4 * s), pair(0, 4 * s + 2), pair(1, 4 * s + 2)]
    acc = f"sc{s % 2}"  # two accumulator chains (even and odd steps) halve the MMA dependency chain
    return ("  {\n" + "".join(f"    const uint32_t a{i} = {f};\n" for i, f in enumerate(frag))
            + "#pragma unroll\n    for (int q = 0; q < NQ; ++q) {\n"
            + f"      tq_mma({acc}[q], a0, a1, a2, a3, qh[q][{s}][0], qh[q][{s}][1]);\n    }}\n  }}")


def _scale_load(arr: str, base: str, ts: str, token: str, index: str, dtype: str) -> str:
    raw_t = "uint32_t" if dtype == "float32" else "uint16_t"
    return _scale(f"(uint32_t)((const DEV {raw_t}*){arr})[{base} + (int64_t)({token}) * {ts} + {index}]", dtype)


def _vtok(k: int) -> str:
    return _VTOK.format(off=f"{8 * (k >> 1) + (k & 1)} + 2 * c")


def _ktok(nt: int) -> str:
    return f"(bb + {8 * nt} + g < t_end ? bb + {8 * nt} + g : t_begin)"


class _Buffers:
    """Per-chunk registers (declared twice: current and next) and the code that fills them."""

    def __init__(self):
        self.decls: list[tuple[str, str, str]] = []  # (type, name, dims)
        self.fill: list[str] = []

    def declare(self, kind: str, name: str, dims: str) -> None:
        self.decls.append((kind, name, dims))

    def text(self, prefix: str) -> tuple[str, str]:
        decl = "\n".join(f"{t} {prefix}{n}{d};" for t, n, d in self.decls)
        fill = "\n".join(self.fill)
        for _, n, _ in self.decls:
            fill = fill.replace(f"@{n}@", prefix + n)
        return decl, fill

    def copy(self, dst: str, src: str) -> str:
        """Code moving every buffer `src` + name into `dst` + name."""
        lines = []
        for _, n, dims in self.decls:
            sizes = dims.strip("[]").split("][")
            idx = "".join(f"[i{j}]" for j in range(len(sizes)))
            loops = "".join(f"#pragma unroll\n  for (int i{j} = 0; i{j} < {s}; ++i{j})\n" for j, s in enumerate(sizes))
            lines.append(f"{loops}    {dst}{n}{idx} = {src}{n}{idx};")
        return "\n".join(lines)


def _key_parts(v: MmaPass1, buf: _Buffers) -> dict[str, str]:
    """Key side: a lane's run of its token's row per n-tile, the k-steps, the score finish."""
    ck = v.d // 4  # dims per lane: k-step s takes run dims 4s..4s+3
    if v.key == "turbo":
        copies = table_copies(v.key_bits, v.d, v.spread, tiles(v))
        shared, early, setup_shared, setup = _turbo_side("k", v.key_bits, copies)
        dest = 2 + copies.bit_length() - 1
        n = run_words(ck * v.key_bits)
        buf.declare("uint32_t", "kw", f"[2][{n}]")
        buf.declare("float", "kn", "[2]")
        for tt in range(2):
            buf.fill.append(_chunk_loader("k", f"@kw@[{tt}]", ck * v.key_bits, v.key_bits, v.d, "c", _ktok(tt)))
            buf.fill.append(f"@kn@[{tt}] = {norm_load('k', f'knbase + (int64_t){_ktok(tt)} * knts', v.key_norm)};")

        def pair(tt, i):  # two adjacent codes are one 2*bits field: one table lookup
            field = _field(f'kw[{tt}]', i * v.key_bits, 2 * v.key_bits, n, dest)
            return f"tq_pairlook(s_klane, {field})"

        steps = [_score_step(s, pair) for s in range(v.d // 16)]
        return {"shared": shared, "early": early, "setup_shared": setup_shared, "setup": setup, "steps": "\n".join(steps),
                "finish": "      y *= kn[tt];"}
    # affine keys: scale * code + bias, rounded to fp16 in the A fragment
    bits, group = v.key_bits, v.key_group
    setup = fill(section(MMA_FILE, "affine_setup"), GROUP=group)
    n = ck * bits // 32
    ngr = -(-ck // group) + (0 if group % ck == 0 or ck % group == 0 else 1)  # groups a run touches
    # 8-bit codes with fp16 scales: codes become exact fp16 pairs by byte permutation and one fp16
    # FMA pair applies scale and bias (one rounding, as the float path's final conversion)
    half = bits == 8 and v.key_dtype == "float16"
    buf.declare("uint32_t", "kw", f"[2][{n}]")
    if half:
        buf.declare("uint32_t", "ks2", f"[2][{ngr}]")
        buf.declare("uint32_t", "kb2", f"[2][{ngr}]")
    else:
        buf.declare("float", "ksc", f"[2][{ngr}]")
        buf.declare("float", "kbi", f"[2][{ngr}]")
    for tt in range(2):
        tok = _ktok(tt)
        lines = ["{", f"  const DEV uint32_t* row = k_w + kbase + (int64_t)({tok}) * kts + c * {n};"]
        lines += _run_loader(f"@kw@[{tt}]", "row", n, vector_width(n, v.d * bits // 32))
        for j in range(ngr):
            gi = f"IMIN(kg0 + {j}, {v.d // group - 1})"
            if half:
                for arr, name, base, ts in (("k_s", "ks2", "ksbase", "ksts"), ("k_b", "kb2", "kbbase", "kbts")):
                    raw = f"(uint32_t)((const DEV uint16_t*){arr})[{base} + (int64_t)({tok}) * {ts} + {gi}]"
                    lines.append(f"  @{name}@[{tt}][{j}] = {raw} * 0x10001u;")
            else:
                lines.append(f"  @ksc@[{tt}][{j}] = {_scale_load('k_s', 'ksbase', 'ksts', tok, gi, v.key_dtype)};")
                lines.append(f"  @kbi@[{tt}][{j}] = {_scale_load('k_b', 'kbbase', 'kbts', tok, gi, v.key_dtype)};")
        lines.append("}")
        buf.fill.append("\n".join(lines))

    def gj(i):  # the 4 dims of a k-step share a group (group sizes are multiples of 4)
        return "0" if ngr == 1 else f"(c * {ck} + {i}) / {group} - kg0"

    def e(tt, i):
        code = _field(f"kw[{tt}]", i * bits, bits, n)
        return f"((AS_FLOAT(0x4B000000u | {code}) - 8388608.0f) * ksc[{tt}][{gj(i)}] + kbi[{tt}][{gj(i)}])"

    def pair(tt, i):
        if half:  # bytes i, i+1 of word i/4 as exact fp16 codes, then one fp16 FMA pair
            sel = "0x4140u" if i % 4 == 0 else "0x4342u"
            return f"tq_affine8_h2(kw[{tt}][{i // 4}], {sel}, ks2[{tt}][{gj(i)}], kb2[{tt}][{gj(i)}])"
        return f"tq_pack_h2({e(tt, i)}, {e(tt, i + 1)})"

    steps = [_score_step(s, pair) for s in range(v.d // 16)]
    return {"shared": "", "early": "", "setup_shared": "", "setup": setup, "steps": "\n".join(steps), "finish": ""}


def _value_parts(v: MmaPass1, buf: _Buffers) -> dict[str, str]:
    """Value side: a lane loads dims g*CV.. of its 4 tokens' rows; n-tile j takes run dim j."""
    cv = v.d // 8
    bits = v.value_bits
    copies = table_copies(bits, v.d, v.spread, tiles(v))
    dest = 2 + copies.bit_length() - 1
    shared, early, setup_shared, setup = _turbo_side("v", bits, copies)
    n = run_words(cv * bits)
    buf.declare("uint32_t", "vw", f"[4][{n}]")
    buf.declare("float", "vn", "[2]")
    for k in range(4):
        buf.fill.append(_chunk_loader("v", f"@vw@[{k}]", cv * bits, bits, v.d, "g", _vtok(k)))
    for tt in range(2):
        buf.fill.append(f"@vn@[{tt}] = {norm_load('v', f'vnbase + (int64_t){_ktok(tt)} * vnts', v.value_norm)};")

    def pair(k0, k1, i):  # run dim i of two tokens: their codes side by side index the pair table
        fields = [_field(f'vw[{k0}]', i * bits, bits, n, dest), _field(f'vw[{k1}]', i * bits, bits, n, dest + bits)]
        return f"tq_pairlook(s_vlane, {' | '.join(fields)})"

    steps = []
    for j in range(v.d // 16):
        frag = [pair(0, 1, 2 * j), pair(0, 1, 2 * j + 1), pair(2, 3, 2 * j), pair(2, 3, 2 * j + 1)]
        steps.append("  {\n" + "".join(f"    const uint32_t a{i} = {f};\n" for i, f in enumerate(frag))
                     + "#pragma unroll\n    for (int q = 0; q < NQ; ++q) {\n"
                     + f"      tq_mma(o[q][{j}], a0, a1, a2, a3, pb0[q], pb1[q]);\n    }}\n  }}")
    return {"shared": shared, "early": early, "setup_shared": setup_shared, "setup": setup, "steps": "\n".join(steps)}


def mma_body(v: MmaPass1, prologue: str) -> str:
    buf = _Buffers()
    kp, vp = _key_parts(v, buf), _value_parts(v, buf)
    shared = [kp["shared"], vp["shared"]]
    q_shared, q_setup = query_setup(v)
    shared.append(q_shared)
    setup_shared = [q_setup, kp["setup_shared"], vp["setup_shared"]]
    finish = kp["finish"] + ("\n" + section(MMA_FILE, "shift_finish") if v.shifts else "")
    decl, fill_cur = buf.text("")
    depth = int(v.prefetch)
    # A ring of `depth` chunks in flight: the loop body loads chunk +depth, uses the current one,
    # then shifts the ring down by one (register moves).
    ndecl, pre, copy = "", "", ""
    top = "    const int bb = base;\n" + fill_cur
    if depth:
        prefixes = [""] + ["n" * k + "_" for k in range(1, depth + 1)]
        fills = [fill_cur] + [buf.text(p)[1] for p in prefixes[1:]]
        ndecl = "\n".join(buf.text(p)[0] for p in prefixes[1:])
        pre = "\n".join(f"{{\n  const int bb = base + {k} * NW * 16;\n{fills[k]}\n}}" for k in range(depth))
        top = f"    const int bb = base + {depth} * NW * 16;\n" + fills[depth]
        copy = "\n".join(buf.copy(prefixes[k], prefixes[k + 1]) for k in range(depth))
    text = fill(section(MMA_FILE, "body"), PROLOGUE=prologue, BLOCK=section(PASS1_FILE, "block"), D=v.d, NT=THREADS,
                NQ=tiles(v),
                MAXSB=MAX_SHIFT_BLOCKS,
                SHARED="\n".join(s for s in shared if s), SETUP_SHARED="\n".join(s for s in setup_shared if s),
                EARLY="\n".join(x for x in (kp["early"], vp["early"]) if x), KEY_SETUP=kp["setup"], VALUE_SETUP=vp["setup"], DECL=decl, NDECL=ndecl, PRE=pre, TOP=top,
                KEY_STEPS=kp["steps"], KEY_FINISH=finish, VALUE_STEPS=vp["steps"], COPY=copy)
    assert MARK not in text
    return text
