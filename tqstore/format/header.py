"""The header of a stored object: its types (`Header`, `Provenance`, `Expect`, per-layer and
per-tensor records) and its schema. `parse_header` validates a decoded JSON header completely
(exact keys, types, ranges, the object kind's own rules, the block key and calibration digest)
and types it, or raises MalformedHeader; `format.py` frames, hashes and encodes around it."""

from __future__ import annotations

import functools
import json
import math
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from turboquant.records import BLOCK_ARRAYS, WHOLE_LAYOUTS, LayerRecord, Layout, check_record_arrays, in_block_form

from tqstore.format.blocks import BlockKey, digest_calibration, key_of_ids, token_bytes
from tqstore.canonical import DTYPES
from tqstore.errors import MalformedHeader

KINDS = ("snapshot", "block", "window", "shared")
ENCODINGS = ("raw", "zstd", "shuffle-zstd")
_FLOATS = ("float16", "bfloat16", "float32")
MAX_ELEMENTS = 2**48  # per tensor: bounds what a header may claim before any allocation


@dataclass(frozen=True)
class Provenance:
    """Whom an object belongs to: identity digests (32 raw bytes each), tokens and keys.

    A block needs model, codec and tokens (and `parent`, except block 0; `calibration` for
    later blocks of a calibrated entry); its key is computed. A window is bound to its entry
    by `key` (the entry's last block key, which chains every token).
    """

    model: bytes | None = None
    codec: bytes | None = None
    calibration: bytes | None = None
    tokens: tuple[int, ...] | None = None
    key: BlockKey | None = None
    parent: BlockKey | None = None


@dataclass(frozen=True)
class Expect:
    """What `loads` must find; None fields are not checked."""

    kind: str | None = None
    model: bytes | None = None
    codec: bytes | None = None
    tokens: Sequence[int] | None = None
    key: BlockKey | None = None


@dataclass(frozen=True)
class TensorInfo:
    """One array: format 1 stores it on its own (`encoding`, `sha256` of its bytes); format 2 at
    `offset` in the decoded bytes of group `group` (with `sha256` for calibration arrays only)."""

    dtype: str
    shape: tuple[int, ...]
    sha256: str | None
    encoding: str | None
    group: int | None = None
    offset: int = 0

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPES[self.dtype][0].size


@dataclass(frozen=True)
class LayerInfo:
    index: int
    layout: Layout
    offset: int
    config: Mapping[str, Any]
    state: Mapping[str, Any]
    arrays: Mapping[str, TensorInfo]
    calibration: Mapping[str, TensorInfo]


@dataclass(frozen=True)
class CodecInfo:
    rotation_kind: str
    norm_mode: str
    arrays: Mapping[str, TensorInfo]


@dataclass(frozen=True)
class BlockInfo:
    index: int
    start: int
    n_tokens: int
    block_size: int


@dataclass(frozen=True)
class GroupInfo:
    """Format 2: the arrays of one name and dtype in an object, concatenated and encoded once."""

    dtype: str
    encoding: str
    nbytes: int  # decoded
    sha256: str  # of the decoded bytes: checks the writer end to end (the frame checks the storage)


@dataclass(frozen=True)
class Header:
    """An object's header: everything but the tensor bytes."""

    version: int
    kind: str
    provenance: Provenance
    block: BlockInfo | None
    layers: tuple[LayerInfo, ...]
    codecs: Mapping[str, CodecInfo]
    payload_nbytes: int
    groups: tuple[GroupInfo, ...] = ()

    def tensors(self) -> dict[str, TensorInfo]:
        """Every tensor by its safetensors name."""
        out = {}
        for li in self.layers:
            out.update({layer_tensor(li.index, n): t for n, t in li.arrays.items()})
            out.update({layer_tensor(li.index, n, calibration=True): t for n, t in li.calibration.items()})
        for name, c in self.codecs.items():
            out.update({codec_tensor(name, n): t for n, t in c.arrays.items()})
        return out


def layer_tensor(index: int, name: str, calibration: bool = False) -> str:
    return f"layer/{index}/calibration/{name}" if calibration else f"layer/{index}/{name}"


def codec_tensor(codec: str, name: str) -> str:
    return f"codec/{codec}/{name}"


_TOP = ("kind", "identity", "tokens", "key", "parent", "block", "layers", "codecs")
_TOP_V2 = (*_TOP, "groups")
_HEX = frozenset("0123456789abcdef")


