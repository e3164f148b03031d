"""Consecutive blocks of one entry decoded into joined arrays: one MLX array per array name for
all of them, each block's groups copied into its token slice, and each block's groups views of
it (`ArrayGroup.base`), so the join that follows is a slice, not a concatenation.

A `Run` is allocated from the blocks' headers before their bytes are at hand, and `place` copies
one block's decoded groups into it from any thread (numpy only), so a restore copies each byte
once, on the thread that read and checked it, while the next objects are read. Its memory is
`blank`: not zero-filled first, so the first touch of every fresh page falls in those copies,
spread over the reader threads, where a zero fill would pay it once more, on one thread, before
any copy could start (about 0.55 s per GB on the CPU here, as much as reading the bytes).
"""

from __future__ import annotations

import io
import math
import threading
from dataclasses import dataclass
from typing import Sequence

import mlx.core as mx
import numpy as np

from turboquant.records import TOKEN_AXIS, LayerRecord

from tqstore.canonical import DTYPES
from tqstore.format.blocks import ArrayGroup, Block, GroupedLayers, Joined
from tqstore.format.header import Header, LayerInfo, TensorInfo
from tqstore.madvise import HUGE_PAGE, HUGEPAGE, advise

GroupPlan = tuple[int, str, tuple[int, ...], tuple[int, ...], str]  # group, name, layers, array shape, dtype


@dataclass(frozen=True)
class Plan:
    """How the arrays of a block's layers lie in its groups: per group its array name, the
    layers it holds one array each of (in order), their shape and dtype; and the layer shells
    (shared by every block with these layer records when there is no calibration)."""

    groups: tuple[GroupPlan, ...]
    calibrated: bool
    shells: dict[int, LayerRecord] | None


_PLANS: dict[int, tuple[tuple[LayerInfo, ...], Plan | None]] = {}  # a memo, keyed by the records' identity
_PLANS_LOCK = threading.Lock()


def plan_of(layers: tuple[LayerInfo, ...]) -> Plan | None:
    """The grouping of `layers`, or None when some group does not hold arrays of one name and
    shape, one per layer in layer order (as dumps writes them). Memoized by the layer records'
    identity: a header's records are shared by every object with the same tables (tables.py,
    header.py), so a restore works out each distinct grouping once, not once per block."""
    with _PLANS_LOCK:
        found = _PLANS.get(id(layers))
    if found is not None and found[0] is layers:
        return found[1]
    members: dict[int, list[tuple[int, str, TensorInfo]]] = {}
    for li in layers:
        for n, t in li.arrays.items():
            members.setdefault(t.group, []).append((li.index, n, t))
    calibrated = any(li.calibration for li in layers)
    plan: Plan | None = None
    if not {t.group for li in layers for t in li.calibration.values()} & set(members):
        groups = []
        for j, found_ in sorted(members.items()):
            (_, name, first), size = found_[0], found_[0][2].nbytes
            if any(n != name or t.shape != first.shape or t.offset != k * size for k, (_, n, t) in enumerate(found_)):
                break
            groups.append((j, name, tuple(i for i, _, _ in found_), first.shape, first.dtype))
        else:
            shells = None if calibrated else {
                li.index: LayerRecord(li.layout, li.offset, dict.fromkeys(li.arrays), dict(li.config), dict(li.state))
                for li in layers}
            plan = Plan(tuple(groups), calibrated, shells)
    with _PLANS_LOCK:
        if len(_PLANS) >= 256:
            _PLANS.clear()
        _PLANS[id(layers)] = (layers, plan)
    return plan


