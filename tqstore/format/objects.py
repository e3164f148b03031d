"""Snapshot parts <-> bytes: a verified frame around an object's header and groups (docs/format.md).

    frame (64 bytes)  magic "\\x89TQS\\r\\n\\x1a\\n", u32 format version, u32 reserved (0),
                      u64 header length, u64 payload length, sha256 (format 3: of the header;
                      formats 1 and 2: of the payload)
    format 3          a binary header (tables.py: fixed-size records for groups, layers, arrays
                      and codecs, a dictionary of distinct strings and scalar maps), then one
                      group per array name and dtype at 64-byte aligned offsets, each with the
                      xxh3-128 of its stored bytes in the header
    format 2          a safetensors payload: one U8 tensor per group; its metadata holds the
                      JSON header (still read, and written for tests of stores that hold it)

Three verbs, like safetensors: `dumps(obj, provenance)`, `loads(data, expect=...)` and
`inspect(data)`; `loads` is `parse` (every check and decode, no MLX: any thread) then `build`
(MLX arrays, one per group, on the caller's thread). Parsing checks the frame (magic, readable
version, lengths, the header's digest) before it parses anything, then the header and its
internal consistency (block key, calibration digest), then the expected identity and tokens,
then every group's digest, and only then decodes: it returns a whole object or raises one of
tqstore's error types, never a part. Payloads are parsed here (numpy views of the bytes), not
by mx.load, so damaged input never reaches a C++ parser and nothing is written to a temporary
file. Format 1 (one tensor per array, each with its own digest) is still read.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
import functools
import hashlib
import os
import json
import struct
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterator, Mapping, Sequence

import mlx.core as mx
import numpy as np
import xxhash
import zstandard

from turboquant.records import CodecRecord, LayerRecord, Snapshot

from tqstore.format.blocks import (ArrayGroup, Block, BlockKey, CutLayers, GroupedLayers, SharedCodecs, Window,
                                   block_key, cut_state, digest_calibration)
from tqstore.canonical import DTYPES, canonical_json, dtype_name, tensor_from_bytes, unsigned_view
from tqstore.errors import (BadMagic, ChecksumMismatch, IdentityMismatch, MalformedHeader,
                     TokenMismatch, TruncatedData)
from tqstore.format.header import (BlockInfo, CodecInfo, Expect, GroupInfo, Header, LayerInfo, Provenance, TensorInfo, json_value,
                     codec_tensor, layer_tensor, parse_header)
from tqstore.format import runs
from tqstore.format.runs import Run, aligned, plan_of
from tqstore.format.tables import Groups, Tables, encode_header, encode_tables, read_header
from tqstore.format.versions import check_version
from tqstore.models.identity import FORMAT_VERSION

MAGIC = b"\x89TQS\r\n\x1a\n"
READABLE_VERSIONS = frozenset({1, 2, 3})
OBJECT_VERSION = 3  # what dumps writes; the codec identity's format_version (data model) stays 1
META_KEY = "tqstore"
_FRAME = struct.Struct("<8sIIQQ32s")
FRAME_SIZE = _FRAME.size  # 64
ZSTD_LEVEL = 1  # on byte-shuffled halves level 1 is both faster and smaller than 3 (docs/format.md)
# Format 3 stores unsigned integer groups (TurboQuant codes, affine words) without trying zstd:
# packed codes are near their entropy (zstd saves 0-5% on them, docs/format.md), so a trial costs
# put time for nothing and decoding would cost restore time for almost nothing.
PACKED_DTYPES = frozenset({"uint8", "uint16", "uint32", "uint64"})
# Format 3 keeps zstd on a group only where it halves it: raw float K/V save 15% (fp16, fp32) to 31%
# (bf16) shuffled, turbo norms and scales 16-26%, and zstd decodes at about 1 GB/s per core, so a
# restore reads those bytes sooner than it decodes them from any disk faster than about 0.2-0.4
# GB/s (docs/format.md, "zstd measurements"); groups that halve (zeros, constants) decode fast.
MIN_SAVING = 0.50
MIN_SAVING_V2 = 0.10  # what format 2 was written with (kept for tests of stores that hold it)
MIN_COMPRESS_BYTES = 256
# Groups choose their encoding on their first 4 KiB: a turbo4 8k put tried zstd and shuffle+zstd on
# 230 whole groups of 12-48 KiB (norms, scales, biases, shifts), 27 ms of zstd, to store each raw; a
# group that halves (zeros, constants) shows it in any sample.
SAMPLE_BYTES = 1 << 12
SAMPLE_BYTES_V2 = 1 << 18  # what format 2 was written with
THREADED_BYTES = 1 << 20  # groups this large are encoded and hashed on the format's threads
_COPY_CHUNK = 1 << 23  # a GPU group's host copy, split for the threads

__all__ = ["dumps", "dumps_parsed", "dumps_objects", "loads", "load", "inspect", "OBJECT_VERSION", "Expect", "Provenance", "Header", "LayerInfo", "TensorInfo", "CodecInfo",
           "BlockInfo", "MAGIC", "READABLE_VERSIONS", "FORMAT_VERSION"]

Obj = Snapshot | Block | Window | SharedCodecs


def dumps(obj: Obj, provenance: Provenance = Provenance(), version: int = OBJECT_VERSION) -> bytes:
    """Serialize a Snapshot, Block, Window or SharedCodecs with its provenance.

    A block's key is computed here from the provenance, so a stored block always matches its
    key; for block 0 and snapshots the calibration digest is computed from the data. Raises
    ValueError for an object that breaks the data model (arrays of another layout, shapes,
    dtypes, non-scalar config values). `version` 2 writes the format before (for tests of
    stores that hold it).
    """
    return b"".join(_dump(obj, provenance, version)[0])


def dumps_parsed(obj: Obj, provenance: Provenance = Provenance()) -> tuple[tuple[memoryview, ...], "Parsed"]:
    """`dumps` as consecutive buffers (joined, they are its bytes: a writer copies each group
    once, into its store, instead of once more into one object), and the object as `parse`
    gives it back: its header and each group's decoded bytes (numpy buffers, the very ones the
    raw-encoded parts are), for `build`, or `build_run` to make the blocks of one put together,
    each byte copied once into its joined array."""
    parts, header, raws = _dump(obj, provenance, OBJECT_VERSION)
    return tuple(memoryview(p).cast("B") for p in parts), Parsed(header, raws)


def dumps_objects(objs: Sequence[Obj], provenances: Sequence[Provenance]
                  ) -> Iterator[tuple[int, tuple[memoryview, ...], "Parsed"]]:
    """`dumps_parsed` of several objects of one entry, as (index, parts, parsed) in the order
    they are made, each object's bytes exactly its own `dumps_parsed`'s, with work that grows
    with the bytes and the layers, not with the blocks times their arrays: blocks of one layout
    (the same layers, configs, states, array names, dtypes and shapes, no calibration) share
    their header's tables, encoded once, and each of their arrays is copied into the blocks'
    groups at once: for the blocks of `split_snapshot` from the snapshot's own arrays, one
    strided copy per array name and layer (`_cut_bytes`). A turbo4 8k entry holds 4,170 arrays
    in 34 objects; one object at a time, each array cost its own slice, copy and header records."""
    classes: dict[tuple, list[int]] = {}
    memo: dict[int, tuple] = {}
    for k, obj in enumerate(objs):
        signature = _signature(obj, memo)
        if signature is None:
            yield k, *dumps_parsed(obj, provenances[k])
        else:
            classes.setdefault(signature, []).append(k)
    for signature, members in classes.items():
        blocks = [objs[k] for k in members]
        kind, header_layers, header_codecs, groups = _layout(blocks[0])
        sizes = _place(groups)
        tables = encode_tables(header_layers, header_codecs)
        names: list[list[tuple[int, str]]] = [[] for _ in groups]
        for li in header_layers:  # in layer order: each group's arrays as stored
            for n, e in li["arrays"].items():
                names[e["group"]].append((li["index"], n))
        joined = (_cut_bytes if signature[0] == "cut" else _blocks_bytes)(blocks, names, sizes)
        for t, (k, blk) in enumerate(zip(members, blocks)):
            raws = [g[t] for g in joined]
            prov = _complete(kind, blk, header_layers, provenances[k])
            info = BlockInfo(blk.index, blk.start, blk.n_tokens, blk.block_size)
            data, header = _dump3(kind, prov, info, header_layers, header_codecs, groups, raws, tables)
            yield k, tuple(memoryview(p).cast("B") for p in data), Parsed(header, raws)


def _signature(obj: Obj, memo: dict[int, tuple]) -> tuple | None:
    """What the header tables and group layout of a block follow from (its layers' layouts,
    offsets, configs, states and arrays' names, dtypes and shapes); None for other objects and
    for a block with calibration (whose digests are its own). `memo` holds the scalar maps seen
    (by id: the blocks of a split share each layer's config)."""
    if not isinstance(obj, Block):
        return None
    cut = obj.layers
    if isinstance(cut, CutLayers) and not cut.others:
        # A cut's layouts, configs, names and dtypes are its source's: what else differs is
        # each layer's state and windows.
        if cut.with_calibration and any(cut.source[i].calibration for i in cut.order):
            return None
        return "cut", id(cut.source), obj.n_tokens, obj.block_size, tuple(
            (i, tuple(cut_state(cut.source[i], cut.start, cut.stop).items()),
             tuple((n, hi - lo) for n, (lo, hi) in cut.windows(i).items())) for i in cut.order)
    layers = sorted(obj.layers.items())
    if any(r.calibration for _, r in layers):
        return None

    def scalars(m: Mapping) -> tuple:
        found = memo.get(id(m))
        if found is None or found[0] is not m:
            found = memo[id(m)] = m, tuple((k, type(v), repr(v)) for k, v in sorted(m.items()))  # 1, 1.0, -0.0 apart
        return found[1]

    return obj.n_tokens, obj.block_size, tuple(
        (i, r.layout, r.offset, scalars(r.config), scalars(r.state),
         tuple((n, a.dtype, tuple(a.shape)) for n, a in sorted(r.arrays.items()))) for i, r in layers)


def _blocks_bytes(blocks: Sequence[Block], names: list[list[tuple[int, str]]], sizes: list[int]) -> list[np.ndarray]:
    """Each group's decoded bytes for blocks of one layout, as one [blocks, group bytes] buffer
    per group, read from each block's own arrays; `names` gives each group's arrays (layer,
    name) in their stored order."""
    spans = _per_block(names, lambda key: [b.layers[key[0]].arrays[key[1]] for b in blocks])
    return _filled(len(blocks), names, sizes, spans)


def _per_block(keys: list[list[Any]], arrays_of) -> Any:
    """`_filled`'s `spans` for arrays given one per block (`arrays_of(key)`): MLX arrays with
    managed memory, elsewhere numpy views of them, evaluated together."""
    if runs.managed_memory():
        return lambda key: (None, [unsigned_view(a) for a in arrays_of(key)])
    flat = [key for group in keys for key in group]
    arrays = [a for key in flat for a in arrays_of(key)]
    mx.eval(arrays)
    views = iter(_host_views(arrays))
    each = {key: [next(views) for _ in arrays_of(key)] for key in flat}
    return lambda key: (None, each[key])


def _cut_bytes(blocks: Sequence[Block], names: list[list[tuple[int, str]]], sizes: list[int]) -> list[np.ndarray]:
    """`_blocks_bytes` of blocks cut from one snapshot (`CutLayers`, one signature), read from
    the snapshot's arrays through each block's windows: where the blocks' windows of an array
    follow each other (full blocks), one reshape of the array's span for all of them, else a
    slice per block."""
    k, cuts = len(blocks), [b.layers for b in blocks]
    source, managed = cuts[0].source, runs.managed_memory()
    wanted = list(dict.fromkeys((i, n) for group in names for i, n in group))
    if managed:
        views = {key: unsigned_view(source[key[0]].arrays[key[1]]) for key in wanted}
    else:
        arrays = [source[i].arrays[n] for i, n in wanted]
        mx.eval(arrays)
        views = dict(zip(wanted, _host_views(arrays)))

    def spans(key: tuple[int, str]) -> tuple[Any, list | None]:
        (i, n), a = key, views[key]
        windows = [c.windows(i)[n] for c in cuts]
        lo, step = windows[0][0], windows[0][1] - windows[0][0]
        if all(w == (lo + t * step, lo + (t + 1) * step) for t, w in enumerate(windows)):
            part, shape = a[:, :, lo:lo + k * step], (*a.shape[:2], k, step, *a.shape[3:])
            return (mx.moveaxis(part.reshape(shape), 2, 0) if managed
                    else np.moveaxis(np.reshape(part, shape, copy=False), 2, 0)), None
        return None, [a[:, :, w[0]:w[1]] for w in windows]

    return _filled(k, names, sizes, spans)


def _filled(k: int, keys: list[list[Any]], sizes: list[int], spans) -> list[np.ndarray]:
    """One [k, group bytes] buffer per group, its arrays (`keys`, in their stored order) one
    after the other, each array's bytes for the k blocks given by `spans(key)`: ([k, *shape] for
    all of them, None) or (None, one array per block). Where memory is unified (Apple silicon,
    the CPU) these are numpy views of MLX's buffers, copied in place on the format's threads, so
    every byte is copied once (MLX's `reshape(-1)` and concatenation cost about twice this copy's
    CPU in issue 28's put profile). On CUDA they are MLX arrays of a live cache, in managed
    memory: a host read would move their pages to the host, for the next decode step to fault
    back, so each group is joined on the device (a copy at device speed) and the host copies
    that out in parallel (one thread moved device pages at 2 GB/s on the H200, eight at 11 GB/s)."""
    bufs = [np.empty((k, size), dtype=np.uint8) for size in sizes]
    copies = []
    if runs.managed_memory():
        joined = []
        for group in keys:
            parts = []
            for key in group:
                stacked, each = spans(key)
                parts.append((stacked if stacked is not None else mx.stack(each)).reshape(k, -1))
            joined.append(mx.concatenate(parts, axis=1))
        mx.eval(joined)
        for buf, j in zip(bufs, joined):
            dst, src = buf.reshape(-1), np.asarray(j).view(np.uint8).reshape(-1)
            copies += [(dst[at:at + _COPY_CHUNK], src[at:at + _COPY_CHUNK]) for at in range(0, dst.size, _COPY_CHUNK)]
    else:
        for buf, group in zip(bufs, keys):
            at = 0
            for key in group:
                stacked, each = spans(key)
                first = stacked[0] if stacked is not None else each[0]
                dst = np.reshape(buf[:, at:at + first.nbytes].view(first.dtype), (k, *first.shape), copy=False)
                copies += [(dst, stacked)] if stacked is not None else list(zip(dst, each))
                at += first.nbytes
    _map(lambda c: np.copyto(*c), copies, [c[0].nbytes for c in copies])
    return bufs


def _dump(obj: Obj, provenance: Provenance, version: int) -> tuple[list, Header, list[np.ndarray]]:
    """The bytes of `obj` as consecutive buffers, its header as read back, and each group's
    decoded bytes."""
    if version not in (2, 3):
        raise ValueError(f"this tqstore writes object formats 2 and 3, not {version}")
    kind, header_layers, header_codecs, groups = _layout(obj)
    raws = _group_bytes(groups)
    prov = _complete(kind, obj, header_layers, provenance)
    block = BlockInfo(obj.index, obj.start, obj.n_tokens, obj.block_size) if kind == "block" else None
    if version == 3:
        data, parsed = _dump3(kind, prov, block, header_layers, header_codecs, groups, raws)
        return data, parsed, raws
    header_groups, stored = _pack(groups, raws)
    header = {
        "kind": kind,
        "identity": {"model": _hex(prov.model), "codec": _hex(prov.codec), "calibration": _hex(prov.calibration)},
        "tokens": None if prov.tokens is None else [int(t) for t in prov.tokens],
        "key": None if prov.key is None else prov.key.hex,
        "parent": None if prov.parent is None else prov.parent.hex,
        "block": None if block is None else dataclasses.asdict(block),
        "layers": header_layers,
        "codecs": header_codecs,
        "groups": header_groups,
    }
    try:
        text = canonical_json(header)
        parsed = parse_header(json.loads(text), 2, 0)  # what is written must read back
    except (MalformedHeader, TypeError, ValueError) as e:
        raise ValueError(f"cannot serialize this {kind}: {e}") from None
    table, at = {"__metadata__": {META_KEY: text.decode()}}, 0
    for j, part in enumerate(stored):
        table[f"group/{j}"] = {"dtype": "U8", "shape": [len(part)], "data_offsets": [at, at + len(part)]}
        at += len(part)
    st = json.dumps(table, separators=(",", ":")).encode()
    st += b" " * (-len(st) % 8)  # safetensors writers pad the header to 8 bytes
    parts = [struct.pack("<Q", len(st)), st, *stored]
    digest = hashlib.sha256()
    for part in parts:
        digest.update(part)
    frame = _FRAME.pack(MAGIC, 2, 0, len(st), 8 + len(st) + at, digest.digest())
    return [frame, *parts], parsed, raws


def _layout(obj: Obj) -> tuple[str, list[dict], dict, dict[tuple[str, str, str], list[tuple[dict[str, Any], mx.array]]]]:
    """The kind of `obj`, its layers' and codecs' header records (format 2's), and its arrays by
    group (section, name, dtype), in the order the groups and their arrays are stored."""
    kind, layers, codecs = _parts(obj)
    _check_names(layers, codecs)
    groups: dict[tuple[str, str, str], list[tuple[dict[str, Any], mx.array]]] = {}

    def put(section: str, name: str, a: mx.array) -> dict[str, Any]:
        dtype = dtype_name(a.dtype)
        if dtype not in DTYPES:
            raise ValueError(f"dtype {dtype} cannot be stored (supported: {', '.join(DTYPES)})")
        entry = {"dtype": dtype, "shape": list(a.shape), "group": 0, "offset": 0}
        groups.setdefault((section, name, dtype), []).append((entry, a))
        return entry

    header_layers = [{"index": i, "layout": r.layout.value, "offset": r.offset, "config": dict(r.config),
                      "state": dict(r.state),
                      "arrays": {n: put("layer", n, a) for n, a in sorted(r.arrays.items())},
                      "calibration": {n: put("calibration", n, a) for n, a in sorted(r.calibration.items())}}
                     for i, r in layers]
    header_codecs = {name: {"rotation_kind": c.rotation_kind, "norm_mode": c.norm_mode,
                            "arrays": {n: put("codec", n, a) for n, a in sorted(c.arrays.items())}}
                     for name, c in sorted(codecs.items())}
    return kind, header_layers, header_codecs, groups


def _dump3(kind: str, prov: Provenance, block: BlockInfo | None, header_layers: list[dict], header_codecs: dict,
           groups: dict, raws: list[np.ndarray], tables: Tables | None = None) -> tuple[list, Header]:
    """Format 3: the frame, the binary header, then each group at an aligned offset (as
    consecutive buffers: zero padding, and each group's stored bytes as they lie). `tables`:
    the header's tables, where the caller encoded them once for several objects."""
    dtypes = [key[2] for key in groups]

    def pack(j: int) -> tuple[str, Any, bytes]:
        dtype, raw = dtypes[j], raws[j]
        encoding, packed = ("raw", None) if dtype in PACKED_DTYPES else _encode(raw, DTYPES[dtype][0].size)
        stored = raw.data if packed is None else packed
        return encoding, stored, xxhash.xxh3_128_digest(stored)

    done = _map(pack, range(len(raws)), [r.size for r in raws])
    records = [{"dtype": key[2], "encoding": enc, "offset": 0, "stored": len(part), "nbytes": int(raw.size),
                "xxh3": digest} for key, raw, (enc, part, digest) in zip(groups, raws, done)]
    try:
        head = encode_header(kind, prov, block, tables or encode_tables(header_layers, header_codecs), records)
        size = len(head)
        end = records[-1]["offset"] + records[-1]["stored"] if records else FRAME_SIZE + size
        parsed = read_header(memoryview(head), end - FRAME_SIZE, None)[0]  # what is written must read back
    except (MalformedHeader, TypeError, ValueError, OverflowError) as e:
        raise ValueError(f"cannot serialize this {kind}: {e}") from None
    frame = _FRAME.pack(MAGIC, 3, 0, size, end - FRAME_SIZE, hashlib.sha256(head).digest())
    parts, at = [frame, head], FRAME_SIZE + size
    for record, (_, part, _) in zip(records, done):
        parts += [bytes(record["offset"] - at), part]
        at = record["offset"] + record["stored"]
    return parts, parsed


def _group_bytes(groups: dict[tuple[str, str, str], list[tuple[dict[str, Any], mx.array]]]) -> list[np.ndarray]:
    """Each group's decoded bytes, one numpy buffer per group with its arrays copied in one
    after the other (`_filled`); places every array in its group and records the digests of
    calibration arrays."""
    items = list(groups.items())
    sizes = _place(groups)
    keys = [[(j, m) for m in range(len(members))] for j, (_, members) in enumerate(items)]
    spans = _per_block(keys, lambda key: [items[key[0]][1][key[1]][1]])
    raws = [buf[0] for buf in _filled(1, keys, sizes, spans)]
    for ((section, _, _), members), raw in zip(items, raws):
        if section == "calibration":  # the calibration digest (and every later block key) hashes these
            for entry, a in members:
                entry["sha256"] = hashlib.sha256(raw[entry["offset"]:entry["offset"] + a.nbytes]).hexdigest()
    return raws


def _place(groups: dict[tuple[str, str, str], list[tuple[dict[str, Any], mx.array]]]) -> list[int]:
    """Place every array in its group (each header entry's group and offset, the arrays one
    after the other); each group's bytes."""
    sizes = []
    for j, members in enumerate(groups.values()):
        offset = 0
        for entry, a in members:
            entry["group"], entry["offset"] = j, offset
            offset += a.nbytes
        sizes.append(offset)
    return sizes


def _host_views(arrays: list[mx.array]) -> list[np.ndarray]:
    """numpy views of evaluated arrays as the unsigned integers of their width, no copy. numpy
    reads every stored dtype but bfloat16 straight from MLX's buffer (about 2 us an array);
    bfloat16 goes through MLX's `view`, a graph node, evaluated for all of them at once: one
    evaluation per `np.asarray` cost about 90 us an array, most of a turbo4 put's CPU here."""
    bf16 = [unsigned_view(a) for a in arrays if a.dtype == mx.bfloat16]
    mx.eval(bf16)
    viewed = iter(bf16)
    return [np.asarray(next(viewed)) if a.dtype == mx.bfloat16 else np.asarray(a).view(f"u{a.itemsize}")
            for a in arrays]


def _pack(groups: dict[tuple[str, str, str], list], raws: list[np.ndarray]) -> tuple[list[dict[str, Any]], list[Any]]:
    """Encode each group once: (the header's group records, each group's stored bytes)."""
    dtypes = [key[2] for key in groups]

    def pack(j: int) -> tuple[dict, Any]:
        dtype, raw = dtypes[j], raws[j]
        encoding, packed = _encode(raw, DTYPES[dtype][0].size, MIN_SAVING_V2, SAMPLE_BYTES_V2)
        record = {"dtype": dtype, "encoding": encoding, "nbytes": int(raw.size),
                  "sha256": hashlib.sha256(raw).hexdigest()}
        return record, raw.data if packed is None else packed

    done = _map(pack, range(len(raws)), [r.size for r in raws])
    return [r for r, _ in done], [p for _, p in done]


def inspect(data: bytes, *, verify_digest: bool = True) -> Header:
    """An object's header, without decoding any tensor.

    With verify_digest=False, `data` may be only the first bytes of an object (the frame and
    the header, e.g. from a ranged read); nothing is then known about the rest.
    """
    return _read(data, verify_digest, verify_digest)[0]


def loads(data: bytes, *, expect: Expect) -> Obj:
    """The object in `data`, verified completely (frame, header, identity, tokens, every tensor).

    Raises BadMagic, FormatVersionTooNew, UnsupportedFormatVersion, TruncatedData,
    ChecksumMismatch, MalformedHeader, IdentityMismatch or TokenMismatch; returns only whole
    objects, with every array evaluated.
    """
    return load(data, expect=expect)[1]


def load(data: bytes, *, expect: Expect, verified: bool = False) -> tuple[Header, Obj]:
    """`loads` that also returns the object's header (parsed once for both). `verified`: the
    caller has just checked these whole bytes against the digest recorded when they were
    written (an S3 read, a publish), so the object's own digests of the same bytes (a format 1
    or 2 frame's digest, format 3's group digests) are not computed again."""
    return build(parse(data, expect=expect, verified=verified))


@dataclass(frozen=True)
class Parsed:
    """An object checked in full but not yet made into MLX arrays (`parse`, then `build`)."""

    header: Header
    raws: list[np.ndarray] | None  # format 2 and 3: each group's decoded, verified bytes
    tensors: dict[str, tuple[TensorInfo, memoryview]] | None = None  # format 1: each tensor's stored bytes


def parse(data: bytes | memoryview | np.ndarray, *, expect: Expect, verified: bool = False) -> Parsed:
    """Every check of `load` (frame, header, identity, tokens, every digest) and the decoding of
    every group, without MLX: safe on any thread (hashing and zstd release the GIL). `build`
    makes the object on the caller's thread."""
    header, table, blob = _read(data, True, not verified)
    _check_expect(header, expect)
    if header.version == 1:
        return Parsed(header, None, {name: (info, blob[s:e]) for name, (info, s, e) in table.items()})
    if header.version == 2:
        return Parsed(header, _unpack(header, [blob[s:e] for _, s, e in table.values()]))
    return Parsed(header, _unpack3(header, table, blob, hashed=not verified))


def build(parsed: Parsed) -> tuple[Header, Obj]:
    """The header and the object of a parsed object, every array evaluated (one MLX array per
    group: arrays are views of their group)."""
    header = parsed.header
    if parsed.tensors is not None:
        arrays = {name: _decode(name, info, stored) for name, (info, stored) in parsed.tensors.items()}
        mx.eval(*arrays.values())
        return header, _build(header, arrays)
    held = [mx.array(aligned(raw, DTYPES[g.dtype][2].size)) for g, raw in zip(header.groups, parsed.raws)]
    mx.eval(held)
    grouped = _grouped_block(header, held) if header.kind == "block" else None
    if grouped is not None:
        return header, grouped
    views = _views(header, held)
    mx.eval(*views.values())  # bound to no thread's stream (see _grouped_block); views, no copies
    return header, _build(header, views)


# -- writing ---------------------------------------------------------------------------------


def _parts(obj: Obj) -> tuple[str, list[tuple[int, LayerRecord]], dict[str, CodecRecord]]:
    if isinstance(obj, Snapshot):
        return "snapshot", list(enumerate(obj.layers)), obj.codecs
    if isinstance(obj, Block):
        return "block", sorted(obj.layers.items()), {}
    if isinstance(obj, Window):
        return "window", list(enumerate(obj.layers)), {}
    if isinstance(obj, SharedCodecs):
        return "shared", [], obj.codecs
    raise TypeError(f"cannot serialize a {type(obj).__name__}: pass a Snapshot, Block, Window or SharedCodecs")


def _check_names(layers, codecs) -> None:
    names = [n for _, r in layers for n in (*r.arrays, *r.calibration)]
    names += [n for name, c in codecs.items() for n in (name, *c.arrays)]
    bad = next((n for n in names if not isinstance(n, str) or not n or "/" in n), None)
    if bad is not None:
        raise ValueError(f"array and codec names are non-empty strings without '/', got {bad!r}")


def _complete(kind: str, obj: Obj, header_layers: list[dict], prov: Provenance) -> Provenance:
    """The provenance as written: block keys and calibration digests computed from the data."""
    calibration = prov.calibration
    if kind == "snapshot" or (kind == "block" and obj.index == 0):
        calibration = digest_calibration([(li["index"], li["calibration"]) for li in header_layers])
        if prov.calibration is not None and prov.calibration != calibration:
            raise ValueError("the provenance's calibration digest does not match the calibration arrays")
    if kind != "block":
        if prov.parent is not None:
            raise ValueError(f"only blocks have a parent key, not a {kind}")
        return dataclasses.replace(prov, calibration=calibration)
    if prov.model is None or prov.codec is None or prov.tokens is None:
        raise ValueError("a block needs the model and codec digests and its tokens")
    if len(prov.tokens) != obj.n_tokens or (obj.index == 0) != (prov.parent is None):
        raise ValueError(f"block {obj.index} holds {obj.n_tokens} tokens and the provenance gives "
                         f"{len(prov.tokens)}, or the parent key is wrong (only block 0 has none)")
    key = block_key(prov.parent, prov.tokens, prov.model, prov.codec, calibration)
    if prov.key is not None and prov.key != key:
        raise ValueError(f"the provenance's key {prov.key.hex} is not this block's key {key.hex}")
    return dataclasses.replace(prov, calibration=calibration, key=key)


def _encode(raw: np.ndarray, itemsize: int, min_saving: float = MIN_SAVING,
            sample_bytes: int = SAMPLE_BYTES) -> tuple[str, bytes | None]:
    """(encoding, stored bytes) of one group, or ("raw", None) to store it as it is: the
    smallest of raw, zstd and zstd over byte planes, chosen on a sample of its first `sample_bytes`
    (a sample that cannot win decides raw, and the rest is not compressed), zstd kept only
    where it saves `min_saving` of the bytes."""
    if raw.size < MIN_COMPRESS_BYTES:
        return "raw", None
    zstd = _compressor()
    sample = raw[:sample_bytes - sample_bytes % itemsize]
    candidates = ["zstd"] + (["shuffle-zstd"] if itemsize > 1 else [])
    tried = {enc: _compress(zstd, sample, itemsize, enc) for enc in candidates}
    best = min(candidates, key=lambda enc: len(tried[enc]))
    if len(tried[best]) > (1 - min_saving) * sample.size:
        return "raw", None
    stored = tried[best] if sample.size == raw.size else _compress(zstd, raw, itemsize, best)
    if len(stored) > (1 - min_saving) * raw.size:
        return "raw", None
    return best, stored


def _compressor() -> zstandard.ZstdCompressor:
    """This thread's zstd compressor (compressors are not thread-safe; making one per group cost
    a 64k put's 1,800 small float groups about as much as their trials)."""
    zstd = getattr(_LOCAL, "zstd", None)
    if zstd is None:
        zstd = _LOCAL.zstd = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
    return zstd


_LOCAL = threading.local()


def _compress(zstd: zstandard.ZstdCompressor, raw: np.ndarray, itemsize: int, encoding: str) -> bytes:
    if encoding == "shuffle-zstd":
        # Byte planes: the sign/exponent bytes of floats repeat and compress; mantissa bytes barely.
        raw = np.ascontiguousarray(raw.reshape(-1, itemsize).T)
    return zstd.compress(raw.data)


def _hex(digest: bytes | None) -> str | None:
    if digest is None:
        return None
    if not isinstance(digest, bytes) or len(digest) != 32:
        raise ValueError(f"identity digests are 32 raw bytes (use .digest, not .hexdigest), got {digest!r:.80}")
    return digest.hex()


# -- reading ---------------------------------------------------------------------------------


def _read(data: bytes, whole: bool, verify_digest: bool) -> tuple[Header, Any, memoryview]:
    """Frame checks first, then the safetensors table and the JSON header, cross-checked. The
    table gives each tensor (format 1) or each group (format 2) its byte range in the data;
    format 3 gives its group table and the whole object."""
    view = memoryview(data).cast("B")
    if len(view) < FRAME_SIZE:
        if not MAGIC.startswith(bytes(view[:len(MAGIC)])):
            raise BadMagic("not a tqstore object (wrong magic bytes)")
        raise TruncatedData(f"object truncated to {len(view)} bytes, shorter than its {FRAME_SIZE}-byte frame")
    magic, version, reserved, header_len, payload_len, digest = _FRAME.unpack_from(view)
    if magic != MAGIC:
        raise BadMagic("not a tqstore object (wrong magic bytes)")
    check_version(version, READABLE_VERSIONS, "object", "compute the cache again")
    payload = view[FRAME_SIZE:]
    if whole and len(payload) != payload_len:
        raise TruncatedData(f"object has {len(payload)} payload bytes, its frame says {payload_len}: it was "
                            "truncated or padded in storage")
    if version == 3:
        return _read3(view, header_len, payload_len, digest, reserved, whole, verify_digest)
    if verify_digest and hashlib.sha256(payload).digest() != digest:
        raise ChecksumMismatch("object is corrupt: its sha256 does not match its frame")
    if reserved != 0:
        raise MalformedHeader(f"the reserved frame field is {reserved}, not 0")
    if 8 + header_len > min(len(payload), payload_len):
        raise TruncatedData(f"the {header_len}-byte header runs past the {min(len(payload), payload_len)}-byte payload")
    (st_len,) = struct.unpack_from("<Q", payload)
    if st_len != header_len:
        raise MalformedHeader(f"the frame gives a {header_len}-byte header, the safetensors payload {st_len}")
    st = json_value(payload[8:8 + header_len], "safetensors header")
    if not isinstance(st, dict):
        raise MalformedHeader("the safetensors header is not a JSON object")
    meta = st.pop("__metadata__", None)
    if not isinstance(meta, dict) or set(meta) != {META_KEY} or not isinstance(meta[META_KEY], str):
        raise MalformedHeader(f"the safetensors metadata must hold exactly one string, {META_KEY!r}")
    header = parse_header(json_value(meta[META_KEY].encode("utf-8", "surrogatepass"), "tqstore header"), version,
                           payload_len)
    data_len = payload_len - 8 - header_len
    table = _tensor_table(st, header, data_len) if version == 1 else _group_table(st, header, data_len)
    return header, table, payload[8 + header_len:]


def _read3(view: memoryview, header_len: int, payload_len: int, digest: bytes, reserved: int, whole: bool,
           verify_digest: bool) -> tuple[Header, Groups, memoryview]:
    """Format 3: the frame's digest covers the header; the header's group table gives each
    group's place and digest (checked by `_unpack3`)."""
    if reserved != 0:
        raise MalformedHeader(f"the reserved frame field is {reserved}, not 0")
    if header_len > min(len(view) - FRAME_SIZE, payload_len):
        raise TruncatedData(f"the {header_len}-byte header runs past the {len(view) - FRAME_SIZE}-byte payload")
    head = view[FRAME_SIZE:FRAME_SIZE + header_len]
    if verify_digest and hashlib.sha256(head).digest() != digest:
        raise ChecksumMismatch("object is corrupt: the sha256 of its header does not match its frame")
    header, groups = read_header(head, payload_len, len(view) if whole else None)
    return header, groups, view


def _unpack3(header: Header, groups: Groups, view: memoryview, hashed: bool = True) -> list[np.ndarray]:
    """Format 3: the padding before each group is zero, each group's stored bytes match their
    xxh3-128 digest (once per byte, before anything decodes them; not when `hashed` is False:
    the caller checked the whole object's sha256), and each group decodes to its size;
    calibration arrays match their own sha256 (the calibration digest hashes those)."""
    at = FRAME_SIZE + _FRAME.unpack_from(view)[3]
    for offset, stored in zip(groups.offsets.tolist(), groups.stored.tolist()):
        if any(view[at:offset]):  # under 64 bytes
            raise ChecksumMismatch(f"object is corrupt: the padding before byte {offset} is not zero")
        at = offset + stored

    def unpack(j: int) -> np.ndarray:
        g, offset = header.groups[j], int(groups.offsets[j])
        stored = view[offset:offset + int(groups.stored[j])]
        if hashed and xxhash.xxh3_128_digest(stored) != groups.xxh3[j]:
            raise ChecksumMismatch(f"group {j} ({g.dtype}) is corrupt: its xxh3-128 does not match the header")
        return _decoded(f"group {j}", g.encoding, stored, g.nbytes, DTYPES[g.dtype][0].size)

    raws = _map(unpack, range(len(header.groups)), groups.stored.tolist())
    for layer in header.layers:
        for name, info in layer.calibration.items():
            raw = raws[info.group][info.offset:info.offset + info.nbytes]
            if hashlib.sha256(raw).hexdigest() != info.sha256:
                raise ChecksumMismatch(f"calibration array {name} of layer {layer.index} is corrupt: its sha256 does "
                                       "not match the header")
    return raws


def _tensor_table(st: dict, header: Header, data_len: int) -> dict[str, tuple[TensorInfo, int, int]]:
    """Match the safetensors table to the header; the tensors' bytes must tile the data."""
    infos = header.tensors()
    if set(st) != set(infos):
        missing, extra = sorted(set(infos) - set(st)), sorted(set(st) - set(infos))
        raise MalformedHeader(f"the tensor table does not match the header (missing {missing[:3]}, extra {extra[:3]})")
    spans = []
    for name, entry in st.items():
        info = infos[name]
        if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
            raise MalformedHeader(f"tensor {name}: the entry needs exactly dtype, shape and data_offsets")
        offsets = entry["data_offsets"]
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
                and 0 <= offsets[0] <= offsets[1] <= data_len):
            raise MalformedHeader(f"tensor {name}: bad data offsets {offsets!r:.80}")
        size = offsets[1] - offsets[0]
        want = (DTYPES[info.dtype][1], list(info.shape)) if info.encoding == "raw" else ("U8", [size])
        if (entry["dtype"], entry["shape"]) != want or (info.encoding == "raw" and size != info.nbytes):
            raise MalformedHeader(f"tensor {name}: stored as {entry['dtype']!r:.20} {entry['shape']!r:.80} in "
                                  f"{size} bytes, the header says {info.encoding} {info.dtype} {list(info.shape)}")
        spans.append((offsets[0], offsets[1], name))
    end = 0
    for start, stop, name in sorted(spans):
        if start != end:
            raise MalformedHeader(f"tensor {name} starts at byte {start}, expected {end}: data must be contiguous")
        end = stop
    if end != data_len:
        raise MalformedHeader(f"the tensors cover {end} of {data_len} data bytes")
    return {name: (infos[name], s, e) for s, e, name in spans}


def _group_table(st: dict, header: Header, data_len: int) -> dict[str, tuple[GroupInfo, int, int]]:
    """Format 2: the safetensors table holds exactly one U8 tensor per group, tiling the data."""
    names = [f"group/{j}" for j in range(len(header.groups))]
    if set(st) != set(names):
        raise MalformedHeader(f"the tensor table does not hold exactly the {len(names)} groups of the header")
    end, out = 0, {}
    for name, group in zip(names, header.groups):
        entry = st[name]
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if set(entry or ()) != {"dtype", "shape", "data_offsets"} or entry["dtype"] != "U8" \
                or not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)) \
                or offsets[0] != end or not end <= offsets[1] <= data_len or entry["shape"] != [offsets[1] - end] \
                or (group.encoding == "raw" and offsets[1] - end != group.nbytes):
            raise MalformedHeader(f"{name}: the entry is not U8 [its length] right after the group before it")
        out[name] = (group, end, offsets[1])
        end = offsets[1]
    if end != data_len:
        raise MalformedHeader(f"the groups cover {end} of {data_len} data bytes")
    return out