def parse_header(h: Any, version: int, payload_nbytes: int) -> Header:
    """Validate the JSON header completely (raises MalformedHeader) and type it."""
    h = _exact(h, _TOP if version == 1 else _TOP_V2, "header")
    kind = h["kind"]
    if kind not in KINDS:
        raise MalformedHeader(f"unknown object kind {kind!r:.40} (known: {', '.join(KINDS)})")
    ident = _exact(h["identity"], ("model", "codec", "calibration"), "identity")
    tokens = h["tokens"]
    if tokens is not None and not (isinstance(tokens, list)
                                   and all(type(t) is int and 0 <= t < 2**32 for t in tokens)):
        raise MalformedHeader("tokens must be a list of u32 token ids")
    key, parent = _digest(h["key"], "key"), _digest(h["parent"], "parent")
    prov = Provenance(_digest(ident["model"], "identity.model"), _digest(ident["codec"], "identity.codec"),
                      _digest(ident["calibration"], "identity.calibration"),
                      None if tokens is None else tuple(tokens), key and BlockKey(key), parent and BlockKey(parent))
    if not isinstance(h["layers"], list) or not isinstance(h["codecs"], dict):
        raise MalformedHeader("layers must be a list and codecs an object")
    layers = _layers(h["layers"], version)
    codecs = {}
    for name, c in h["codecs"].items():
        c = _exact(c, ("rotation_kind", "norm_mode", "arrays"), f"codec {name!r:.40}")
        if not _name_ok(name) or not isinstance(c["rotation_kind"], str) or not isinstance(c["norm_mode"], str):
            raise MalformedHeader(f"codec {name!r:.40}: bad name, rotation_kind or norm_mode")
        codecs[name] = CodecInfo(c["rotation_kind"], c["norm_mode"], _tensors(c["arrays"], f"codec {name}", version))
    block = None
    if kind == "block":
        b = _exact(h["block"], ("index", "start", "n_tokens", "block_size"), "block")
        block = BlockInfo(*(_int(b[k], f"block.{k}") for k in ("index", "start", "n_tokens", "block_size")))
    elif h["block"] is not None:
        raise MalformedHeader(f"a {kind} has no block record")
    check_kind(kind, prov, block, layers, codecs)
    header = Header(version, kind, prov, block, layers, codecs, payload_nbytes)
    if version == 1:
        return header
    groups = _groups(h["groups"], header.tensors())
    return Header(version, kind, prov, block, layers, codecs, payload_nbytes, groups)


def _groups(v: Any, tensors: dict[str, TensorInfo]) -> tuple[GroupInfo, ...]:
    """Format 2's groups; every array lies in one, and a group's arrays (all of its dtype) tile
    its decoded bytes exactly, in order."""
    if not isinstance(v, list) or len(v) > len(tensors) + 1:
        raise MalformedHeader("groups must be a list, at most one per array")
    groups = []
    for j, g in enumerate(v):
        g = _exact(g, ("dtype", "encoding", "nbytes", "sha256"), f"groups[{j}]")
        if not isinstance(g["dtype"], str) or g["dtype"] not in DTYPES or not isinstance(g["encoding"], str) \
                or g["encoding"] not in ENCODINGS or type(g["nbytes"]) is not int \
                or not 0 <= g["nbytes"] < MAX_ELEMENTS or _digest(g["sha256"], f"groups[{j}].sha256") is None:
            raise MalformedHeader(f"groups[{j}]: bad dtype, encoding, size or sha256")
        groups.append(GroupInfo(g["dtype"], g["encoding"], g["nbytes"], g["sha256"]))
    members: dict[int, list[tuple[int, int, str]]] = {}
    for name, t in tensors.items():
        if t.group is None or t.group >= len(groups) or t.dtype != groups[t.group].dtype:
            raise MalformedHeader(f"tensor {name}: group {t.group} does not exist or holds another dtype")
        members.setdefault(t.group, []).append((t.offset, t.nbytes, name))
    for j, group in enumerate(groups):
        end = 0
        for offset, nbytes, name in sorted(members.get(j, [])):
            if offset != end:
                raise MalformedHeader(f"tensor {name} starts at byte {offset} of group {j}, expected {end}")
            end += nbytes
        if end != group.nbytes or j not in members:
            raise MalformedHeader(f"the arrays of group {j} cover {end} of its {group.nbytes} bytes")
    return tuple(groups)