class Run:
    """Joined arrays for consecutive blocks 0..n-1 of one entry, allocated from their headers
    (`allocate`), filled block by block (`place`, any thread) and made into blocks whose groups
    are views of them (`blocks`, the caller's thread)."""

    def __init__(self, shapes: list[dict[str, tuple]], bases: list[mx.array],
                 targets: list[dict[str, np.ndarray]], views: list[dict[str, ArrayGroup]]) -> None:
        self._shapes, self.bases, self._targets, self._views = shapes, bases, targets, views

    @classmethod
    def allocate(cls, headers: Sequence[Header]) -> Run | None:
        """A run for blocks with these headers, or None unless every one is a block whose groups
        hold one array per layer (`plan_of`) with, per name, the same layers, dtype and shape but
        for tokens. The arrays are allocated on the CPU stream and written in place (numpy
        views of MLX's buffers): no extra copy where memory is unified (Apple silicon, the
        CPU); on CUDA `blocks` moves them to the device."""
        plans = [plan_of(h.layers) if h.kind == "block" else None for h in headers]
        if not plans or any(p is None for p in plans):
            return None
        names: dict[str, list[tuple[int, GroupPlan]]] = {}
        for b, plan in enumerate(plans):
            for g in plan.groups:
                names.setdefault(g[1], []).append((b, g))
        axis = TOKEN_AXIS  # of each array's shape; of a group's data it is TOKEN_AXIS + 1
        for members in names.values():
            _, (_, _, layers, shape, dtype) = members[0]
            if any(g[2] != layers or g[4] != dtype or len(g[3]) != len(shape) or len(shape) <= axis
                   or g[3][:axis] + g[3][axis + 1:] != shape[:axis] + shape[axis + 1:] for _, g in members):
                return None
        targets: list[dict[str, np.ndarray]] = [{} for _ in plans]
        views: list[dict[str, ArrayGroup]] = [{} for _ in plans]
        specs = []
        for members in names.values():
            _, (_, _, layers, shape, dtype) = members[0]
            total = sum(g[3][axis] for _, g in members)
            specs.append(((len(layers), *shape[:axis], total, *shape[axis + 1:]), DTYPES[dtype][2]))
        bases = blank_arrays(specs)
        for (name, members), joined in zip(names.items(), bases):
            _, (_, _, layers, _, dtype) = members[0]
            mx_dtype, _, unsigned = DTYPES[dtype]
            host = np.asarray(joined)  # MLX's own buffer, written by `place` before any view of it is read
            data = joined if mx_dtype == unsigned else joined.view(mx_dtype)
            base, start, stops = Joined(data), 0, []
            for _, g in members:
                start += g[3][axis]
                stops.append(start)
            # one split, not a slice per block: the views of 64 blocks cost one call
            pieces = mx.split(data, stops[:-1], axis=axis + 1) if len(members) > 1 else [data]
            for (b, _), piece, stop in zip(members, pieces, stops):
                start = stop - piece.shape[axis + 1]
                targets[b][name] = host[(slice(None),) * (axis + 1) + (slice(start, stop),)]
                views[b][name] = ArrayGroup(name, layers, piece, base, start, stop)
        return cls([_by_name(p) for p in plans], bases, targets, views)

    def fits(self, b: int, header: Header) -> bool:
        """Whether block `b`'s slices were allocated for this header's arrays (group numbers
        aside: block 0's calibration groups come before some of its array groups)."""
        plan = plan_of(header.layers) if header.kind == "block" else None
        return plan is not None and _by_name(plan) == self._shapes[b]

    def place(self, b: int, header: Header, raws: Sequence[np.ndarray]) -> None:
        """Copy block `b`'s decoded, verified groups into its token slices (numpy copies, which
        release the GIL: safe on any thread, one block per thread at a time). The header must
        fit (`fits`)."""
        for j, name, *_ in plan_of(header.layers).groups:
            dest = self._targets[b][name]
            np.copyto(dest, aligned(raws[j], dest.itemsize).reshape(dest.shape))

    def blocks(self, placed: Sequence[tuple[int, Header, Sequence[np.ndarray] | None]]) -> list[Block]:
        """The blocks `placed` (index in the run, header, and its decoded groups where the block
        holds calibration arrays, which stay arrays of their own), their groups views of the
        joined arrays, evaluated. Every block must have been placed: on CUDA the joined arrays
        move to the device here, once."""
        to_device(self.bases)
        out, calibrations = [], []
        for b, header, raws in placed:
            plan, calibration = plan_of(header.layers), {}
            for li in header.layers:
                for n, info in li.calibration.items():
                    mx_dtype, _, unsigned = DTYPES[info.dtype]
                    raw = raws[info.group][info.offset:info.offset + info.nbytes]
                    a = mx.array(aligned(raw, unsigned.size)).reshape(info.shape)
                    calibration[(li.index, n)] = a if mx_dtype == unsigned else a.view(mx_dtype)
                    calibrations.append(calibration[(li.index, n)])
            shells = plan.shells or {
                li.index: LayerRecord(li.layout, li.offset, dict.fromkeys(li.arrays), dict(li.config), dict(li.state),
                                      {n: calibration[(li.index, n)] for n in li.calibration}) for li in header.layers}
            info = header.block
            groups = tuple(self._views[b][name] for _, name, *_ in plan.groups)
            out.append(Block(info.index, info.start, info.n_tokens, GroupedLayers(shells, groups), info.block_size))
        # Evaluated here: lazy views would be bound to this thread's stream (see objects._grouped_block).
        mx.eval([g.data for blk in out for g in blk.layers.groups], calibrations)
        return out


def _by_name(plan: Plan) -> dict[str, tuple]:
    """Each array name's layers, shape and dtype."""
    return {g[1]: g[2:] for g in plan.groups}


