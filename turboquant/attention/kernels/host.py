"""Host side of the fused decode: which kernel fits a layer, its inputs, its launch.

Shared by both backends; `cuda.py` and `metal.py` only say how a kernel object is built.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Callable

import mlx.core as mx

from turboquant.codec.rotation import Rotation, RotationKind
from turboquant.codec.sides import SHIFT_BLOCK, AffineSide, NativeSide, TurboSide
from turboquant.environment import setting
from turboquant.memo import once
from turboquant.attention.kernels.merge import MAX_BLOCKS, Pass2
from turboquant.attention.kernels.mma import MAX_TILED_D, MMA_ROWS, MmaPass1
from turboquant.attention.kernels.query import Pass0
from turboquant.attention.kernels.template import MAX_SPAN, OUTPUTS1, THREADS, Pass1, rows_bucket

LOG2E = 1.4426950408889634
MIN_SPAN = 64  # fewest tokens per pass-1 block
# Pass-1 threadgroups per call, one wave on an H200 (132 SMs): most CUDA-core variants hold
# 128-170 registers a lane, so two per SM (512 ran as 1.3 waves: ncu, CUDA-core pass 1 at 4k with
# key means 18.5 against 13.5 us); the tensor-core ones three per SM (chained 64k turbo4 82 against
# 87 us at 264; docs/benchmarks.md).
TARGET_THREADGROUPS = 264
MMA_TARGET_THREADGROUPS = 396
DTYPE_NAMES = {mx.float16: "float16", mx.bfloat16: "bfloat16", mx.float32: "float32"}
# MLX's CUDA allocator serves arrays of up to 8 bytes from a managed-memory pool the host keeps
# touching; a kernel reading one paid about 5.5 us (ncu on the H200: pass 0 9.2 against 3.6 us
# with a one-float input). Every small kernel input is padded past that (`unpooled`).
MIN_INPUT_ELEMENTS = 16
DTYPES = {name: dtype for dtype, name in DTYPE_NAMES.items()}


@dataclass(frozen=True)
class Call:
    """One decode step's kernels and sizes (everything `launch` needs besides the arrays)."""

    pass1: Pass1
    pass2: Pass2
    B: int
    H: int
    R: int
    T: int
    D: int


# The tensor-core pass 1 serves every length where it applies: a threshold made the first decode
# past it build a second pass-1 module (1.6-3.3 s on the H200 at the first 16k question), and at
# 4k the two pass 1s are level (turbo4, chained, 8 layers: 42.0-44.9 us CUDA cores, 43.3-44.7
# tensor cores; at 16k 58.3-62.1 against 46.9-48.3; bench/question_prefill.py --mma-ab).
MMA_MIN_TOKENS = 1


# The environment variables `KernelTuning.from_env` reads, in its fields' order.
TUNING_ENV = ("TQSTORE_KERNEL_NS", "TQSTORE_KERNEL_UNROLL", "TQSTORE_KERNEL_THREADGROUPS", "TQSTORE_KERNEL_MMA",
              "TQSTORE_KERNEL_TILES")


@dataclass(frozen=True)
class KernelTuning:
    """How the fused decode picks and launches its kernels: a value handed to `fused_decode`,
    `describe`, `launch` (None there: `KernelTuning.from_env()`). Benchmarks and tests build
    their own; nothing changes one in place.

    `ns`, `unroll`: lane shape and tokens per group per iteration of the CUDA-core pass 1 (0: by
    rows bucket). `threadgroups`: pass-1 threadgroups per call (0: TARGET_THREADGROUPS, or
    MMA_TARGET_THREADGROUPS for the tensor-core pass 1). `mma`: the tensor-core pass 1 where it
    applies (CUDA); `mma_prefetch`: chunks it loads ahead (None: 1); `mma_min_tokens`: the fewest
    stored rows it serves (None: MMA_MIN_TOKENS); `mma_spread`: spread pair tables (`MmaPass1`),
    None: for TurboQuant keys only (with affine keys they measured slower at three threadgroups
    per SM, 64k turbo8v3 100 against 77 us chained). `raw_query`: pass 1 scales the raw query of
    keys without a rotation (False: plain ops scale it first); `fuse_rotation`: pass 1 rotates
    the raw query of TurboQuant keys under a Hadamard rotation (False: the pass-0 kernel does).
    `tiles`: row tiles of 8 per tensor-core threadgroup (0: two where a KV head has more than 8
    query rows and d <= 128, as a question's R * L rows; 1: one, as before, for benchmarks)."""

    ns: int = 0
    unroll: int = 0
    threadgroups: int = 0
    mma: bool = True
    mma_prefetch: int | None = None
    mma_min_tokens: int | None = None
    mma_spread: bool | None = None
    raw_query: bool = True
    fuse_rotation: bool = True
    tiles: int = 0

    @staticmethod
    def from_env() -> KernelTuning:
        """The defaults with the environment's settings (read at every call, so a process may
        change them between steps): `TQSTORE_KERNEL_MMA=0` keeps the CUDA-core pass 1,
        `TQSTORE_KERNEL_THREADGROUPS` sets `threadgroups`, and for benchmarks
        `TQSTORE_KERNEL_NS` / `TQSTORE_KERNEL_UNROLL` / `TQSTORE_KERNEL_TILES` set `ns` / `unroll` /
        `tiles`."""
        return _tuning_from_env(*map(setting, TUNING_ENV))

    def target_threadgroups(self, mma: bool = False) -> int:
        return self.threadgroups or (MMA_TARGET_THREADGROUPS if mma else TARGET_THREADGROUPS)

    def min_mma_tokens(self) -> int:
        return MMA_MIN_TOKENS if self.mma_min_tokens is None else self.mma_min_tokens

    def prefetch(self) -> int:
        return 1 if self.mma_prefetch is None else int(self.mma_prefetch)

    def spread(self, key_format: str) -> bool:
        return key_format == "turbo" if self.mma_spread is None else self.mma_spread


