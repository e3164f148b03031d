"""Object format 3's header: fixed-size binary records read as numpy structured arrays
(docs/format.md gives the bytes). Pure numpy and struct: no MLX, so a reader thread parses and
checks objects while the caller's thread builds arrays.

`encode_tables` writes the tables that the blocks of an entry repeat (once per block layout in
a put), `encode_header` the header of an object whose groups are already encoded, around them;
`read_header` checks a header and types it as format 2's `Header` (plus each group's place in
the object and its digest). The per-object parts (frame, identity, tokens, the group table) are
checked on every read in a few vectorized passes; the layer, array and codec tables are
validated once per distinct table (memoized by their bytes), with the same rules as format 2's
JSON header (header.py).
"""

from __future__ import annotations

import functools
import itertools
import math
import struct
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from turboquant.records import Layout

from tqstore.canonical import DTYPES, canonical_json
from tqstore.errors import MalformedHeader, TruncatedData
from tqstore.format.blocks import BlockKey
from tqstore.format.header import (ENCODINGS, KINDS, MAX_ELEMENTS, BlockInfo, CodecInfo, GroupInfo, Header, LayerInfo,
                                   Provenance, TensorInfo, check_block_layers, check_kind, check_layer, json_value, scalars_ok)

ALIGN = 64  # every group starts at a multiple of 64 bytes from the object's start
MAX_DIMS = 8
NONE = 0xFFFFFFFF  # "no token ids" in the token count
# The codes are positions in these tuples, frozen here (not taken from the order of DTYPES or of
# the Layout enum, which may grow): new names only ever go at the end.
DTYPE_CODES = ("float16", "bfloat16", "float32", "uint8", "uint16", "uint32", "uint64", "int8", "int16", "int32",
               "int64")
LAYOUT_CODES = tuple(Layout(v) for v in ("raw", "rawk-turbo", "affinek-turbo", "turbo", "calibrated", "affine",
                                         "rotating", "quantized", "chunked", "state", "list", "fields"))
SECTIONS = ("layer", "calibration", "codec")
# kind u8, presence flags u8 (model, codec, calibration, key, parent), u16 0; token count (NONE:
# no tokens), layer, array, codec and calibration-digest counts, dictionary bytes; block index,
# start, n_tokens, block_size; model, codec, calibration, key and parent digests (zeros if absent).
HEAD = struct.Struct("<BBH6I4I32s32s32s32s32s")
GROUP = np.dtype([("dtype", "u1"), ("encoding", "u1"), ("zero", "<u2"), ("zero2", "<u4"), ("offset", "<u8"),
                  ("stored", "<u8"), ("nbytes", "<u8"), ("xxh3", "V16")])  # 48 bytes
LAYER = np.dtype([("index", "<u4"), ("layout", "u1"), ("zero", "u1"), ("zero2", "<u2"), ("offset", "<u4"),
                  ("config", "<u4"), ("state", "<u4")])  # 20 bytes
ARRAY = np.dtype([("owner", "<u4"), ("section", "u1"), ("dtype", "u1"), ("ndim", "u1"), ("zero", "u1"),
                  ("name", "<u4"), ("group", "<u4"), ("offset", "<u8"), ("shape", "<u8", (MAX_DIMS,))])  # 88 bytes
CODEC = np.dtype([("name", "<u4"), ("rotation_kind", "<u4"), ("norm_mode", "<u4")])  # 12 bytes
_FLAGS = ("model", "codec", "calibration", "key", "parent")


@dataclass(frozen=True)
class Layouts:
    """What the repeated tables of an object say, validated: the typed layers and codecs."""

    layers: tuple[LayerInfo, ...]
    codecs: Mapping[str, CodecInfo]


def align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass(frozen=True)
class Tables:
    """The encoded layer, array and codec tables of an object, with the calibration digests and
    the dictionary: the part of a header that the blocks of an entry repeat byte for byte, so a
    put encodes it once per distinct block layout (`encode_tables`)."""

    n_layers: int
    n_arrays: int
    n_codecs: int
    n_digests: int
    dictionary_nbytes: int
    data: bytes  # layer, array and codec records, digests, dictionary: the header after its group table