def check_kind(kind: str, prov: Provenance, block: BlockInfo | None, layers: tuple[LayerInfo, ...],
               codecs: Mapping[str, CodecInfo], *, block_layers_checked: bool = False,
               token_ids: bytes | None = None) -> None:
    """The rules of an object's kind over its typed header (MalformedHeader): which layers and
    codecs it holds, its tokens, its calibration digest, and a block's place and key. With
    `block_layers_checked`, a block's layer records were checked against its block record
    already (`check_block_layers`: tables.py does so once per distinct table). `token_ids`:
    `prov.tokens` as the object stores them (u32 little-endian), where the caller read them: the
    key is hashed from those bytes instead of converting the ids back."""
    indices = [li.index for li in layers]
    if kind in ("snapshot", "window") and indices != list(range(len(layers))):
        raise MalformedHeader(f"a {kind} lists layers 0..n-1 in order, got {indices[:8]}")
    if (kind in ("block", "window") and codecs) or (kind == "shared" and layers):
        raise MalformedHeader(f"a {kind} holds {'no codecs' if kind != 'shared' else 'no layers'}")
    if kind != "block" and prov.parent is not None:
        raise MalformedHeader(f"a {kind} has no parent key")
    n_tokens = max((li.offset for li in layers), default=0)
    if prov.tokens is not None and (kind == "shared" or (kind != "block" and len(prov.tokens) != n_tokens)):
        raise MalformedHeader(f"a {kind} of {n_tokens} tokens records {len(prov.tokens)} token ids")
    if kind == "snapshot" or (block is not None and block.index == 0):
        found = digest_calibration([(li.index, {n: {"dtype": t.dtype, "shape": list(t.shape), "sha256": t.sha256}
                                                for n, t in li.calibration.items()}) for li in layers])
        if found != prov.calibration:
            raise MalformedHeader("the calibration digest does not match the calibration arrays")
    if block is None:
        return
    if not (0 < block.n_tokens <= block.block_size and block.start == block.index * block.block_size):
        raise MalformedHeader(f"block {block.index} of size {block.block_size} cannot start at token {block.start} "
                              f"and hold {block.n_tokens} tokens")
    if not block_layers_checked:
        check_block_layers(block, layers)
    if None in (prov.model, prov.codec, prov.tokens, prov.key) or len(prov.tokens) != block.n_tokens \
            or (block.index == 0) != (prov.parent is None):
        raise MalformedHeader(f"block {block.index} needs model and codec digests, its {block.n_tokens} tokens, its "
                              "key and (after block 0) its parent key")
    ids = token_bytes(prov.tokens) if token_ids is None else token_ids
    if key_of_ids(prov.parent, ids, prov.model, prov.codec, prov.calibration) != prov.key:
        raise MalformedHeader(f"block {block.index}'s key does not match its parent, identity and tokens")


def check_block_layers(block: BlockInfo, layers: tuple[LayerInfo, ...]) -> None:
    """A block's layer records against its block record (MalformedHeader): increasing indices,
    per-token layers of the block's tokens, calibration only in block 0. They depend on the
    records, the block's token count and whether it is block 0, nothing else."""
    indices = [li.index for li in layers]
    if indices != sorted(set(indices)):
        raise MalformedHeader(f"block layers must be in increasing index order, got {indices[:8]}")
    for li in layers:
        if li.layout in (WHOLE_LAYOUTS - {Layout.STATE, Layout.LIST, Layout.FIELDS}) or li.offset != block.n_tokens \
                or (li.layout in (Layout.LIST, Layout.FIELDS) and not in_block_form(li, block.n_tokens)) \
                or (block.index and li.calibration):
            raise MalformedHeader(f"block {block.index}: layer {li.index} is {li.layout.value} with {li.offset} tokens"
                                  f"{' and calibration' if li.calibration else ''}; a block holds per-token layers of "
                                  f"{block.n_tokens} tokens, calibration only in block 0")


_LAYERS_CACHE: OrderedDict[tuple[str, int], tuple[LayerInfo, ...]] = OrderedDict()
_LAYERS_CACHE_SIZE = 256
_LAYERS_LOCK = threading.Lock()


