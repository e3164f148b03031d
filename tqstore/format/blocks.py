"""Token blocks and chained block keys (docs/architecture.md, "Identity and keys").

Tokens are cut into blocks of `block_size` (256) tokens; the last partial block is a block of
its own. Block i's key is

    sha256(key[i-1] (32 zero bytes for i = 0) || model digest || codec digest
           || calibration digest (i > 0 of a calibrated entry only)
           || token ids as u32 little-endian || token count as u32 little-endian)

so a key names a whole prefix, and two entries that share their first block share every later
block too (calibration is fitted from the first block's keys and stored in it).

A snapshot splits into three kinds of parts: per-block records (every layer that is not a ring
buffer, cut to the block's tokens: compressed rows, raw tail rows and per-256-token-block rows
each by the tokens they cover, `turboquant.records.token_span`; calibration in block 0;
recurrent states as they were at the block's end; CacheLists marked `rows` "token" member by
member, each by its own kind), one per-entry `Window` (the layers that cannot be cut, whole:
ring buffers, chunked caches, lists with a member that cannot be cut, a model's own cache class,
and recurrent states without a checkpoint at every block end; plus a 0-token template of every
other layer that fixes its layout, config and state) and the shared codecs. `join_blocks` puts
the first k blocks back together.
"""

from __future__ import annotations

import dataclasses
import hashlib
import struct
from abc import abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

import mlx.core as mx
import numpy as np

from turboquant.records import (BLOCK_ARRAYS, BLOCK_TOKENS, TOKEN_AXIS, CodecRecord, LayerRecord, Layout, Snapshot,
                                check_record_arrays, field_boundaries, field_plan, fields_at, join_children,
                                leaf_records, list_config, split_children, state_at, state_boundaries, token_span)

from tqstore.canonical import canonical_json, tensor_summary

BLOCK_SIZE = 256
ZERO_KEY = bytes(32)
MAX_TOKEN = 2**32 - 1


@dataclass(frozen=True)
class BlockKey:
    """A block's 32-byte key."""

    raw: bytes

    def __post_init__(self):
        if not isinstance(self.raw, bytes) or len(self.raw) != 32:
            raise ValueError(f"a block key is 32 bytes, got {self.raw!r:.80}")

    @property
    def hex(self) -> str:
        return self.raw.hex()

    @classmethod
    def from_hex(cls, text: str) -> "BlockKey":
        return cls(bytes.fromhex(text))

    def __str__(self) -> str:
        return self.hex


def token_bytes(tokens: Sequence[int]) -> bytes:
    """Token ids as u32 little-endian; ValueError for ids outside 0..2^32-1.

    Converted by numpy where every id fits in int64 (a lookup of a 32k-token prompt converts
    every token: about 2.7 ms in Python here, 0.4 ms this way)."""
    try:
        wide = np.fromiter(tokens, dtype=np.int64, count=len(tokens))
    except OverflowError:
        wide = None  # an id beyond int64: the check below names it
    if wide is not None:
        outside = (wide < 0) | (wide > MAX_TOKEN)
        if not outside.any():
            return wide.astype("<u4").tobytes()
    ids = [int(t) for t in tokens]
    bad = next((t for t in ids if not 0 <= t <= MAX_TOKEN), None)
    if bad is not None:
        raise ValueError(f"token id {bad} does not fit in u32")
    return struct.pack(f"<{len(ids)}I", *ids)


def block_key(
    parent: BlockKey | None,
    tokens: Sequence[int],
    model_digest: bytes,
    codec_digest: bytes,
    calibration_digest: bytes | None = None,
) -> BlockKey:
    """One block's key. `parent` is None for the first block, which never hashes calibration."""
    return key_of_ids(parent, token_bytes(tokens), model_digest, codec_digest, calibration_digest)