def encode_tables(layers: Sequence[Mapping[str, Any]], codecs: Mapping[str, Mapping[str, Any]]) -> Tables:
    """The tables of an object's header. `layers` and `codecs` are format 2's header records
    (arrays with dtype, shape, group, offset; calibration arrays with sha256 too)."""
    words: dict[bytes, int] = {}

    def ref(value: Any) -> int:
        key = _canonical(value if isinstance(value, str) else tuple(
            (k, type(v), v, repr(v) if type(v) is float else None) for k, v in value.items()))  # -0.0 is not 0.0
        return words.setdefault(key, len(words))

    layer_rows, array_rows, digests = [], [], []

    def add(owner: int, section: int, name: str, t: Mapping[str, Any]) -> None:
        shape = list(t["shape"])
        if len(shape) > MAX_DIMS:
            raise ValueError(f"array {name} has {len(shape)} dimensions; at most {MAX_DIMS} can be stored")
        array_rows.append((owner, section, DTYPE_CODES.index(t["dtype"]), len(shape), 0, ref(name), t["group"],
                           t["offset"], shape + [0] * (MAX_DIMS - len(shape))))
        if section == 1:
            digests.append(bytes.fromhex(t["sha256"]))

    for k, li in enumerate(layers):
        layer_rows.append((li["index"], LAYOUT_CODES.index(Layout(li["layout"])), 0, 0, li["offset"],
                           ref(li["config"]), ref(li["state"])))
        for n, t in li["arrays"].items():
            add(k, 0, n, t)
        for n, t in li["calibration"].items():
            add(k, 1, n, t)
    codec_rows = []
    for k, (name, c) in enumerate(codecs.items()):
        codec_rows.append((ref(name), ref(c["rotation_kind"]), ref(c["norm_mode"])))
        for n, t in c["arrays"].items():
            add(k, 2, n, t)
    dictionary = b"[" + b",".join(words) + b"]"
    data = b"".join([np.array(layer_rows, dtype=LAYER).tobytes(), np.array(array_rows, dtype=ARRAY).tobytes(),
                     np.array(codec_rows, dtype=CODEC).tobytes(), b"".join(digests), dictionary])
    return Tables(len(layer_rows), len(array_rows), len(codec_rows), len(digests), len(dictionary), data)


def encode_header(kind: str, prov: Provenance, block: BlockInfo | None, tables: Tables,
                  groups: Sequence[dict[str, Any]]) -> bytes:
    """The header bytes of an object whose groups are already encoded: its fixed part, tokens,
    group table and `tables`. `groups` holds one record per group: dtype, encoding, stored,
    nbytes, xxh3 (16 bytes); each record's "offset" in the object is set here (groups follow
    the header at aligned offsets)."""
    tokens = prov.tokens
    size = HEAD.size + 4 * len(tokens or ()) + GROUP.itemsize * len(groups) + len(tables.data)
    at = align(64 + size)
    for g in groups:
        g["offset"], at = at, align(at + g["stored"])
    group_rows = [(DTYPE_CODES.index(g["dtype"]), ENCODINGS.index(g["encoding"]), 0, 0, g["offset"], g["stored"],
                   g["nbytes"], g["xxh3"]) for g in groups]
    flags = sum(1 << j for j, f in enumerate(_FLAGS) if getattr(prov, f) is not None)
    b = block or BlockInfo(0, 0, 0, 0)
    head = HEAD.pack(KINDS.index(kind), flags, 0, NONE if tokens is None else len(tokens), tables.n_layers,
                     tables.n_arrays, tables.n_codecs, tables.n_digests, tables.dictionary_nbytes,
                     b.index, b.start, b.n_tokens, b.block_size,
                     *(_raw(getattr(prov, f)) for f in _FLAGS))
    return b"".join([head, np.asarray(tokens or (), dtype="<u4").tobytes(),
                     np.array(group_rows, dtype=GROUP).tobytes(), tables.data])