def _layers(v: list, version: int) -> tuple[LayerInfo, ...]:
    """Every layer record, validated. Memoized by the records' exact JSON: the blocks of an
    entry repeat the same records (only the last block differs), so a restore validates each
    distinct list once; anything new or malformed goes through `_layer` in full."""
    key = (json.dumps(v, separators=(",", ":")), version)
    with _LAYERS_LOCK:
        found = _LAYERS_CACHE.get(key)
        if found is not None:
            _LAYERS_CACHE.move_to_end(key)
            return found
    layers = tuple(_layer(x, f"layers[{j}]", version) for j, x in enumerate(v))
    with _LAYERS_LOCK:
        _LAYERS_CACHE[key] = layers
        if len(_LAYERS_CACHE) > _LAYERS_CACHE_SIZE:
            _LAYERS_CACHE.popitem(last=False)
    return layers


def _layer(v: Any, where: str, version: int) -> LayerInfo:
    v = _exact(v, ("index", "layout", "offset", "config", "state", "arrays", "calibration"), where)
    try:
        layout = Layout(v["layout"])
    except (ValueError, TypeError):
        raise MalformedHeader(f"{where}: unknown layout {v['layout']!r:.40} "
                              f"(known: {', '.join(x.value for x in Layout)})") from None
    li = LayerInfo(_int(v["index"], f"{where}.index"), layout, _int(v["offset"], f"{where}.offset"),
                   _scalars(v["config"], f"{where}.config"), _scalars(v["state"], f"{where}.state"),
                   _tensors(v["arrays"], f"{where}.arrays", version),
                   _tensors(v["calibration"], f"{where}.calibration", version, digests=True))
    check_layer(li)
    return li


def check_layer(li: LayerInfo) -> None:
    """MalformedHeader unless the layer's arrays (names, dtypes, shapes) fit its layout, offset,
    config and state."""
    problem = _arrays_problem(li.layout, li.offset, _typed(li.config), _typed(li.state),
                              tuple(sorted((n, t.dtype, t.shape) for n, t in li.arrays.items())))
    if problem is not None:
        raise MalformedHeader(f"layer {li.index} ({li.layout.value}): {problem}")


def _typed(scalars: Mapping[str, Any]) -> tuple:
    """A hashable form of a scalar mapping that tells 1, 1.0 and True apart (in the mapping's
    own order: headers list keys sorted, and another order only misses the cache)."""
    return tuple((k, type(v), v) for k, v in scalars.items())


@functools.lru_cache(maxsize=1024)
def _arrays_problem(layout: Layout, offset: int, config: tuple, state: tuple,
                    arrays: tuple[tuple[str, str, tuple[int, ...]], ...]) -> str | None:
    """What is wrong with a layer's arrays (names, dtypes, shapes against its layout, offset,
    config and state), or None. Memoized: every block of an entry repeats a few layer shapes."""
    # Recurrent states, nested lists and extra fields are not [B, H, T, D] rows: their own
    # record check is all that applies.
    token_addressed = layout not in (Layout.STATE, Layout.LIST, Layout.FIELDS)
    # TurboQuant row norms are float32 unless the layer's config names a narrower width (turbo5vN).
    norm_dtypes = {f"{side}s_norms": v for k, _, v in config for side in ("key", "value") if k == f"{side}_norms"}
    for n, dtype, shape in arrays if token_addressed else ():
        norms = n.endswith("_norms")
        dtypes = (("uint32",) if n.endswith(("_packed", "_w")) else (norm_dtypes.get(n, "float32"),) if norms
                  else _FLOATS)
        if len(shape) != (3 if norms else 4) or dtype not in dtypes:
            return f"{n} is {dtype} {list(shape)}; expected {'/'.join(dtypes)} with {3 if norms else 4} dims"
    # The data model's own rule for which arrays a layer holds and how many tokens each covers,
    # applied to shape-only stand-ins (broadcast views: no memory, whatever the header claims).
    stand_ins = {n: np.broadcast_to(np.empty((), np.uint8), shape) for n, _, shape in arrays}
    try:
        check_record_arrays(LayerRecord(layout, offset, stand_ins, {k: v for k, _, v in config},
                                        {k: v for k, _, v in state}))
    except (ValueError, TypeError, OverflowError, KeyError) as e:
        return str(e)
    if not token_addressed:
        return None
    heads = {shape[1] for _, _, shape in arrays}
    batch = {shape[0] for n, _, shape in arrays if n not in BLOCK_ARRAYS}
    if len(heads) > 1 or len(batch) > 1:
        return f"arrays disagree on batch or heads ({sorted(batch)}, {sorted(heads)})"
    return None