def _check_expect(header: Header, expect: Expect) -> None:
    what = f"this {header.kind}" + (f" (block {header.block.index})" if header.block else "")
    p = header.provenance
    if expect.kind is not None and header.kind != expect.kind:
        raise MalformedHeader(f"{what} is not a {expect.kind}: the wrong object is stored under this key")
    if expect.model is not None and p.model != expect.model:
        raise IdentityMismatch(f"{what} was saved for another model (model identity {_short(p.model)}, the model in "
                               f"use is {_short(expect.model)}): its weights, KV config, tokenizer, chat template, "
                               "adapter or KV dtype differ; save the cache again with this model")
    if expect.codec is not None and p.codec != expect.codec:
        raise IdentityMismatch(f"{what} was encoded with another codec (codec identity {_short(p.codec)}, expected "
                               f"{_short(expect.codec)}): the scheme, layer configuration, codebooks, rotations or "
                               "format version differ; save the cache again with this scheme")
    if expect.tokens is not None and (p.tokens is None or p.tokens != tuple(expect.tokens)):
        want = [int(t) for t in expect.tokens]
        if p.tokens is None or list(p.tokens) != want:
            raise TokenMismatch(_token_difference(what, p.tokens, want))
    if expect.key is not None and p.key != expect.key:
        raise IdentityMismatch(f"{what} has key {_short(p.key)}, expected {_short(expect.key)}: it belongs to another "
                               "prefix chain or calibration; look it up again")