@functools.lru_cache(maxsize=4096)
def _canonical(value: str | tuple) -> bytes:
    """The canonical JSON of a string or of a scalar map given as (key, type, value, float repr)
    items (types keep 1, 1.0 and True apart, reprs 0.0 and -0.0): the blocks of an entry repeat
    a few of each."""
    return canonical_json(value if isinstance(value, str) else {k: v for k, _, v, _ in value})


def _raw(digest: bytes | BlockKey | None) -> bytes:
    if digest is None:
        return bytes(32)
    return digest.raw if isinstance(digest, BlockKey) else digest


@dataclass(frozen=True)
class Groups:
    """The group table of an object: each group's place in the object and its digest."""

    infos: tuple[GroupInfo, ...]
    offsets: np.ndarray  # where each group's stored bytes start in the object
    stored: np.ndarray  # their length
    xxh3: tuple[bytes, ...]


def read_header(header: memoryview, payload_nbytes: int, object_nbytes: int | None) -> tuple[Header, Groups]:
    """Check and type the header bytes of a format 3 object of `object_nbytes` bytes (None: only
    its first bytes are at hand) whose frame says `payload_nbytes` follow it. Raises
    MalformedHeader or TruncatedData."""
    if len(header) < HEAD.size:
        raise MalformedHeader(f"the {len(header)}-byte header is shorter than its {HEAD.size}-byte fixed part")
    (kind_code, flags, zero, n_tokens, n_layers, n_arrays, n_codecs, n_digests, dict_len, b_index, b_start,
     b_tokens, b_size, *digests) = HEAD.unpack_from(header)
    if kind_code >= len(KINDS) or zero or flags >> len(_FLAGS):
        raise MalformedHeader(f"unknown object kind {kind_code} or flags {flags:#x}")
    kind = KINDS[kind_code]
    present = {f: (d if flags >> j & 1 else None) for j, (f, d) in enumerate(zip(_FLAGS, digests))}
    if any(d != bytes(32) for f, d in zip(_FLAGS, digests) if present[f] is None):
        raise MalformedHeader("a digest marked absent is not zero")
    sizes = [HEAD.size, 4 * (0 if n_tokens == NONE else n_tokens), 0, LAYER.itemsize * n_layers,
             ARRAY.itemsize * n_arrays, CODEC.itemsize * n_codecs, 32 * n_digests, dict_len]
    # the group count is what is left: the header has exactly these parts
    rest = len(header) - sum(sizes)
    if rest < 0 or rest % GROUP.itemsize:
        raise MalformedHeader(f"the header's {len(header)} bytes do not hold the tables its counts give")
    sizes[2] = rest
    ends = list(itertools.accumulate(sizes))
    part = [header[a:b] for a, b in zip([0] + ends[:-1], ends)]
    tokens = None if n_tokens == NONE else tuple(np.frombuffer(part[1], "<u4").tolist())
    groups = _groups(np.frombuffer(part[2], GROUP), len(header), payload_nbytes, object_nbytes)
    prov = Provenance(present["model"], present["codec"], present["calibration"], tokens,
                      present["key"] and BlockKey(present["key"]), present["parent"] and BlockKey(present["parent"]))
    block = None
    if kind == "block":
        block = BlockInfo(b_index, b_start, b_tokens, b_size)
    elif (b_index, b_start, b_tokens, b_size) != (0, 0, 0, 0):
        raise MalformedHeader(f"a {kind} has no block record")
    layouts = _layouts(header[ends[2]:], kind, block, groups.infos, (n_layers, n_arrays, n_codecs, n_digests))
    check_kind(kind, prov, block, layouts.layers, layouts.codecs, block_layers_checked=True,
               token_ids=None if tokens is None else bytes(part[1]))
    return Header(3, kind, prov, block, layouts.layers, layouts.codecs, payload_nbytes, groups.infos), groups