def _tensors(v: Any, where: str, version: int, digests: bool = False) -> dict[str, TensorInfo]:
    """Tensor records: format 1 {dtype, shape, sha256, encoding}; format 2 {dtype, shape, group,
    offset}, with sha256 where `digests` (calibration arrays, which the calibration digest hashes)."""
    if not isinstance(v, dict):
        raise MalformedHeader(f"{where}: expected an object of tensors")
    keys = ("dtype", "shape", "sha256", "encoding") if version == 1 else \
        ("dtype", "shape", "group", "offset", "sha256") if digests else ("dtype", "shape", "group", "offset")
    out = {}
    for name, t in v.items():
        t = _exact(t, keys, f"{where}.{name}")
        shape = t["shape"]
        ok = _name_ok(name) and isinstance(t["dtype"], str) and t["dtype"] in DTYPES \
            and isinstance(shape, list) and len(shape) <= 8 \
            and all(type(d) is int and 0 <= d < MAX_ELEMENTS for d in shape) and math.prod(shape) < MAX_ELEMENTS
        if version == 1:
            ok = ok and isinstance(t["encoding"], str) and t["encoding"] in ENCODINGS
        else:
            ok = ok and type(t["group"]) is int and type(t["offset"]) is int and 0 <= t["group"] \
                and 0 <= t["offset"] < MAX_ELEMENTS
        if not ok or ("sha256" in t and _digest(t["sha256"], f"{where}.{name}.sha256") is None):
            raise MalformedHeader(f"{where}.{name!s:.40}: bad name, dtype, shape, sha256, encoding or place")
        out[name] = TensorInfo(t["dtype"], tuple(shape), t.get("sha256"), t.get("encoding"), t.get("group"),
                               t.get("offset", 0))
    return out


def _exact(v: Any, keys: Sequence[str], where: str) -> dict:
    # Same length and every key present is set equality for distinct keys, without building sets.
    if not isinstance(v, dict) or len(v) != len(keys) or not all(k in v for k in keys):
        found = sorted(v)[:12] if isinstance(v, dict) else type(v).__name__
        raise MalformedHeader(f"{where}: expected exactly {', '.join(keys)}; found {found}")
    return v


def _int(v: Any, where: str) -> int:
    if type(v) is not int or v < 0:
        raise MalformedHeader(f"{where}: expected a non-negative integer, got {v!r:.40}")
    return v


def _digest(v: Any, where: str) -> bytes | None:
    if v is None:
        return None
    if not isinstance(v, str) or len(v) != 64 or not set(v) <= _HEX:
        raise MalformedHeader(f"{where}: expected 64 lowercase hex digits, got {v!r:.80}")
    return bytes.fromhex(v)


_SCALAR_TYPES = frozenset({type(None), bool, int, str})


def _scalars(v: Any, where: str) -> dict[str, Any]:
    if not scalars_ok(v):
        raise MalformedHeader(f"{where}: expected an object of scalars (int, float, str, bool, null)")
    return v


def scalars_ok(v: Any) -> bool:
    """Whether `v` (parsed JSON) is an object of scalars."""
    # JSON gives exactly these types (no subclasses): a type lookup per value.
    return isinstance(v, dict) and all(type(x) in _SCALAR_TYPES or (type(x) is float and math.isfinite(x))
                                       for x in v.values())


def json_value(raw, what: str) -> Any:
    """Strict JSON (no NaN or Infinity, no key twice), or MalformedHeader naming `what`."""
    def no_constants(name: str):
        raise ValueError(f"{name} is not JSON")

    def no_duplicates(pairs):
        # Called once per JSON object (thousands per format 2 restore): a dict shorter than its
        # pairs had a key twice, found without building the key list and set.
        table = dict(pairs)
        if len(table) != len(pairs):
            raise ValueError("a key appears twice")
        return table

    try:
        return json.loads(bytes(raw).decode("utf-8"), parse_constant=no_constants, object_pairs_hook=no_duplicates)
    except (UnicodeError, ValueError, RecursionError) as e:
        raise MalformedHeader(f"the {what} is not valid JSON ({e})") from None


def _name_ok(name: Any) -> bool:
    return isinstance(name, str) and name != "" and "/" not in name