def _token_difference(what: str, have: Sequence[int] | None, want: list[int]) -> str:
    if have is None:
        return f"{what} records no tokens; {len(want)} were expected"
    i = next((i for i, (a, b) in enumerate(zip(have, want)) if a != b), min(len(have), len(want)))
    stored = have[i] if i < len(have) else "the end"
    wanted = want[i] if i < len(want) else "the end"
    return (f"{what} holds {len(have)} tokens, {len(want)} were asked for; they differ first at position {i} "
            f"({stored} stored, {wanted} asked for)")


def _short(digest: bytes | BlockKey | None) -> str:
    if digest is None:
        return "none"
    return (digest.hex if isinstance(digest, BlockKey) else digest.hex())[:12] + "…"


def _decode(name: str, info: TensorInfo, stored: memoryview) -> mx.array:
    """Format 1: one tensor, decoded and checked against its own digest."""
    raw = _decoded(f"tensor {name}", info.encoding, stored, info.nbytes, DTYPES[info.dtype][0].size)
    if hashlib.sha256(raw).hexdigest() != info.sha256:
        raise ChecksumMismatch(f"tensor {name} is corrupt: its sha256 does not match the header")
    return tensor_from_bytes(raw, info.dtype, info.shape)


def _unpack(header: Header, stored: list[memoryview]) -> list[np.ndarray]:
    """Format 2: each group decoded and checked against its digest once (arrays are views of
    it: `_views`, `_grouped_block`). Calibration arrays are checked
    against their own digests too: the calibration digest in the header (and so every later
    block key) was computed from those."""
    def unpack(j: int) -> np.ndarray:
        g = header.groups[j]
        raw = _decoded(f"group {j}", g.encoding, stored[j], g.nbytes, DTYPES[g.dtype][0].size)
        if hashlib.sha256(raw).hexdigest() != g.sha256:
            raise ChecksumMismatch(f"group {j} ({g.dtype}) is corrupt: its sha256 does not match the header")
        return raw

    groups = _map(unpack, range(len(header.groups)), [len(b) for b in stored])
    for name, info in header.tensors().items():
        if info.sha256 is not None:
            raw = groups[info.group][info.offset:info.offset + info.nbytes]
            if hashlib.sha256(raw).hexdigest() != info.sha256:
                raise ChecksumMismatch(f"tensor {name} is corrupt: its sha256 does not match the header")
    return groups