def _groups(g: np.ndarray, header_nbytes: int, payload_nbytes: int, object_nbytes: int) -> Groups:
    """The group table, checked in one vectorized pass: known dtypes and encodings, zero
    reserved fields, groups laid one after the other at aligned offsets up to the object's end.
    The checks cover everything but the digests, which the blocks of an entry alone differ in:
    they run once per distinct rest of the table (and the object's sizes)."""
    key = (g.view(np.uint8).reshape(len(g), GROUP.itemsize)[:, :_DIGEST_AT].tobytes(), header_nbytes,
           payload_nbytes, object_nbytes)
    with _LOCK:
        found = _GROUPS.get(key)
    if found is None:
        found = _checked_groups(g, header_nbytes, payload_nbytes, object_nbytes)
        with _LOCK:
            if len(_GROUPS) >= _CACHE_SIZE:
                _GROUPS.clear()
            _GROUPS[key] = found
    digests = g["xxh3"].tobytes()  # (one copy: bytes() of each record's field cost 2-3 us a group)
    return Groups(*found, tuple(digests[i:i + 16] for i in range(0, len(digests), 16)))


_DIGEST_AT = GROUP.fields["xxh3"][1]  # the digest is each record's last field
_GROUPS: dict[tuple, tuple[tuple[GroupInfo, ...], np.ndarray, np.ndarray]] = {}  # a memo of `_checked_groups`