def blank_arrays(specs: Sequence[tuple[tuple[int, ...], mx.Dtype]]) -> list[mx.array]:
    """Evaluated CPU-stream arrays of these shapes and unsigned dtypes whose memory nobody has
    written: their contents are undefined until the caller writes them through `np.asarray`.
    They are views of one allocation (`blank`), each at a 64-byte aligned offset, where that
    allocation's bytes can be one MLX dimension (int32: under 2 GiB); larger runs (a raw
    64k-token entry of an 8B model's 8 layers) get one allocation per array."""
    offsets, size = [], 0
    for shape, dtype in specs:
        offsets.append(size)
        size += -(-math.prod(shape) * dtype.size // 64) * 64
    if size > MAX_DIM:
        return [blank(shape, dtype) for shape, dtype in specs]
    buffer = blank((max(size, 1),), mx.uint8)
    arrays = [buffer[o:o + math.prod(shape) * dtype.size].view(dtype).reshape(shape)
              for o, (shape, dtype) in zip(offsets, specs)]
    mx.eval(arrays)
    return arrays


def blank(shape: tuple[int, ...], dtype: mx.Dtype) -> mx.array:
    """An evaluated CPU-stream array of `shape` and unsigned `dtype` whose memory nobody has
    written: its contents are undefined until the caller writes them through `np.asarray`.
    MLX has no uninitialized allocation (`mx.empty` is `mx.zeros`), but `mx.load` allocates an
    array and hands its memory to the stream's `readinto`: this stream supplies the `.npy`
    header and leaves the data to the caller. Where the kernel allows it (Linux's transparent
    huge pages in madvise mode), host memory is advised to huge pages: half the cost of first
    touching it on the CPU here (0.37-0.47 s/GB against 0.73-0.86 for 4 KiB pages)."""
    array = mx.load(_HeaderOnly(shape, np.dtype(_UNSIGNED[dtype.size])), format="npy", stream=mx.cpu)
    mx.eval(array)
    if not managed_memory():  # CUDA's managed memory belongs to its driver
        advise(np.asarray(array), HUGEPAGE, HUGE_PAGE)
    return array


class _HeaderOnly(io.RawIOBase):
    """A read-only `.npy` stream of an array of `shape` and `dtype`: the header's bytes, then
    as many data bytes as the array holds, never written into the reader's buffer."""

    name = "blank.npy"

    def __init__(self, shape: tuple[int, ...], dtype: np.dtype) -> None:
        head = io.BytesIO()
        np.lib.format.write_array_header_1_0(head, {"descr": dtype.str, "fortran_order": False, "shape": tuple(shape)})
        self._head = head.getvalue()
        self._size = len(self._head) + int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        self._at = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self._at = {io.SEEK_SET: 0, io.SEEK_CUR: self._at, io.SEEK_END: self._size}[whence] + offset
        return self._at

    def tell(self) -> int:
        return self._at

    def readinto(self, buffer) -> int:
        view = memoryview(buffer).cast("B")
        n = max(0, min(len(view), self._size - self._at))
        head = max(0, min(n, len(self._head) - self._at))
        view[:head] = self._head[self._at:self._at + head]
        self._at += n
        return n


MAX_DIM = 2**31 - 1  # MLX's dimensions are int32: larger shapes fail (`mx.load` raises IndexError "stoi")
_UNSIGNED = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def aligned(raw: np.ndarray, itemsize: int) -> np.ndarray:
    """A group's decoded bytes as unsigned items of `itemsize` (copied only when a stored
    group does not start on an item boundary: safetensors offsets need not be aligned)."""
    if raw.ctypes.data % itemsize:
        raw = raw.copy()
    return raw.view(_UNSIGNED[itemsize])


def to_device(arrays: list[mx.array]) -> None:
    """On CUDA, move arrays the host has just written to the device now, by one read there.
    MLX's CUDA arrays live in managed memory and pages written by the host stay on the host
    until a kernel faults them across: left to the question's first forward, a 64k entry's
    pages crossed at about 8 GB/s inside it (issue 28), and a memory-tier entry paid that on
    its first restore. A streaming read moves them in large runs; elsewhere this does nothing."""
    if arrays and managed_memory():
        mx.eval([mx.max(a) for a in arrays])  # no flat reshape: an array may pass int32 elements


def managed_memory() -> bool:
    """Whether MLX's arrays live in CUDA managed memory (the default device a CUDA GPU), whose
    pages sit on the host or on the device and move on first touch. On Apple silicon (Metal)
    and the CPU one memory serves both: nothing moves."""
    return mx.default_device().type == mx.DeviceType.gpu and mx.cuda.is_available()