def _views(header: Header, held: list[mx.array]) -> dict[str, mx.array]:
    """Format 2: every array by its tensor name, a view of its group."""
    arrays = {}
    for name, info in header.tensors().items():
        mx_dtype, _, unsigned = DTYPES[info.dtype]
        start = info.offset // unsigned.size
        a = held[info.group][start:start + info.nbytes // unsigned.size].reshape(info.shape)
        arrays[name] = a if mx_dtype == unsigned else a.view(mx_dtype)
    return arrays


def build_run(parsed: Sequence[Parsed]) -> list[Block] | None:
    """Consecutive blocks of one entry, parsed, built with each array name's groups decoded
    straight into one joined array (`runs.Run`): every block's bytes are copied once, into
    their token slice of it, and each block's groups are views of it, so the join that follows
    is a slice, not a concatenation. None unless every object is a format 2 or 3 block whose
    groups hold one array per layer (`runs.plan_of`) with the same layers, dtype and shape but
    for tokens per name: the caller then builds them one by one (`build`)."""
    if not parsed or any(p.raws is None for p in parsed):
        return None
    run = Run.allocate([p.header for p in parsed])
    if run is None:
        return None
    _map(lambda b: run.place(b, parsed[b].header, parsed[b].raws), range(len(parsed)), [sum(r.size for r in p.raws) for p in parsed])
    return run.blocks([(b, p.header, p.raws) for b, p in enumerate(parsed)])


def _grouped_block(header: Header, held: list[mx.array]) -> Block | None:
    """A block whose layers hold their arrays as `ArrayGroup`s (one per group), when every group
    holds arrays of one name and shape, one per layer in layer order (as dumps writes them);
    else None. Calibration arrays (block 0 only) stay arrays of their own."""
    plan = plan_of(header.layers)
    if plan is None:
        return None
    groups = []
    for j, name, layers, shape, dtype in plan.groups:
        mx_dtype, _, unsigned = DTYPES[dtype]
        data = held[j].reshape(len(layers), *shape)
        groups.append(ArrayGroup(name, layers, data if mx_dtype == unsigned else data.view(mx_dtype)))
    calibration = _views(header, held) if plan.calibrated else {}
    shells = plan.shells or {
        li.index: LayerRecord(li.layout, li.offset, dict.fromkeys(li.arrays), dict(li.config), dict(li.state),
                              {n: calibration[layer_tensor(li.index, n, calibration=True)] for n in li.calibration})
        for li in header.layers}
    # Evaluated here, in the thread that decoded them (a put's writer thread, for one): an MLX
    # array still holding a lazy reshape is bound to its thread's stream, and another thread that
    # joins it fails ("There is no Stream(cpu, N) in current thread"). Views cost no copy.
    mx.eval([g.data for g in groups], list(calibration.values()))
    b = header.block
    return Block(b.index, b.start, b.n_tokens, GroupedLayers(shells, tuple(groups)), b.block_size)


def _map(fn, items, sizes: list[int]) -> list:
    """`fn` over `items`, the large ones on threads (zstd and hashlib release the GIL) and the
    small ones here: on two busy cores, handing a 300 KiB group to a thread cost more than hashing it."""
    items = list(items)
    futures = {k: _threads().submit(fn, item) for k, (item, size) in enumerate(zip(items, sizes))
               if size >= THREADED_BYTES}
    done = {k: fn(item) for k, item in enumerate(items) if k not in futures}
    return [futures[k].result() if k in futures else done[k] for k in range(len(items))]


@functools.lru_cache(maxsize=1)
def _threads() -> ThreadPoolExecutor:
    """Threads for the per-group work (numpy, zstd, hashlib only: no MLX calls off the caller's
    thread), one per core."""
    return ThreadPoolExecutor(max_workers=os.cpu_count() or 1, thread_name_prefix="tqstore-format")


def _decoded(what: str, encoding: str, stored: memoryview, nbytes: int, itemsize: int) -> np.ndarray:
    """The decoded bytes of one stored span (zstd frame size checked before it allocates)."""
    if encoding == "raw":
        return np.frombuffer(stored, dtype=np.uint8)
    try:
        size = zstandard.frame_content_size(stored)
        if size != nbytes:  # also bounds the allocation below
            raise ChecksumMismatch(f"{what}: its zstd frame holds {size} bytes, {nbytes} expected")
        raw = zstandard.ZstdDecompressor().decompress(stored, max_output_size=nbytes)
    except zstandard.ZstdError as e:
        raise ChecksumMismatch(f"{what}: the compressed data is corrupt ({e})") from None
    if len(raw) != nbytes:
        raise ChecksumMismatch(f"{what}: decompressed to {len(raw)} bytes, {nbytes} expected")
    planes = np.frombuffer(raw, dtype=np.uint8)
    return _unshuffle(planes, itemsize) if encoding == "shuffle-zstd" else planes


def _unshuffle(planes: np.ndarray, itemsize: int) -> np.ndarray:
    """Byte planes back to little-endian items (shifts over contiguous planes beat a strided copy)."""
    p = planes.reshape(itemsize, -1)
    wide = {2: np.uint16, 4: np.uint32, 8: np.uint64}[itemsize]
    out = p[0].astype(wide)
    for j in range(1, itemsize):
        out |= p[j].astype(wide) << wide(8 * j)
    return out.view(np.uint8)


def _build(header: Header, arrays: dict[str, mx.array]) -> Obj:
    def layer(li: LayerInfo) -> LayerRecord:
        return LayerRecord(li.layout, li.offset, {n: arrays[layer_tensor(li.index, n)] for n in li.arrays},
                           dict(li.config), dict(li.state),
                           {n: arrays[layer_tensor(li.index, n, calibration=True)] for n in li.calibration})

    codecs = {name: CodecRecord(c.rotation_kind, c.norm_mode, {n: arrays[codec_tensor(name, n)] for n in c.arrays})
              for name, c in header.codecs.items()}
    if header.kind == "snapshot":
        return Snapshot(layers=[layer(li) for li in header.layers], codecs=codecs)
    if header.kind == "block":
        b = header.block
        return Block(b.index, b.start, b.n_tokens, {li.index: layer(li) for li in header.layers}, b.block_size)
    if header.kind == "window":
        return Window([layer(li) for li in header.layers])
    return SharedCodecs(codecs)