def _checked_groups(g: np.ndarray, header_nbytes: int, payload_nbytes: int, object_nbytes: int
                    ) -> tuple[tuple[GroupInfo, ...], np.ndarray, np.ndarray]:
    """`_groups`' checks; each group's info, offset and stored length (read-only arrays)."""
    if len(g) and (g["dtype"].max() >= len(DTYPE_CODES) or g["encoding"].max() >= len(ENCODINGS)
                   or g["zero"].any() or g["zero2"].any()):
        raise MalformedHeader("a group has an unknown dtype or encoding, or a reserved field that is not 0")
    stored, nbytes, offsets = g["stored"].astype(np.int64), g["nbytes"], g["offset"]
    if len(g) and (nbytes.max() >= MAX_ELEMENTS or stored.max() >= MAX_ELEMENTS):
        raise MalformedHeader("a group claims more bytes than any object holds")
    itemsize = np.array([DTYPES[c][0].size for c in DTYPE_CODES])[g["dtype"]]
    raw = g["encoding"] == ENCODINGS.index("raw")
    expected = np.empty(len(g), np.int64)
    ends = np.empty(len(g), np.int64)
    at = align(64 + header_nbytes)
    if len(g):
        # each group starts at the aligned end of the one before it
        ends[:] = offsets.astype(np.int64) + stored
        expected[0] = at
        expected[1:] = -(-ends[:-1] // ALIGN) * ALIGN
    if (offsets.astype(np.int64) != expected).any() or (nbytes % itemsize).any() or (raw & (stored != nbytes)).any():
        raise MalformedHeader("the groups are not laid one after the other at aligned offsets, or a size does not fit "
                              "its dtype or encoding")
    end = int(ends[-1]) if len(g) else 64 + header_nbytes
    if end != 64 + payload_nbytes:
        raise MalformedHeader(f"the groups end at byte {end}, the frame says the object has {64 + payload_nbytes}")
    if object_nbytes is not None and object_nbytes < end:
        raise TruncatedData(f"object truncated to {object_nbytes} bytes; its groups end at byte {end}")
    infos = tuple(GroupInfo(DTYPE_CODES[d], ENCODINGS[e], int(n), "") for d, e, n in
                  zip(g["dtype"].tolist(), g["encoding"].tolist(), nbytes.tolist()))
    offsets = offsets.astype(np.int64)
    offsets.flags.writeable = stored.flags.writeable = False  # shared by every object with this table
    return infos, offsets, stored


_CACHE: OrderedDict[bytes, Layouts] = OrderedDict()
_CACHE_SIZE = 256
_LOCK = threading.Lock()


def _layouts(tables: memoryview, kind: str, block: BlockInfo | None, groups: tuple[GroupInfo, ...],
             counts: tuple[int, int, int, int]) -> Layouts:
    """The typed layers and codecs of `tables` (the header after its group table), validated
    once per distinct tables (their bytes, the group dtypes and sizes, and what a kind checks
    against). The cache key is the one copy of the tables a read makes."""
    key = b"".join([tables, kind.encode(), repr((block and (block.index == 0, block.n_tokens),
                                                 [(g.dtype, g.nbytes) for g in groups])).encode()])
    with _LOCK:
        found = _CACHE.get(key)
        if found is not None:
            _CACHE.move_to_end(key)
            return found
    found = _validate(tables, kind, groups, counts)
    if block is not None:
        check_block_layers(block, found.layers)  # what it checks is in the key: once per key
    with _LOCK:
        _CACHE[key] = found
        if len(_CACHE) > _CACHE_SIZE:
            _CACHE.popitem(last=False)
    return found


def _validate(tables: memoryview, kind: str, groups: tuple[GroupInfo, ...],
              counts: tuple[int, int, int, int]) -> Layouts:
    n_layers, n_arrays, n_codecs, n_digests = counts
    at = 0

    def take(dtype: np.dtype | int, n: int) -> Any:
        nonlocal at
        size = n * (dtype.itemsize if isinstance(dtype, np.dtype) else dtype)
        view = tables[at:at + size]
        at += size
        return np.frombuffer(view, dtype) if isinstance(dtype, np.dtype) else bytes(view)

    layers, arrays, codecs = take(LAYER, n_layers), take(ARRAY, n_arrays), take(CODEC, n_codecs)
    digests = take(32, n_digests)
    words = json_value(tables[at:], "dictionary")
    if not isinstance(words, list):
        raise MalformedHeader("the header's dictionary is not a list")
    n_words = len(words)
    if (layers["layout"] >= len(LAYOUT_CODES)).any() or layers["zero"].any() or layers["zero2"].any() \
            or (layers["config"] >= n_words).any() or (layers["state"] >= n_words).any():
        raise MalformedHeader("a layer record has an unknown layout, a reserved field that is not 0 or a bad reference")
    owners = np.where(arrays["section"] == 2, n_codecs, n_layers)
    ndim = arrays["ndim"].astype(np.int64)
    dims = np.arange(MAX_DIMS)
    if (arrays["section"] >= len(SECTIONS)).any() or (arrays["dtype"] >= len(DTYPE_CODES)).any() \
            or (ndim > MAX_DIMS).any() or arrays["zero"].any() or (arrays["owner"] >= owners).any() \
            or (arrays["name"] >= n_words).any() or (arrays["group"] >= len(groups)).any() \
            or (arrays["shape"][dims[None, :] >= ndim[:, None]] != 0).any() \
            or (arrays["shape"] >= MAX_ELEMENTS).any() or (arrays["offset"] >= MAX_ELEMENTS).any() \
            or int((arrays["section"] == 1).sum()) != n_digests \
            or (codecs["name"] >= n_words).any() or (codecs["rotation_kind"] >= n_words).any() \
            or (codecs["norm_mode"] >= n_words).any():
        raise MalformedHeader("an array or codec record has an unknown section or dtype, a reserved field that is not "
                              "0, a bad reference or shape, or the calibration digests do not match their arrays")
    _check_tiling(arrays, groups)
    word = [w if isinstance(w, str) else None for w in words]
    maps = [w if isinstance(w, dict) else None for w in words]
    digest_of = iter(digests[j:j + 32].hex() for j in range(0, len(digests), 32))
    tensors: list[dict[str, TensorInfo]] = [{} for _ in range(n_layers)]
    calibration: list[dict[str, TensorInfo]] = [{} for _ in range(n_layers)]
    codec_arrays: list[dict[str, TensorInfo]] = [{} for _ in range(n_codecs)]
    for owner, section, dtype, nd, name, group, offset, shape in zip(
            arrays["owner"].tolist(), arrays["section"].tolist(), arrays["dtype"].tolist(), ndim.tolist(),
            arrays["name"].tolist(), arrays["group"].tolist(), arrays["offset"].tolist(), arrays["shape"].tolist()):
        n = word[name]
        if n is None or n == "" or "/" in n:
            raise MalformedHeader(f"array name {words[name]!r:.40} is not a name")
        shape = tuple(shape[:nd])
        if math.prod(shape) >= MAX_ELEMENTS:
            raise MalformedHeader(f"array {n}: shape {list(shape)} is too large")
        table = (tensors, calibration, codec_arrays)[section][owner]
        if n in table:
            raise MalformedHeader(f"array {n} appears twice in one {SECTIONS[section]} record")
        table[n] = TensorInfo(DTYPE_CODES[dtype], shape, next(digest_of) if section == 1 else None, None, group,
                              offset)
    out_layers = []
    for k, (index, layout, offset, config, state) in enumerate(zip(
            layers["index"].tolist(), layers["layout"].tolist(), layers["offset"].tolist(),
            layers["config"].tolist(), layers["state"].tolist())):
        if maps[config] is None or maps[state] is None or not scalars_ok(maps[config]) or not scalars_ok(maps[state]):
            raise MalformedHeader(f"layer {index}: its config and state are not objects of scalars")
        li = LayerInfo(index, LAYOUT_CODES[layout], offset, maps[config], maps[state], tensors[k], calibration[k])
        check_layer(li)
        out_layers.append(li)
    out_codecs = {}
    for k, (name, rotation, norm) in enumerate(zip(codecs["name"].tolist(), codecs["rotation_kind"].tolist(),
                                                   codecs["norm_mode"].tolist())):
        n = word[name]
        if n is None or n == "" or "/" in n or n in out_codecs or word[rotation] is None or word[norm] is None:
            raise MalformedHeader(f"codec {words[name]!r:.40}: bad or repeated name, rotation_kind or norm_mode")
        out_codecs[n] = CodecInfo(word[rotation], word[norm], codec_arrays[k])
    return Layouts(tuple(out_layers), out_codecs)


def _check_tiling(arrays: np.ndarray, groups: tuple[GroupInfo, ...]) -> None:
    """Every group holds arrays of its dtype that tile its decoded bytes exactly, in order (one
    sort and a few vectorized comparisons)."""
    itemsize = np.array([DTYPES[c][0].size for c in DTYPE_CODES], np.int64)
    shape = arrays["shape"].astype(np.int64)
    ndim = arrays["ndim"].astype(np.int64)
    shape[np.arange(MAX_DIMS)[None, :] >= ndim[:, None]] = 1
    with np.errstate(over="ignore"):
        sizes = shape.prod(axis=1) * itemsize[arrays["dtype"]]
    group_dtype = np.array([DTYPE_CODES.index(g.dtype) for g in groups], np.int64)
    group_nbytes = np.array([g.nbytes for g in groups], np.int64)
    order = np.lexsort((arrays["offset"], arrays["group"]))
    g, off, size = arrays["group"][order].astype(np.int64), arrays["offset"][order].astype(np.int64), sizes[order]
    first = np.ones(len(g), bool)
    first[1:] = g[1:] != g[:-1]
    start = np.where(first, 0, np.concatenate([[0], off[:-1] + size[:-1]]))
    last = np.ones(len(g), bool)
    last[:-1] = first[1:]
    ok = (len(arrays) == 0 and not groups) or (
        (group_dtype[g] == arrays["dtype"][order]).all() and (off == start).all()
        and (off[last] + size[last] == group_nbytes[g[last]]).all() and int(first.sum()) == len(groups))
    if not ok:
        raise MalformedHeader("the arrays do not tile their groups exactly (each group holds arrays of its dtype, one "
                              "after the other, covering its bytes)")