def key_of_ids(parent: BlockKey | None, ids: bytes, model_digest: bytes, codec_digest: bytes,
               calibration_digest: bytes | None) -> BlockKey:
    """`block_key` of the block whose ids are `ids` (u32 little-endian, as `token_bytes` gives
    them and objects store them)."""
    for name, d in (("model", model_digest), ("codec", codec_digest), ("calibration", calibration_digest)):
        if d is not None and (not isinstance(d, bytes) or len(d) != 32):
            raise ValueError(f"the {name} digest must be 32 raw bytes (use .digest, not .hexdigest)")
    h = hashlib.sha256(parent.raw if parent is not None else ZERO_KEY)
    h.update(model_digest)
    h.update(codec_digest)
    if parent is not None and calibration_digest is not None:
        h.update(calibration_digest)
    h.update(ids)
    h.update(struct.pack("<I", len(ids) // 4))
    return BlockKey(h.digest())


def block_spans(n_tokens: int, block_size: int = BLOCK_SIZE) -> list[tuple[int, int]]:
    """[start, stop) of every block of `n_tokens` tokens (the last may be partial)."""
    if block_size <= 0:
        raise ValueError(f"block size must be positive, got {block_size}")
    return [(s, min(s + block_size, n_tokens)) for s in range(0, n_tokens, block_size)]


def block_keys(
    tokens: Sequence[int],
    model_digest: bytes,
    codec_digest: bytes,
    calibration_digest: bytes | None = None,
    block_size: int = BLOCK_SIZE,
) -> list[BlockKey]:
    """The chained key of every block of `tokens` (none for no tokens); the ids are converted
    once for all blocks."""
    ids = token_bytes(tokens)
    keys: list[BlockKey] = []
    for start, stop in block_spans(len(ids) // 4, block_size):
        keys.append(key_of_ids(keys[-1] if keys else None, ids[4 * start:4 * stop], model_digest, codec_digest,
                            calibration_digest))
    return keys


def calibration_digest(snapshot: Snapshot) -> bytes | None:
    """Digest of every layer's calibration arrays, or None when no layer is calibrated."""
    return digest_calibration([(i, {n: tensor_summary(a) for n, a in r.calibration.items()})
                               for i, r in enumerate(snapshot.layers)])


def digest_calibration(layers: Iterable[tuple[int, Mapping[str, Mapping]]]) -> bytes | None:
    """sha256 of the canonical JSON [[layer index, {name: {dtype, shape, sha256}}], ...] over the
    layers that hold calibration arrays, in layer order; None when there are none.

    Takes array summaries (`identity.tensor_summary`), so a reader can check the digest from a
    header before it decodes any tensor.
    """
    items = [[i, {n: {k: s[k] for k in ("dtype", "shape", "sha256")} for n, s in sorted(arrays.items())}]
             for i, arrays in sorted(layers, key=lambda ia: ia[0]) if arrays]
    return hashlib.sha256(canonical_json(items)).digest() if items else None


@dataclass(frozen=True, eq=False)
class Block:
    """Tokens [start, start + n_tokens) of every per-token layer (keyed by layer index).

    Block i starts at token i * block_size; every block but the last holds block_size tokens.
    """

    index: int
    start: int
    n_tokens: int
    layers: Mapping[int, LayerRecord]  # a dict, or LazyLayers: GroupedLayers (decoded), CutLayers (split)
    block_size: int = BLOCK_SIZE


@dataclass(frozen=True, eq=False)
class Joined:
    """One array name's group joined over consecutive blocks ([layers, *array shape], every
    block's tokens along the token axis). Blocks kept in memory after a join hold views of it,
    so that the next join of the same blocks is a slice of it, not a copy; the memory tier
    counts its bytes once, however many blocks share it."""

    data: mx.array

    @property
    def nbytes(self) -> int:
        return self.data.nbytes


@dataclass(frozen=True, eq=False)
class ArrayGroup:
    """The arrays of one name in a block, one per layer of `layers` (in that order), held as
    one array `data` of shape [len(layers), *each array's shape]: what a stored group decodes
    to. Joins concatenate groups, not arrays. With a `base`, `data` is the view of tokens
    [start, stop) of that joined group."""

    name: str
    layers: tuple[int, ...]
    data: mx.array
    base: Joined | None = None
    start: int = 0
    stop: int = 0


def layer_view(data: mx.array, k: int) -> mx.array:
    """Layer `k`'s array of a group's data, a view (MLX's `data[k]` gathers: a copy)."""
    return data[k:k + 1].squeeze(0)


class LazyLayers(Mapping[int, LayerRecord]):
    """A block's layers whose records are built on first access (`records`); iterating and
    counting them builds none."""

    order: Sequence[int]  # the layer indices, in order

    def __getitem__(self, index: int) -> LayerRecord:
        return self.records()[index]

    def __iter__(self) -> Iterator[int]:
        return iter(self.order)

    def __len__(self) -> int:
        return len(self.order)

    @abstractmethod
    def records(self) -> dict[int, LayerRecord]:
        """Every layer as a plain record (built once)."""


class GroupedLayers(LazyLayers):
    """A decoded block's layers whose arrays all lie in `ArrayGroup`s. The records (their
    arrays views of the groups) are built on first access, so a restore that joins by groups
    builds none of them.

    `shells` are the layers without their arrays: each shell's `arrays` maps the layer's array
    names, in the stored order, to None.
    """

    def __init__(self, shells: dict[int, LayerRecord], groups: tuple[ArrayGroup, ...]) -> None:
        self.shells, self.groups, self.order = shells, groups, tuple(shells)
        self._records: dict[int, LayerRecord] | None = None

    @property
    def nbytes(self) -> int:
        """Bytes of the arrays (without building the records)."""
        return sum(g.data.nbytes for g in self.groups) + self._calibration_nbytes()

    def holdings(self) -> tuple[int, tuple[Joined, ...]]:
        """(bytes of the arrays held by this block alone, the joined groups it holds views of):
        what keeping it in memory costs, a joined group counted once by whoever holds it."""
        own = sum(g.data.nbytes for g in self.groups if g.base is None) + self._calibration_nbytes()
        return own, tuple({id(g.base): g.base for g in self.groups if g.base is not None}.values())

    def _calibration_nbytes(self) -> int:
        return sum(a.nbytes for s in self.shells.values() for a in s.calibration.values())

    def records(self) -> dict[int, LayerRecord]:
        if self._records is None:
            arrays = {i: dict(s.arrays) for i, s in self.shells.items()}
            for g in self.groups:
                for k, i in enumerate(g.layers):
                    arrays[i][g.name] = layer_view(g.data, k)
            self._records = {i: dataclasses.replace(s, arrays=arrays[i]) for i, s in self.shells.items()}
        return self._records


@dataclass(frozen=True, eq=False)
class Window:
    """The per-entry layers: ROTATING layers whole, every other layer as a 0-token template."""

    layers: list[LayerRecord]


@dataclass(frozen=True, eq=False)
class SharedCodecs:
    """The codecs of an entry (stored once per entry, keyed by `identity.codecs_digest`)."""

    codecs: dict[str, CodecRecord]


@dataclass(frozen=True, eq=False)
class SplitSnapshot:
    """A snapshot cut into blocks, its window and its shared codecs."""

    blocks: list[Block]
    window: Window
    shared: SharedCodecs
    block_size: int = BLOCK_SIZE

    @property
    def reusable_as_prefix(self) -> bool:
        """Whether a prefix of the blocks can be restored (every layer is in the blocks)."""
        return all(_in_blocks(r) for r in self.window.layers)


def _in_blocks(template: LayerRecord) -> bool:
    """Whether a window record is the template of a layer kept in the blocks (not whole)."""
    if template.layout is Layout.FIELDS:
        return field_plan(template) is not None and template.offset == 0 and not template.arrays
    if template.layout is Layout.LIST:
        return template.offset == 0 and template.config.get("rows") == "token" \
            and all(_in_blocks(c) for c in split_children(template))
    return template.per_token or (template.layout is Layout.STATE and template.offset == 0 and not template.arrays)


def _checkpointed(r: LayerRecord, spans: Sequence[tuple[int, int]]) -> bool:
    """Whether a STATE record holds its state at every block end (so that it goes in the blocks)."""
    return r.layout is Layout.STATE and bool(r.arrays) and set(state_boundaries(r)) >= {stop for _, stop in spans[:-1]}


def _list_in_blocks(r: LayerRecord, spans: Sequence[tuple[int, int]]) -> bool:
    """Whether a LIST record is cut into blocks member by member: its snapshot marked it `rows`
    "token", and every member is per token or a recurrent state checkpointed at every block end
    (nested lists alike)."""
    return r.layout is Layout.LIST and r.config.get("rows") == "token" and all(
        _list_in_blocks(c, spans) if c.layout is Layout.LIST else c.per_token or _checkpointed(c, spans)
        for c in split_children(r))


def _fields_in_blocks(r: LayerRecord, spans: Sequence[tuple[int, int]]) -> bool:
    """Whether a FIELDS record is cut into blocks: a class of `FIELD_PLANS` marked `rows`
    "token", with its fields at every block end."""
    return field_plan(r) is not None and set(field_boundaries(r)) >= {stop for _, stop in spans[:-1]}


def _cut_fields(r: LayerRecord, start: int, stop: int) -> LayerRecord:
    """Tokens [start, stop) of a block-kept FIELDS record (start == stop == 0: its template):
    the rows its grown fields added over them, its other fields as they were at `stop`; fields
    that were None are None scalars in the state, as in the record."""
    plan = field_plan(r)
    scalars = {k: v for k, v in r.state.items() if "@" not in k and k not in (*plan.ends, *plan.grows)}
    state = {**scalars, "offset": stop - start} if "offset" in scalars else scalars
    if start == stop:
        return LayerRecord(Layout.FIELDS, 0, {}, r.config, state)
    ends, grown = fields_at(r, stop)
    lo = fields_at(r, start)[1] if start else dict.fromkeys(plan.grows, 0)
    arrays = {f: a for f, a in ends.items() if a is not None}
    state.update({f: None for f, a in ends.items() if a is None})
    for f in plan.grows:
        if grown[f] > lo[f]:
            index = (slice(None),) * plan.axis + (slice(lo[f], grown[f]),)
            arrays[f] = r.arrays[f][index]
    return LayerRecord(Layout.FIELDS, stop - start, arrays, r.config, state)


def _cut_list(r: LayerRecord, start: int, stop: int) -> LayerRecord:
    """Tokens [start, stop) of a LIST record cut member by member (start == stop == 0: its
    template): per-token members by their tokens, recurrent states as they were at `stop`."""
    def member(c: LayerRecord) -> LayerRecord:
        if c.layout is Layout.LIST:
            return _cut_list(c, start, stop)
        if c.layout is Layout.STATE:
            return LayerRecord(Layout.STATE, stop - start, state_at(c, stop) if stop else {}, c.config)
        return _cut(c, start, stop, False)
    return join_children([member(c) for c in split_children(r)], list_config(r))


def split_snapshot(snapshot: Snapshot, block_size: int = BLOCK_SIZE) -> SplitSnapshot:
    """Cut a snapshot into blocks of `block_size` tokens (slices, nothing copied; each block's
    per-token records are made on first use, `CutLayers`).

    Every non-ROTATING layer must hold `snapshot.offset` tokens (all layers of one model see
    the same tokens). Each array is cut by the tokens it covers (`token_span`: compressed rows,
    the raw tail, or per-block rows such as `keys_shift`); a block's `state["stored"]` counts
    its compressed tokens. Calibration goes into block 0 (into the window when there are no
    tokens).
    """
    n = snapshot.offset
    for i, r in enumerate(snapshot.layers):
        if r.per_token and r.offset != n:
            raise ValueError(f"layer {i} holds {r.offset} tokens, other layers {n}: a snapshot splits into "
                             "blocks only when every layer holds the same tokens")
        if r.per_token and block_size % BLOCK_TOKENS and set(r.arrays) & set(BLOCK_ARRAYS):
            raise ValueError(f"layer {i} keeps rows per {BLOCK_TOKENS}-token block ({sorted(BLOCK_ARRAYS)}): "
                             f"the block size must be a multiple of {BLOCK_TOKENS}, not {block_size}")
    spans = block_spans(n, block_size)
    states = {i for i, r in enumerate(snapshot.layers) if _checkpointed(r, spans)}
    lists = {i for i, r in enumerate(snapshot.layers) if _list_in_blocks(r, spans)}
    fields = {i for i, r in enumerate(snapshot.layers) if _fields_in_blocks(r, spans)}
    for i in sorted(states | lists | fields):
        for path, leaf in leaf_records([snapshot.layers[i]]):
            if leaf.offset != n:
                raise ValueError(f"layer {i} ({leaf.layout.value} member {path}) holds {leaf.offset} tokens, other "
                                 f"layers {n}: a snapshot splits into blocks only when every layer holds the same tokens")

    def other(i: int, r: LayerRecord, start: int, stop: int) -> LayerRecord:
        if i in states:
            return LayerRecord(Layout.STATE, stop - start, state_at(r, stop), r.config)
        if i in lists:
            return _cut_list(r, start, stop)
        return _cut_fields(r, start, stop)

    order = [i for i, r in enumerate(snapshot.layers) if r.per_token or i in states or i in lists or i in fields]
    kept = sorted(states | lists | fields)
    token_spans = {i: [(n, token_span(snapshot.layers[i], n)) for n in snapshot.layers[i].arrays]
                   for i in order if i not in kept}
    blocks = [Block(b, start, stop - start,
                    CutLayers(snapshot.layers, order, {i: other(i, snapshot.layers[i], start, stop) for i in kept},
                              start, stop, b == 0, token_spans), block_size)
              for b, (start, stop) in enumerate(spans)]
    window = Window([LayerRecord(Layout.STATE, 0, {}, r.config) if i in states else _cut_list(r, 0, 0) if i in lists
                     else _cut_fields(r, 0, 0) if i in fields else _cut(r, 0, 0, not spans) if r.per_token else r
                     for i, r in enumerate(snapshot.layers)])
    return SplitSnapshot(blocks, window, SharedCodecs(snapshot.codecs), block_size)


def join_blocks(split: SplitSnapshot, n_blocks: int | None = None) -> Snapshot:
    """The snapshot made of the first `n_blocks` blocks (all by default), the window and the codecs.

    Arrays are exactly the original ones (concatenated along the token axis). A prefix of the
    blocks cannot be restored for an entry with ROTATING layers: their ring buffers hold the
    whole entry's window, so such entries are reused whole.
    """
    return join_resident(split, n_blocks)[0]


def join_resident(split: SplitSnapshot, n_blocks: int | None = None) -> tuple[Snapshot, list[Block]]:
    """`join_blocks`, and the joined blocks to keep in memory instead of the ones given: where
    the blocks hold their arrays in groups, each block's groups become views of the joined
    groups (`ArrayGroup.base`), so that joining those blocks again (or a prefix of them) is a
    slice of what this join made, not a copy, and memory holds each byte once. Joined groups
    and views are evaluated here: lazy views would be bound to this thread's stream."""
    k = len(split.blocks) if n_blocks is None else n_blocks
    if not 0 <= k <= len(split.blocks):
        raise ValueError(f"cannot join {k} blocks of an entry with {len(split.blocks)}")
    if k < len(split.blocks) and not split.reusable_as_prefix:
        raise ValueError("this entry has layers that cannot be cut (ring buffers, recurrent states without "
                         f"block checkpoints, ...): restore all {len(split.blocks)} blocks, not a prefix of {k}")
    blocks = split.blocks[:k]
    start = 0
    for b, block in enumerate(blocks):
        if block.index != b or block.start != start or block.block_size != split.block_size:
            raise ValueError(f"block {b} is out of order or of another block size (index {block.index}, starts "
                             f"at token {block.start}, expected {start}; size {block.block_size})")
        start += block.n_tokens
    in_blocks = {i for i, r in enumerate(split.window.layers) if _in_blocks(r)}
    extra = sorted({i for blk in blocks for i in blk.layers} - in_blocks)
    if extra:
        raise ValueError(f"blocks hold layers {extra}, which the window lists as whole or absent")
    found = _join_groups(split.window.layers, in_blocks, blocks)
    grouped, bases = found if found is not None else (None, None)
    join = {Layout.LIST: _join_list, Layout.STATE: _join_state, Layout.FIELDS: _join_fields}
    layers = [r if i not in in_blocks else grouped[i] if grouped is not None else join.get(r.layout, _join_layer)(i, r, blocks)
              for i, r in enumerate(split.window.layers)]
    held = {id(g.base) for b in blocks for g in b.layers.groups} if bases else set()
    fresh = any(id(j) not in held for j in bases.values()) if bases else False  # made by this join
    return Snapshot(layers=layers, codecs=split.shared.codecs), _rebased(blocks, bases) if fresh else list(blocks)


def _cut(r: LayerRecord, start: int, stop: int, with_calibration: bool) -> LayerRecord:
    """Tokens [start, stop) of a per-token layer as a record of its own (start == stop: a template)."""
    arrays = {name: r.arrays[name][:, :, lo:hi] for name, (lo, hi) in cut_windows(r, start, stop).items()}
    return LayerRecord(r.layout, stop - start, arrays, r.config, cut_state(r, start, stop),
                       r.calibration if with_calibration else {})


def cut_windows(r: LayerRecord, start: int, stop: int,
                spans: Sequence[tuple[str, tuple[int, int] | None]] | None = None) -> dict[str, tuple[int, int]]:
    """Where `_cut` takes each array of tokens [start, stop) of a per-token layer from: [lo, hi)
    along the token axis of `r`'s array, for the arrays the cut keeps, in `r`'s order. `spans`:
    each array's `token_span`, where the caller has them."""
    stored = int(r.state.get("stored", 0))
    windows = {}
    for name, span in spans if spans is not None else ((n, token_span(r, n)) for n in r.arrays):
        if span is None:  # per-block rows: axis 2 counts BLOCK_TOKENS-token blocks
            first = start // BLOCK_TOKENS
            windows[name] = (first, max(first, -(-min(stop, stored) // BLOCK_TOKENS)))
            continue
        lo, hi = max(start, span[0]), min(stop, span[1])
        # RAW layers keep their arrays even with no tokens (templates keep dtypes and shapes);
        # a compressed layer holds only the arrays covering some of its tokens.
        if hi > lo or r.layout is Layout.RAW:
            windows[name] = (lo - span[0], max(lo, hi) - span[0])
    return windows


def cut_state(r: LayerRecord, start: int, stop: int) -> dict:
    """The state of `_cut`'s record: `stored` counts the compressed tokens among [start, stop)."""
    state = dict(r.state)
    if "stored" in state:
        state["stored"] = min(max(int(r.state["stored"]) - start, 0), stop - start)
    return state


class CutLayers(LazyLayers):
    """The layers of a block of `split_snapshot`: the per-token ones as cuts of the snapshot's
    records (`_cut`), built on first access, the others (recurrent states, lists, fields) as
    given. A put encodes such blocks from the snapshot's own arrays and each block's windows
    into them (`cut_windows`), without an MLX slice per block and array: 4,170 slices, their
    evaluation and numpy views cost a turbo4 8k put about a quarter of its time."""

    def __init__(self, source: Sequence[LayerRecord], order: Sequence[int], others: dict[int, LayerRecord],
                 start: int, stop: int, with_calibration: bool,
                 spans: Mapping[int, Sequence[tuple[str, tuple[int, int] | None]]] | None = None) -> None:
        self.source, self.order, self.others = source, tuple(order), others
        self.start, self.stop, self.with_calibration = start, stop, with_calibration
        self._spans = spans or {}  # each cut layer's arrays' token spans, shared by the blocks of a split
        self._records: dict[int, LayerRecord] | None = None
        self._windows: dict[int, dict[str, tuple[int, int]]] = {}

    def windows(self, index: int) -> dict[str, tuple[int, int]]:
        """`cut_windows` of cut layer `index` (made once)."""
        found = self._windows.get(index)
        if found is None:
            found = self._windows[index] = cut_windows(self.source[index], self.start, self.stop,
                                                       self._spans.get(index))
        return found

    @property
    def cuts(self) -> tuple[int, ...]:
        """The layers that are cuts of the snapshot's records."""
        return tuple(i for i in self.order if i not in self.others)

    @property
    def nbytes(self) -> int:
        """Bytes of the arrays (without building the records)."""
        total = sum(r.nbytes for r in self.others.values())
        for i in self.cuts:
            r = self.source[i]
            for name, (lo, hi) in self.windows(i).items():
                a = r.arrays[name]
                total += a.nbytes // a.shape[TOKEN_AXIS] * (hi - lo) if a.shape[TOKEN_AXIS] else 0
            if self.with_calibration:
                total += sum(c.nbytes for c in r.calibration.values())
        return total

    def records(self) -> dict[int, LayerRecord]:
        if self._records is None:
            self._records = {i: self.others[i] if i in self.others
                             else _cut(self.source[i], self.start, self.stop, self.with_calibration)
                             for i in self.order}
        return self._records


def _join_groups(templates: list[LayerRecord], in_blocks: set[int], blocks: Sequence[Block]
                 ) -> tuple[dict[int, LayerRecord], dict[str, Joined]] | None:
    """The joined layers of blocks whose arrays are all in groups, one concatenation per array
    name (none where the blocks are consecutive views of one joined group from its first token:
    a slice of it), the same records `_join_layer` makes (as views of the joined groups); and
    the joined group of each name. None where the blocks are not all grouped alike (other
    layers, layer sets or shapes per name); the per-layer join then applies, with its messages
    for blocks that do not fit."""
    if not blocks or not all(isinstance(b.layers, GroupedLayers) for b in blocks):
        return None
    layers = sorted(in_blocks)
    if any(templates[i].layout in (Layout.STATE, Layout.LIST, Layout.FIELDS) for i in layers):
        return None
    partial = {i: False for i in layers}
    checked = None  # (shells, n_tokens) of the block before, when it passed with no partial layer
    for blk in blocks:
        shells = blk.layers.shells
        if checked == (id(shells), blk.n_tokens) and blk.index > 0:
            continue  # the very records the block before passed with (blocks decoded from one table share them)
        if sorted(shells) != layers:
            return None
        for i in layers:
            part, template = shells[i], templates[i]
            stored = int(part.state.get("stored", 0))
            if part.layout is not template.layout or part.config != template.config \
                    or _without_stored(part.state) != _without_stored(template.state) \
                    or part.offset != blk.n_tokens or (blk.index > 0 and part.calibration) \
                    or (partial[i] and stored):
                return None
            partial[i] = partial[i] or stored < part.offset
        checked = None if any(partial.values()) else (id(shells), blk.n_tokens)
    by_name: dict[str, list[ArrayGroup]] = {}
    for blk in blocks:
        for g in blk.layers.groups:
            by_name.setdefault(g.name, []).append(g)
    joined: dict[int, dict[str, mx.array]] = {i: {} for i in layers}
    bases: dict[str, Joined] = {}
    for name, groups in by_name.items():
        first = groups[0]
        # Views of one joined group were checked alike when it was joined (or built: build_run).
        if not _views_of_one(groups) and any(
                g.layers != first.layers or g.data.dtype != first.data.dtype
                or _without_tokens(g.data.shape[1:]) != _without_tokens(first.data.shape[1:]) for g in groups):
            return None
        for i in first.layers:
            t = templates[i].arrays.get(name)
            if t is not None and (t.dtype != first.data.dtype
                                  or _without_tokens(t.shape) != _without_tokens(first.data.shape[1:])):
                return None
        data, bases[name] = _joined(groups)
        for k, i in enumerate(first.layers):
            joined[i][name] = layer_view(data, k)
    runs: dict[int, list] = {}  # the distinct shells (blocks decoded from one table share them), how many blocks
    for blk in blocks:
        runs.setdefault(id(blk.layers.shells), [blk.layers.shells, 0])[1] += 1
    out = {}
    for i in layers:
        template = templates[i]
        names = dict.fromkeys(n for shells, _ in runs.values() for n in shells[i].arrays)
        state = dict(template.state)
        if "stored" in state:
            state["stored"] = sum(n * int(shells[i].state["stored"]) for shells, n in runs.values())
        out[i] = LayerRecord(template.layout, sum(n * shells[i].offset for shells, n in runs.values()),
                             {n: joined[i][n] for n in names}, template.config, state,
                             blocks[0].layers.shells[i].calibration)
        check_record_arrays(out[i])
    return out, bases


_GROUP_TOKENS = TOKEN_AXIS + 1  # the token axis of a group's data ([layers, *array shape])


def _views_of_one(groups: Sequence[ArrayGroup]) -> bool:
    """Whether `groups` are consecutive views of one joined group, from its first token."""
    base = groups[0].base
    return base is not None and groups[0].start == 0 and all(g.base is base for g in groups) \
        and all(a.stop == b.start for a, b in zip(groups, groups[1:]))


def _joined(groups: Sequence[ArrayGroup]) -> tuple[mx.array, Joined]:
    """The groups of one name joined along the token axis, and the joined group that holds it:
    their common base itself where they are all of its consecutive views (blocks kept in memory
    by an earlier join), a copy of its first tokens where they are its first ones, else a
    concatenation (one group: itself)."""
    base = groups[0].base
    if _views_of_one(groups):
        stop = groups[-1].stop
        if stop == base.data.shape[_GROUP_TOKENS]:
            return base.data, base
        # A prefix: copied into a row-contiguous array (as a concatenation made it), since every
        # layer's view of a token slice is strided and kernels would copy it at every step.
        return mx.contiguous(base.data[(slice(None),) * _GROUP_TOKENS + (slice(0, stop),)]), base
    data = groups[0].data if len(groups) == 1 else mx.concatenate([g.data for g in groups], axis=_GROUP_TOKENS)
    return data, Joined(data)


def _rebased(blocks: Sequence[Block], bases: Mapping[str, Joined]) -> list[Block]:
    """`blocks` (grouped, as `_join_groups` joined them) with each group a view of its name's
    joined group; a group that already is one stays as it is. The new views are evaluated."""
    at = dict.fromkeys(bases, 0)
    out, fresh = [], []
    for blk in blocks:
        groups = []
        for g in blk.layers.groups:
            base, start = bases[g.name], at[g.name]
            stop = at[g.name] = start + g.data.shape[_GROUP_TOKENS]
            if g.base is not base or (g.start, g.stop) != (start, stop):
                view = base.data[(slice(None),) * _GROUP_TOKENS + (slice(start, stop),)]
                g = ArrayGroup(g.name, g.layers, view, base, start, stop)
                fresh.append(view)
            groups.append(g)
        same = all(a is b for a, b in zip(groups, blk.layers.groups))
        out.append(blk if same else Block(blk.index, blk.start, blk.n_tokens,
                                          GroupedLayers(blk.layers.shells, tuple(groups)), blk.block_size))
    if fresh:
        mx.eval([b.data for b in bases.values()], fresh)
    return out


def _join_layer(i: int | str, template: LayerRecord, blocks: Sequence[Block]) -> LayerRecord:
    if not blocks:
        return template
    parts, partial = [], False
    for blk in blocks:
        part = blk.layers.get(i)
        if part is None:
            raise ValueError(f"block {blk.index} lacks layer {i}")
        if part.layout is not template.layout or part.config != template.config \
                or _without_stored(part.state) != _without_stored(template.state):
            raise ValueError(f"block {blk.index} stores layer {i} as {part.layout.value} with another config or "
                             f"state than the entry ({template.layout.value}): blocks of different saves mixed")
        if part.offset != blk.n_tokens or (blk.index > 0 and part.calibration):
            raise ValueError(f"block {blk.index} holds {part.offset} tokens of layer {i} (expected {blk.n_tokens})"
                             f"{' and calibration, which only block 0 may hold' if part.calibration else ''}")
        stored = int(part.state.get("stored", 0))
        if partial and stored:
            raise ValueError(f"block {blk.index} has compressed tokens of layer {i} after a block with raw ones: "
                             "blocks of different saves mixed")
        partial = partial or stored < part.offset
        parts.append(part)
    names = list(dict.fromkeys(n for p in parts for n in p.arrays))
    for name in names:
        first = next(p.arrays[name] for p in parts if name in p.arrays)
        t = template.arrays.get(name, first)
        for a in (p.arrays[name] for p in parts if name in p.arrays):
            if a.dtype != t.dtype or _without_tokens(a.shape) != _without_tokens(t.shape):
                raise ValueError(f"layer {i} {name}: block arrays {a.dtype}{a.shape} do not match {t.dtype}{t.shape}")
    arrays = {}
    for name in names:
        pieces = [p.arrays[name] for p in parts if name in p.arrays]
        arrays[name] = pieces[0] if len(pieces) == 1 else mx.concatenate(pieces, axis=TOKEN_AXIS)
    state = dict(template.state)
    if "stored" in state:
        state["stored"] = sum(int(p.state["stored"]) for p in parts)
    joined = LayerRecord(template.layout, sum(p.offset for p in parts), arrays, template.config, state,
                         parts[0].calibration)
    check_record_arrays(joined)
    return joined


def _part(blk: Block, i: int | str, template: LayerRecord, what: str) -> LayerRecord:
    """Block `blk`'s part of layer `i`, which must be of the template's layout and config and
    hold the block's tokens."""
    part = blk.layers.get(i)
    if part is None or part.layout is not template.layout or part.config != template.config \
            or part.offset != blk.n_tokens:
        raise ValueError(f"block {blk.index} lacks layer {i}'s {what} or stores another kind: blocks of different saves "
                         "mixed")
    return part


def _join_list(i: int | str, template: LayerRecord, blocks: Sequence[Block]) -> LayerRecord:
    """A CacheList kept member by member: each member joined by its own kind (its parts in
    the blocks are addressed as "<layer>.c<member>" in the messages)."""
    if not blocks:
        return template
    parts = [split_children(_part(blk, i, template, "CacheList")) for blk in blocks]
    members = []
    for j, member in enumerate(split_children(template)):
        key = f"{i}.c{j}"
        pieces = [Block(b.index, b.start, b.n_tokens, {key: p[j]}, b.block_size) for b, p in zip(blocks, parts)]
        join = _join_list if member.layout is Layout.LIST else _join_state if member.layout is Layout.STATE \
            else _join_layer
        members.append(join(key, member, pieces))
    joined = join_children(members, list_config(template))
    check_record_arrays(joined)
    return joined


def _join_fields(i: int, template: LayerRecord, blocks: Sequence[Block]) -> LayerRecord:
    """A block-kept FIELDS record: the grown fields' rows concatenated, the other fields as the
    last block holds them, and the earlier block ends as `<field>@<t>` checkpoints."""
    if not blocks:
        return template
    plan = field_plan(template)
    arrays: dict[str, mx.array] = {}
    state = dict(template.state)
    grown: dict[str, list[mx.array]] = {f: [] for f in plan.grows}
    seen = 0
    for blk in blocks:
        part = _part(blk, i, template, "fields")
        if seen:  # the block before ended here
            arrays.update({f"{f}@{seen}": a for f, a in ends.items() if a is not None})
            state.update({f"{f}@{seen}": None for f, a in ends.items() if a is None})
            state.update({f"{f}@{seen}": sum(a.shape[plan.axis] for a in grown[f]) for f in plan.grows})
        seen += part.offset
        ends = {f: part.arrays.get(f) for f in plan.ends}
        for f in plan.grows:
            if f in part.arrays:
                grown[f].append(part.arrays[f])
    arrays.update({f: a for f, a in ends.items() if a is not None})
    state.update({f: None for f, a in ends.items() if a is None})
    for f, pieces in grown.items():
        if pieces:
            arrays[f] = pieces[0] if len(pieces) == 1 else mx.concatenate(pieces, axis=plan.axis)
        else:
            state[f] = None
    if "offset" in state:
        state["offset"] = seen
    return LayerRecord(Layout.FIELDS, seen, arrays, template.config, state)


def _join_state(i: int | str, template: LayerRecord, blocks: Sequence[Block]) -> LayerRecord:
    """The recurrent state after the last block, with the earlier block ends as checkpoints."""
    if not blocks:
        return template
    arrays, seen = {}, 0
    for blk in blocks:
        part = blk.layers.get(i)
        if part is None or part.layout is not Layout.STATE or part.config != template.config \
                or part.offset != blk.n_tokens:
            raise ValueError(f"block {blk.index} lacks layer {i}'s recurrent state or stores another kind: blocks of "
                             "different saves mixed")
        if seen:
            arrays.update({f"{name}@{seen}": a for name, a in previous.items()})
        previous, seen = part.arrays, seen + part.offset
    joined = LayerRecord(Layout.STATE, seen, {**arrays, **previous}, template.config)
    check_record_arrays(joined)
    return joined


def _without_stored(state: Mapping) -> dict:
    return {k: v for k, v in state.items() if k != "stored"}


def _without_tokens(shape: Sequence[int]) -> tuple[int, ...]:
    return tuple(shape[:TOKEN_AXIS]) + tuple(shape[TOKEN_AXIS + 1:])