@functools.lru_cache(maxsize=16)
def _tuning_from_env(ns: str | None, unroll: str | None, threadgroups: str | None, mma: str | None,
                     tiles: str | None) -> KernelTuning:
    # (one value per distinct environment: a decode step pays the variable lookups only)
    return dataclasses.replace(DEFAULT_TUNING, ns=int(ns or 0), unroll=int(unroll or 0),
                               threadgroups=int(threadgroups or 0), mma=mma != "0", tiles=int(tiles or 0))


DEFAULT_TUNING = KernelTuning()  # the measured defaults, no environment


def resolve(tuning: KernelTuning | None) -> KernelTuning:
    """`tuning`, or the environment's (`KernelTuning.from_env`) when None."""
    return KernelTuning.from_env() if tuning is None else tuning


def plan_blocks(T: int, tg_rows: int, target: int | None = None, mma: bool = False,
                tuning: KernelTuning | None = None) -> tuple[int, int] | None:
    """(span, nblocks) of pass 1: about `target` threadgroups (None: the tuning's) to fill the
    GPU, blocks of at least MIN_SPAN and at most MAX_SPAN tokens, at most MAX_BLOCKS blocks; None
    when T is too long."""
    if T < 1:
        return None
    target = target or resolve(tuning).target_threadgroups(mma)
    # (rounded down: one threadgroup more than the target can cost a whole second wave)
    nblk = min(max(1, target // tg_rows), -(-T // MIN_SPAN), MAX_BLOCKS)
    nblk = max(nblk, -(-T // MAX_SPAN))
    if nblk > MAX_BLOCKS:
        return None
    span = -(-T // nblk)
    span = -(-span // 16) * 16
    return span, -(-T // span)


def _side(side) -> tuple[str, int, int, str] | None:
    """(format, bits, group, norm dtype name) of a side, None when no kernel reads it; the norm
    dtype is "" for float32 norms and for sides without norms."""
    if isinstance(side, TurboSide):
        norm = "" if side.norm_dtype is None or side.norm_dtype == mx.float32 else DTYPE_NAMES.get(side.norm_dtype)
        return None if norm is None else ("turbo", side.codec.bits, 0, norm)
    if isinstance(side, AffineSide):
        return "affine", side.codec.bits, side.codec.group_size, ""
    if isinstance(side, NativeSide):
        return "native", 0, 0, ""
    return None


def describe(queries: mx.array, key_side, value_side, arrays: dict[str, mx.array],
             shifts: mx.array | None, tensor_cores: bool = False, rows: int | None = None,
             tuning: KernelTuning | None = None) -> Call | None:
    """The kernels of this decode step, or None when none applies (shape, layout, sizes).
    `rows`: the arrays are token buffers whose first `rows` tokens are the stored rows (the
    kernels read them in place; None: every token of the arrays).

    `tensor_cores` (CUDA): pass 1 on the tensor cores (`mma.py`) where it applies: fp16/bf16
    activations, TurboQuant or affine keys, TurboQuant values, head dims a multiple of 16, at
    least `tuning.min_mma_tokens()` stored rows. `tuning`: None is `KernelTuning.from_env()`."""
    if queries.ndim != 4 or queries.shape[2] != 1 or not arrays:
        return None
    B, Hq, _, D = queries.shape
    ks, vs = _side(key_side), _side(value_side)
    if ks is None or vs is None or vs[0] == "native":
        return None
    kfmt, kbits, kgroup, knorm = ks
    vfmt, vbits, vgroup, vnorm = vs
    try:
        if kfmt == "turbo":
            kref = arrays[f"{key_side.name}_packed"]
            if key_side.codec.d != D:
                return None
            kdtype = ""
        elif kfmt == "affine":
            kref = arrays[f"{key_side.name}_w"]
            kdtype = DTYPE_NAMES.get(arrays[f"{key_side.name}_scales"].dtype)
            if kref.shape[-1] * 32 // kbits != D:
                return None
        else:
            kref = arrays[key_side.name]
            kdtype = DTYPE_NAMES.get(kref.dtype)
            if kref.shape[-1] != D:
                return None
        if vfmt == "turbo":
            vref = arrays[f"{value_side.name}_packed"]
            if value_side.codec.d != D:
                return None
            vdtype = ""
        else:
            vref = arrays[f"{value_side.name}_w"]
            vdtype = DTYPE_NAMES.get(arrays[f"{value_side.name}_scales"].dtype)
            if vref.shape[-1] * 32 // vbits != D:
                return None
    except KeyError:
        return None
    if kdtype is None or vdtype is None or kref.ndim != 4 or vref.ndim != 4:
        return None
    Bk, H, T, _ = kref.shape
    if rows is not None:
        if rows > T:
            return None
        T = rows
    if Bk != B or vref.shape[:3] != kref.shape[:3] or H == 0 or Hq % H or T < 1:
        return None
    if shifts is not None:
        if kfmt == "native" or shifts.ndim != 3 or shifts.shape[0] != H or shifts.shape[2] != D:
            return None
        if shifts.shape[1] * SHIFT_BLOCK < T:
            return None
    R = Hq // H
    tuning = resolve(tuning)
    # Pass 1 takes the raw query (no query op or pass-0 kernel in the step) for keys without a
    # rotation and for TurboQuant keys under a Hadamard rotation (a butterfly in pass 1).
    raw = tuning.raw_query and (kfmt != "turbo" or (tuning.fuse_rotation and fused_rotation(key_side)))
    q_dtype = DTYPE_NAMES.get(queries.dtype, "") if raw else ""
    if (tensor_cores and tuning.mma and queries.dtype in (mx.float16, mx.bfloat16)
            and T >= tuning.min_mma_tokens()):
        # (two row tiles where the rows need more than one: a question's R * L rows read K/V half as often)
        rmax = MMA_ROWS if R <= MMA_ROWS or D > MAX_TILED_D or tuning.tiles == 1 else 2 * MMA_ROWS
        pair = _mma_variants(D, kfmt, kbits, kgroup, kdtype, vfmt, vbits, rmax, shifts is not None,
                             tuning.prefetch(), q_dtype, tuning.spread(kfmt), knorm, vnorm)
        if pair is not None:
            return Call(pair[0], pair[1], B, H, R, T, D)
    pair = _variants(D, kfmt, kbits, kgroup, kdtype, vfmt, vbits, vgroup, vdtype, rows_bucket(R),
                     shifts is not None, tuning.ns, tuning.unroll, q_dtype, knorm, vnorm)
    if pair is None:
        return None
    return Call(pair[0], pair[1], B, H, R, T, D)


@functools.lru_cache(maxsize=None)
def _variants(D, kfmt, kbits, kgroup, kdtype, vfmt, vbits, vgroup, vdtype, rmax, shifts, ns, unroll, q_dtype="",
              knorm="", vnorm=""):
    try:
        p1 = Pass1(d=D, key=kfmt, key_bits=kbits, key_group=kgroup, key_dtype=kdtype, value=vfmt,
                   value_bits=vbits, value_group=vgroup, value_dtype=vdtype, rmax=rmax, shifts=shifts, ns=ns,
                   unroll=unroll, q_dtype=q_dtype, key_norm=knorm, value_norm=vnorm)
    except ValueError:
        return None
    return p1, Pass2(d=D, rotate=vfmt == "turbo")


@functools.lru_cache(maxsize=None)
def _mma_variants(D, kfmt, kbits, kgroup, kdtype, vfmt, vbits, rmax, shifts, prefetch, q_dtype="", spread=True,
                  knorm="", vnorm=""):
    try:
        p1 = MmaPass1(d=D, key=kfmt, key_bits=kbits, key_group=kgroup, key_dtype=kdtype, value=vfmt,
                      value_bits=vbits, value_group=0, value_dtype="", rmax=rmax, shifts=shifts, prefetch=prefetch,
                      q_dtype=q_dtype, spread=spread, key_norm=knorm, value_norm=vnorm)
    except ValueError:
        return None
    return p1, Pass2(d=D, rotate=True)


# Per-object tables, each kept beside the object it was made from (an identity check on every
# hit) and dropped oldest first past its bound. Every restore from LMDB or S3 makes new codecs and
# calibrations, so unbounded tables grew by every layer's tables, and held what they were made
# from, for each restore of a long-running server (64 KB of rotation matrix a layer at head dim 128).
_RFWD: dict[int, tuple[Rotation, mx.array]] = {}
_RINV: dict[int, tuple[Rotation, mx.array]] = {}
_QT: dict[tuple, tuple] = {}
_DENSE: dict[int, tuple[mx.array, mx.array]] = {}
_PADDED: dict[int, tuple[mx.array, mx.array]] = {}
DENSE_KEPT = 128  # key-mean tables and padded codebooks kept (a model's layers, twice over)
TABLES_KEPT = 512  # query transforms and rotation matrices kept (both of 128 layers' sides, twice)


def _made_once(table: dict, obj, kept: int, make: Callable[[], mx.array]) -> mx.array:
    """The table made from `obj` (`make()`), kept beside it under its id and made again only
    for another object."""
    return once(table, id(obj), (obj,), kept, make)


def forward_matrix(rotation: Rotation) -> mx.array:
    """M with forward(x) = x @ M, exact in float32 (made once per rotation object, lazily: see
    `_query_transform`). A restore from memory reuses its codecs (`codec_from_record`), so this
    is made once per entry, not per layer and restore."""
    return _made_once(_RFWD, rotation, TABLES_KEPT,
                      lambda: mx.contiguous(rotation.forward(mx.eye(rotation.d, dtype=mx.float32))))


def inverse_matrix(rotation: Rotation) -> mx.array:
    """M_inv with inverse(y) = y @ M_inv, exact in float32 (made once per rotation object, lazily:
    see `_query_transform`)."""
    if rotation.kind is RotationKind.HADAMARD:
        return _made_once(_RINV, rotation, TABLES_KEPT, lambda: rotation.inverse(mx.eye(rotation.d, dtype=mx.float32)))
    return _made_once(_RINV, rotation, TABLES_KEPT, lambda: mx.contiguous(rotation.matrix.astype(mx.float32).T))


def unpooled(a: mx.array) -> mx.array:
    """A 1-D kernel input (a codebook) with at least MIN_INPUT_ELEMENTS elements, zero-padded,
    made once per array object; kernels index only its first `a.size` elements."""
    if a.size >= MIN_INPUT_ELEMENTS:
        return a
    return _made_once(_PADDED, a, DENSE_KEPT, lambda: mx.concatenate(
        [a.reshape(-1), mx.zeros((MIN_INPUT_ELEMENTS - a.size,), dtype=a.dtype)]))


def dense_float32(a: mx.array) -> mx.array:
    """`a` as a dense float32 array, made once per array object (the key means change only when
    a block is added): no copy op in every decode step's graph. Oldest first out: layers' means
    from earlier blocks."""
    return _made_once(_DENSE, a, DENSE_KEPT, lambda: mx.contiguous(a.astype(mx.float32)))


def fused_rotation(key_side) -> bool:
    """Whether pass 1 can rotate the query itself: TurboQuant keys under a Sylvester Hadamard
    rotation (d a power of two)."""
    return isinstance(key_side, TurboSide) and key_side.codec.rotation.kind is RotationKind.HADAMARD


def _fused_query(key_side, c: float, H: int, D: int) -> tuple[mx.array, mx.array]:
    """(pre [H, D], post [H, D]) of a pass 1 that rotates the raw query itself:
    q_k = H(q * pre[h]) * post[h] with H the unnormalised Sylvester butterfly, so pre folds the
    rotation's signs and 1/sqrt(d) into pass 0's pre (cached)."""
    sources = _made_from(key_side)
    return once(_QT, ("fused", *map(id, sources), c, H, D), sources, TABLES_KEPT, _make_fused_query, key_side, c, H, D)


def _make_fused_query(key_side, c: float, H: int, D: int) -> tuple[mx.array, mx.array]:
    _, pre, _, post, _ = _query_transform(key_side, c, H, D)
    signs = key_side.codec.rotation.signs.astype(mx.float32)
    return mx.contiguous(pre * signs / math.sqrt(D)), _constant(1.0, (H, D)) if post is None else post


def _made_from(key_side) -> tuple:
    """What a key side's query tables are made from: its kind, codec and calibration. Every
    restore makes new sides, but a restore from memory shares its codecs (`codec_from_record`)
    and calibrations (`KeyCalibration.from_arrays`), so its tables are made once per entry, not
    by each layer of each restore."""
    return (type(key_side), getattr(key_side, "codec", None), getattr(key_side, "calibration", None))


@functools.lru_cache(maxsize=64)
def _constant(value: float, shape: tuple[int, ...]) -> mx.array:
    """A float32 array of one value, made and evaluated once per (value, shape): the softmax
    scale's tables of uncalibrated keys, the same for every layer and restore."""
    a = mx.full(shape, value, dtype=mx.float32)
    mx.eval(a)
    return a


def _query_transform(key_side, c: float, H: int, D: int) -> tuple:
    """Per key side's codec and calibration (cached, `_made_from`): ("pass0", pre [H, D],
    M [D, D], post [H, D] | None, c) for TurboQuant keys, where q_k = ((q * pre[h]) @ M) * post[h]
    with M the rotation as an exact float32 matrix and pre folding the scale, log2(e) and the
    channel calibration; ("scale", pre [H, D], c) for
    native and affine keys (q_k = q * pre, which pass 1 applies to the raw query itself).

    Built lazily, as graph nodes of the first attention call that needs them, not evaluated
    here: a restore from LMDB or S3 makes new calibrations, so a question after it makes pre and
    post for every layer (M is the codec's rotation's, `forward_matrix`), and evaluating each
    table as it was made (on the CPU stream, then read by the GPU) cost 10-20 ms of a 15-token
    question's forward over 8 layers on the H200 (issue 28), where the whole forward now takes
    7-8 ms."""
    sources = _made_from(key_side)
    return once(_QT, (*map(id, sources), c, H, D), sources, TABLES_KEPT, _make_query_transform, key_side, c, H, D)


def _make_query_transform(key_side, c: float, H: int, D: int) -> tuple:
    cal = getattr(key_side, "calibration", None)
    chan = None if cal is None or cal.scale is None else cal.scale.astype(mx.float32)
    cq = _constant(c, (MIN_INPUT_ELEMENTS,))  # kernels read cq[0]
    pre = _constant(c, (H, D)) if chan is None else mx.contiguous(chan * c)
    if isinstance(key_side, TurboSide):
        post = key_side._scale()
        post = None if post is None else mx.contiguous(post.reshape(H, D).astype(mx.float32))
        return ("pass0", pre, forward_matrix(key_side.codec.rotation), post, cq)
    return ("scale", pre, None, None, cq)


def query_inputs(make_kernel, params: mx.array, queries: mx.array, key_side, scale: float,
                 call: Call) -> tuple[mx.array, mx.array | None]:
    """(q_k, q_s): the key-side query (rotated and calibrated for TurboQuant keys, channel-scaled
    for calibrated affine keys) and, for key means, the plain scaled query; [B*Hq, D] float32 in
    log2 units (scale * log2(e) folded in): one pass-0 kernel for TurboQuant keys, plain ops
    for the other keys whose pass 1 does not scale the raw query itself (another dtype, or
    `KernelTuning.raw_query` off)."""
    B, H, R, D = call.B, call.H, call.R, call.D
    c = scale * LOG2E
    kind, pre, m, post, cq = _query_transform(key_side, c, H, D)
    shifts = call.pass1.shifts
    dtype = DTYPE_NAMES.get(queries.dtype)
    if dtype is not None and kind == "pass0":
        p0 = _pass0(D, dtype, post is not None, shifts)
        q = mx.contiguous(queries.reshape(B * H * R, D))
        inputs = {"params": params, "q": q, "cq": cq, "pre": pre, "mf": m, "post": post}
        outs = make_kernel(p0)(inputs=[inputs[n] for n in p0.input_names()], grid=(p0.threads * B * H * R, 1, 1),
                               threadgroup=(p0.threads, 1, 1), output_shapes=[(B * H * R, D)] * len(p0.output_names()),
                               output_dtypes=[mx.float32] * len(p0.output_names()))
        return outs[0], (outs[1] if shifts else None)
    q = queries.reshape(B, H, R, D)
    if kind == "pass0":  # (an activation dtype without a kernel type)
        qk = (q.astype(mx.float32) * pre[:, None, :]) @ m
        qk = qk if post is None else qk * post[:, None, :]
    else:
        qk = q * pre[:, None, :]
    qs = mx.contiguous((q.astype(mx.float32) * c).reshape(B * H * R, D)) if shifts else None
    # (elementwise results may keep a permuted input's strides; the kernels index rows densely)
    return mx.contiguous(qk.reshape(B * H * R, D)), qs


@functools.lru_cache(maxsize=None)
def _pass0(d: int, q_dtype: str, post: bool, qs: bool) -> Pass0:
    return Pass0(d=d, q_dtype=q_dtype, post=post, qs=qs)


KernelFactory = Callable[[Pass1 | Pass2], Callable]


@functools.lru_cache(maxsize=1024)
def params_array(*sizes: int) -> mx.array:
    """The runtime sizes as a device array, made once per distinct sizes: the stored row count
    grows a block at a time, so decode steps reuse it instead of uploading a new array each call."""
    params = mx.array(list(sizes) + [0] * (MIN_INPUT_ELEMENTS - len(sizes)), dtype=mx.int32)
    mx.eval(params)
    return params


def pass1_sizes(call: Call, shifts: mx.array | None, target: int | None = None,
                tuning: KernelTuning | None = None) -> tuple[int, ...] | None:
    """The sizes pass 1 and 2 read from `params` before the tail's: (stored rows, block span,
    blocks, GQA ratio, KV heads, row groups, key-mean blocks), or None (T too long)."""
    NG = -(-call.R // call.pass1.rmax)
    blocks = plan_blocks(call.T, call.B * call.H * NG, target, isinstance(call.pass1, MmaPass1), tuning)
    if blocks is None:
        return None
    nb_mu = 0 if shifts is None else shifts.shape[1]
    return (call.T, *blocks, call.R, call.H, NG, nb_mu)


def query_scale(key_side, scale: float, call: Call) -> mx.array:
    """The softmax scale in log2 units as pass 2 reads it (cq[0]) for the raw tail's scores."""
    return _query_transform(key_side, scale * LOG2E, call.H, call.D)[4]


def pass1_args(make_kernel, call: Call, queries: mx.array, key_side, value_side, arrays: dict[str, mx.array],
               scale: float, shifts: mx.array | None, target: int | None = None, tail_rows: int = 0,
               tuning: KernelTuning | None = None, causal: int = 0) -> dict | None:
    """Keyword arguments of the pass-1 kernel call (inputs, grid, outputs), or None (T too long).
    `tail_rows` travels in `params` for a pass 2 that also attends over the raw tail, and so
    does `causal` (L > 1: the query rows are a question's L tokens per query head, and token l
    sees the tail's first tail_rows - L + 1 + l rows)."""
    p1 = call.pass1
    sizes = pass1_sizes(call, shifts, target, tuning)
    if sizes is None:
        return None
    _, span, nblk, _, _, NG, _ = sizes
    rows = call.B * call.H * call.R
    params = params_array(*sizes, tail_rows, causal)
    if p1.q_dtype:
        inputs = pass1_inputs(p1, call.H, call.D, params, queries, key_side, value_side, arrays, scale, shifts)
    else:
        qk, qs = query_inputs(make_kernel, params, queries, key_side, scale, call)
        inputs = {"params": params, "q_k": qk, "q_s": qs,
                  **pass1_inputs(p1, call.H, call.D, params, None, key_side, value_side, arrays, scale, shifts)}
    return dict(inputs=[inputs[n] for n in p1.input_names()],
                grid=(THREADS * nblk, call.B * call.H * NG, 1), threadgroup=(THREADS, 1, 1),
                output_shapes=[(rows, nblk, call.D), (rows, nblk), (rows, nblk)],
                output_dtypes=[mx.float32] * len(OUTPUTS1))


def pass1_inputs(p1: Pass1, H: int, D: int, params: mx.array, queries: mx.array | None, key_side, value_side,
                 arrays: dict[str, mx.array], scale: float, shifts: mx.array | None) -> dict[str, mx.array]:
    """Pass 1's inputs by name: the stored rows' buffers, the sides' tables (made once per side,
    `_query_transform`) and, where pass 1 reads the raw query (`queries` given, `p1.q_dtype`),
    the query and its transform's tables. Without a raw query the caller adds q_k and q_s."""
    inputs = {"params": params}
    if queries is not None:
        _, pre, _, _, cq = _query_transform(key_side, scale * LOG2E, H, D)
        inputs.update(q_raw=queries, pre=pre, cq=cq)
        if p1.key == "turbo":
            inputs["pre"], inputs["post"] = _fused_query(key_side, scale * LOG2E, H, D)
    if shifts is not None:
        inputs["mu"] = dense_float32(shifts)
    k, v = key_side.name, value_side.name
    if p1.key == "turbo":
        inputs.update(k_p=arrays[f"{k}_packed"], k_n=arrays[f"{k}_norms"], k_cb=unpooled(key_side.codec.centroids))
    elif p1.key == "affine":
        inputs.update(k_w=arrays[f"{k}_w"], k_s=arrays[f"{k}_scales"], k_b=arrays[f"{k}_biases"])
    else:
        inputs.update(k_raw=arrays[k])
    if p1.value == "turbo":
        inputs.update(v_p=arrays[f"{v}_packed"], v_n=arrays[f"{v}_norms"], v_cb=unpooled(value_side.codec.centroids))
    else:
        inputs.update(v_w=arrays[f"{v}_w"], v_s=arrays[f"{v}_scales"], v_b=arrays[f"{v}_biases"])
    return inputs


def tail_pass2(call: Call, queries: mx.array, tail: tuple[mx.array, mx.array] | None,
               tail_rows: int | None = None, out_dtype: str = "") -> Pass2 | None:
    """The pass-2 variant that also attends over the first `tail_rows` (None: all) rows of
    `tail`, or None (no tail, or one it cannot take: more rows than its threads, an unknown
    dtype, another layout)."""
    if tail is None:
        return None
    kt, vt = tail
    n = kt.shape[2] if tail_rows is None else tail_rows
    dt, qt = DTYPE_NAMES.get(kt.dtype), DTYPE_NAMES.get(queries.dtype)
    if (dt is None or qt is None or vt.dtype != kt.dtype or not 0 < n <= min(call.pass2.threads, kt.shape[2])
            or kt.ndim != 4 or kt.shape[:2] != (call.B, call.H) or vt.shape[:3] != kt.shape[:3]
            or kt.shape[3] != call.D or vt.shape[3] != call.D):
        return None
    return pass2_variant(call.D, call.pass2.rotate, dt, qt, out_dtype)


@functools.lru_cache(maxsize=None)
def pass2_variant(d: int, rotate: bool, tail_dtype: str, q_dtype: str, out_dtype: str = "") -> Pass2:
    return Pass2(d=d, rotate=rotate, tail_dtype=tail_dtype, q_dtype=q_dtype, out_dtype=out_dtype)


@functools.lru_cache(maxsize=None)
def with_sinks(p2: Pass2) -> Pass2:
    return dataclasses.replace(p2, sinks=True)


def check_sinks(sinks: mx.array | None, queries: mx.array) -> bool:
    """Whether the kernels can take `sinks`: None, or one value per query head ([Hq])."""
    return sinks is None or (sinks.ndim == 1 and sinks.shape[0] == queries.shape[1])


def sink_input(sinks: mx.array) -> mx.array:
    """The sinks as pass 2 reads them: dense float32, at least MIN_INPUT_ELEMENTS long, made once
    per array object (a model's sinks are a fixed parameter: no conversion op in every step)."""
    return unpooled(dense_float32(sinks))


def pass2_args(call: Call, value_side, params: mx.array, po: mx.array, pm: mx.array, pl: mx.array,
               p2: Pass2 | None = None, queries: mx.array | None = None, cq: mx.array | None = None,
               tail: tuple[mx.array, mx.array] | None = None, sinks: mx.array | None = None) -> dict:
    """Keyword arguments of the pass-2 call; `p2` (a tail or sink variant) with the query and tail
    or the sinks. The outputs have their final shapes, out [B, Hq, 1, D] and lse [B, Hq, 1]."""
    p2 = p2 or call.pass2
    rows = call.B * call.H * call.R
    ins = pass2_inputs(p2, value_side, params, po, pm, pl, queries, cq, tail, sinks)
    Hq = call.H * call.R
    out_dtype = DTYPES[p2.out_dtype] if p2.out_dtype else mx.float32
    return dict(inputs=[ins[n] for n in p2.input_names()], grid=(p2.threads * rows, 1, 1),
                threadgroup=(p2.threads, 1, 1), output_shapes=[(call.B, Hq, 1, call.D), (call.B, Hq, 1)],
                output_dtypes=[out_dtype, mx.float32])


def pass2_inputs(p2: Pass2, value_side, params: mx.array, po: mx.array, pm: mx.array, pl: mx.array,
                 queries: mx.array | None, cq: mx.array | None, tail: tuple[mx.array, mx.array] | None,
                 sinks: mx.array | None) -> dict[str, mx.array]:
    """Pass 2's inputs by name: pass 1's partials, the inverse value rotation, and the query and
    the raw tail or the sinks where `p2` takes them."""
    ins = {"params": params, "po": po, "pm": pm, "pl": pl}
    if p2.rotate:
        ins["rinv"] = inverse_matrix(value_side.codec.rotation)
    if p2.tail_dtype:
        ins.update(tq=queries, cq=cq, t_k=tail[0], t_v=tail[1])
    if p2.sinks:
        ins["sinks"] = sink_input(sinks)
    return ins


def launch(make_kernel: KernelFactory, call: Call, queries: mx.array, key_side, value_side,
           arrays: dict[str, mx.array], scale: float, shifts: mx.array | None,
           init_value: float | None = None, target: int | None = None,
           partials: bool = False, tail: tuple[mx.array, mx.array] | None = None,
           fuse_tail: bool = True, tail_rows: int | None = None,
           out_dtype: mx.Dtype | None = None, sinks: mx.array | None = None,
           tuning: KernelTuning | None = None, causal: int = 0) -> tuple[mx.array, ...] | None:
    """Run both passes; returns (out [B, Hq, 1, D] normalised in the original basis, float32 or
    `out_dtype` (CUDA: pass 2 writes it), lse [B, Hq, 1] float32 natural-log log-sum-exp of the
    scaled scores) over the stored rows and the raw `tail` (its first `tail_rows` rows; None:
    all) when given (pass 2 attends over it when `fuse_tail` and it can, else plain ops merge
    it), plus pass 1's (o, m, l) per (row, block) when `partials` (tests). `init_value` fills
    every output before the kernels run (tests poison them with NaN). `sinks` [Hq]: one logit
    per query head in the normaliser (`check_sinks`); out and lse then include it. `tuning` sets
    the threadgroup target when `target` is None (None: `KernelTuning.from_env()`). `causal`
    (L > 1): the query rows are L tokens per query head ([B, Hq * L, 1, D]) that are the
    tail's last L rows, so token l sees the tail's rows up to its own (`merge_tail_rows`)."""
    half = out_dtype is not None and out_dtype != mx.float32
    dtype = DTYPE_NAMES.get(out_dtype, "") if half else ""
    p2 = tail_pass2(call, queries, tail, tail_rows, dtype) if fuse_tail else None
    if p2 is None and tail is None and dtype:
        p2 = pass2_variant(call.D, call.pass2.rotate, "", "", dtype)
    if sinks is not None:
        p2 = with_sinks(p2 or call.pass2)
    n_tail = 0 if tail is None else (tail[0].shape[2] if tail_rows is None else tail_rows)
    fused = p2 is not None and bool(p2.tail_dtype)
    args1 = pass1_args(make_kernel, call, queries, key_side, value_side, arrays, scale, shifts, target,
                       n_tail if fused else 0, tuning, causal if fused else 0)
    if args1 is None:
        return None
    po, pm, pl = make_kernel(call.pass1)(**args1, init_value=init_value)
    cq = query_scale(key_side, scale, call)
    out, lse = make_kernel(p2 or call.pass2)(**pass2_args(call, value_side, args1["inputs"][0], po, pm, pl, p2,
                                                          queries, cq, tail, sinks), init_value=init_value)
    result = (out, lse)
    if (p2 is None or not p2.tail_dtype) and tail is not None:
        kt, vt = tail
        result = merge_tail_rows(queries, out, lse, (kt[:, :, :n_tail], vt[:, :, :n_tail]), scale, causal)
        if half:
            result = (result[0].astype(out_dtype), result[1])
    return result + (po, pm, pl) if partials else result


def exact_arrays(arrays: dict[str, mx.array]) -> dict[str, mx.array]:
    """`arrays` with affine scales and biases in float32: mx.dequantize then returns
    scale * code + bias unrounded, which is what the kernels (and mx.quantized_matmul) use; with
    half-precision scales it would round every dequantized element to that precision."""
    return {n: a.astype(mx.float32) if n.endswith(("_scales", "_biases")) else a for n, a in arrays.items()}


def plain_decode(queries: mx.array, key_side, value_side, arrays: dict[str, mx.array], scale: float,
                 shifts: mx.array | None, sinks: mx.array | None = None) -> tuple[mx.array, mx.array]:
    """What `launch` returns, computed with the sides' plain ops (the reference path); `sinks`
    [Hq] join the normaliser (and the log-sum-exp) as one more score per query head."""
    arrays = exact_arrays(arrays)
    B, Hq, L, D = queries.shape
    some = next(iter(arrays.values()))
    H = some.shape[1]
    R = Hq // H
    q = (queries.astype(mx.float32) * scale).reshape(B, H, R * L, D)
    s = key_side.scores(arrays, q, shifts)
    if sinks is None:
        lse = mx.logsumexp(s, axis=-1)
        p = mx.softmax(s, axis=-1, precise=True)
    else:
        sk = mx.broadcast_to(mx.repeat(sinks.astype(mx.float32).reshape(H, R, 1), L, axis=1), (B, H, R * L, 1))
        lse = mx.logsumexp(mx.concatenate([s, sk], axis=-1), axis=-1)
        p = mx.exp(s - lse[..., None])
    out = value_side.mix(arrays, p)
    return out.reshape(B, Hq, L, -1), lse.reshape(B, Hq, L)


def merge_tail(queries: mx.array, out: mx.array, lse: mx.array, tail: tuple[mx.array, mx.array] | None,
               scale: float, causal: bool = False) -> tuple[mx.array, mx.array]:
    """(out, lse) over [stored rows | raw tail] from the stored rows' (out [B, Hq, L, D], lse
    [B, Hq, L]) and the tail's own scores (exact; plain ops, float32). `causal`: the L queries
    are the tail's last L rows, and query i sees tail rows j <= n - L + i (every stored row)."""
    if tail is None:
        return out, lse
    B, Hq, L, D = queries.shape
    kt, vt = tail
    H, n = kt.shape[1], kt.shape[2]
    R = Hq // H
    q = (queries.astype(mx.float32) * scale).reshape(B, H, R * L, D)
    s = q @ kt.astype(mx.float32).swapaxes(-1, -2)  # [B, H, R * L, n]
    if causal and L > 1:
        seen = mx.arange(n)[None, :] <= (n - L + mx.arange(L))[:, None]  # [L, n]
        s = mx.where(mx.tile(seen, (R, 1)), s, -mx.inf)
    lse_s = lse.astype(mx.float32).reshape(B, H, R * L, 1)
    m = mx.maximum(mx.max(s, axis=-1, keepdims=True), lse_s)
    e = mx.exp(s - m)
    w = mx.exp(lse_s - m)
    num = out.astype(mx.float32).reshape(B, H, R * L, -1) * w + e @ vt.astype(mx.float32)
    den = w + mx.sum(e, axis=-1, keepdims=True)
    return (num / den).reshape(B, Hq, L, -1), (m + mx.log(den)).reshape(B, Hq, L)


def merge_tail_rows(queries: mx.array, out: mx.array, lse: mx.array, tail: tuple[mx.array, mx.array] | None,
                    scale: float, causal: int = 0) -> tuple[mx.array, mx.array]:
    """`merge_tail` for one query row per (query head, token) ([B, Hq * L, 1, D], what the
    kernels take): with `causal` = L > 1 the rows are brought back to [B, Hq, L, D] and merged
    under the causal mask (token l sees the tail's first n - L + 1 + l rows)."""
    if tail is None or causal <= 1:
        return merge_tail(queries, out, lse, tail, scale)
    B, rows, _, D = queries.shape
    o, m = merge_tail(queries.reshape(B, rows // causal, causal, D), out.reshape(B, rows // causal, causal, -1),
                      lse.reshape(B, rows // causal, causal), tail, scale, causal=True)
    return o.reshape(B, rows, 1, -1), m.reshape(B, rows, 1)


def close(a: mx.array, b: mx.array, rtol: float) -> tuple[bool, float]:
    """max |a - b| relative to max |b| (NaN counts as a mismatch)."""
    err = float(mx.max(mx.abs(a - b)).item())
    ref = float(mx.max(mx.abs(b)).item())
    rel = err / max(ref, 1e-30)
    return (math.isfinite(rel) and rel <= rtol), rel
