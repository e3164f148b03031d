"""The header of a stored object: its types (`Header`, `Provenance`, `Expect`, per-layer and
per-tensor records) and its schema. `parse_header` validates a decoded JSON header completely
(exact keys, types, ranges, the object kind's own rules, the block key and calibration digest)
and types it, or raises MalformedHeader; `format.py` frames, hashes and encodes around it."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from turboquant.records import BLOCK_ARRAYS, WHOLE_LAYOUTS, LayerRecord, Layout, check_record_arrays

from .blocks import BlockKey, block_key, digest_calibration
from .canonical import DTYPES
from .errors import MalformedHeader

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
    dtype: str
    shape: tuple[int, ...]
    sha256: str
    encoding: str

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
class Header:
    """An object's header: everything but the tensor bytes."""

    version: int
    kind: str
    provenance: Provenance
    block: BlockInfo | None
    layers: tuple[LayerInfo, ...]
    codecs: Mapping[str, CodecInfo]
    payload_nbytes: int

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
_HEX = frozenset("0123456789abcdef")


def parse_header(h: Any, version: int, payload_nbytes: int) -> Header:
    """Validate the JSON header completely (raises MalformedHeader) and type it."""
    h = _exact(h, _TOP, "header")
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
    layers = tuple(_layer(v, f"layers[{j}]") for j, v in enumerate(h["layers"]))
    codecs = {}
    for name, c in h["codecs"].items():
        c = _exact(c, ("rotation_kind", "norm_mode", "arrays"), f"codec {name!r:.40}")
        if not _name_ok(name) or not isinstance(c["rotation_kind"], str) or not isinstance(c["norm_mode"], str):
            raise MalformedHeader(f"codec {name!r:.40}: bad name, rotation_kind or norm_mode")
        codecs[name] = CodecInfo(c["rotation_kind"], c["norm_mode"], _tensors(c["arrays"], f"codec {name}"))
    block = None
    if kind == "block":
        b = _exact(h["block"], ("index", "start", "n_tokens", "block_size"), "block")
        block = BlockInfo(*(_int(b[k], f"block.{k}") for k in ("index", "start", "n_tokens", "block_size")))
    elif h["block"] is not None:
        raise MalformedHeader(f"a {kind} has no block record")
    _check_kind(kind, prov, block, layers, codecs)
    return Header(version, kind, prov, block, layers, codecs, payload_nbytes)


def _check_kind(kind: str, prov: Provenance, block: BlockInfo | None, layers: tuple[LayerInfo, ...],
                codecs: Mapping[str, CodecInfo]) -> None:
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
    if indices != sorted(set(indices)):
        raise MalformedHeader(f"block layers must be in increasing index order, got {indices[:8]}")
    if not (0 < block.n_tokens <= block.block_size and block.start == block.index * block.block_size):
        raise MalformedHeader(f"block {block.index} of size {block.block_size} cannot start at token {block.start} "
                              f"and hold {block.n_tokens} tokens")
    for li in layers:
        if li.layout in (WHOLE_LAYOUTS - {Layout.STATE}) or li.offset != block.n_tokens or (block.index and li.calibration):
            raise MalformedHeader(f"block {block.index}: layer {li.index} is {li.layout.value} with {li.offset} tokens"
                                  f"{' and calibration' if li.calibration else ''}; a block holds per-token layers of "
                                  f"{block.n_tokens} tokens, calibration only in block 0")
    if None in (prov.model, prov.codec, prov.tokens, prov.key) or len(prov.tokens) != block.n_tokens \
            or (block.index == 0) != (prov.parent is None):
        raise MalformedHeader(f"block {block.index} needs model and codec digests, its {block.n_tokens} tokens, its "
                              "key and (after block 0) its parent key")
    if block_key(prov.parent, prov.tokens, prov.model, prov.codec, prov.calibration) != prov.key:
        raise MalformedHeader(f"block {block.index}'s key does not match its parent, identity and tokens")


def _layer(v: Any, where: str) -> LayerInfo:
    v = _exact(v, ("index", "layout", "offset", "config", "state", "arrays", "calibration"), where)
    try:
        layout = Layout(v["layout"])
    except (ValueError, TypeError):
        raise MalformedHeader(f"{where}: unknown layout {v['layout']!r:.40} "
                              f"(known: {', '.join(x.value for x in Layout)})") from None
    li = LayerInfo(_int(v["index"], f"{where}.index"), layout, _int(v["offset"], f"{where}.offset"),
                   _scalars(v["config"], f"{where}.config"), _scalars(v["state"], f"{where}.state"),
                   _tensors(v["arrays"], f"{where}.arrays"), _tensors(v["calibration"], f"{where}.calibration"))
    where = f"layer {li.index} ({layout.value})"
    token_addressed = layout not in (Layout.STATE, Layout.LIST, Layout.FIELDS)
    for n, t in sorted(li.arrays.items()) if token_addressed else ():
        norms = n.endswith("_norms")
        dtypes = ("uint32",) if n.endswith(("_packed", "_w")) else ("float32",) if norms else _FLOATS
        if len(t.shape) != (3 if norms else 4) or t.dtype not in dtypes:
            raise MalformedHeader(f"{where}: {n} is {t.dtype} {list(t.shape)}; expected {'/'.join(dtypes)} with "
                                  f"{3 if norms else 4} dims")
    # The data model's own rule for which arrays a layer holds and how many tokens each covers,
    # applied to shape-only stand-ins (broadcast views: no memory, whatever the header claims).
    stand_ins = {n: np.broadcast_to(np.empty((), np.uint8), t.shape) for n, t in li.arrays.items()}
    try:
        check_record_arrays(LayerRecord(layout, li.offset, stand_ins, dict(li.config), dict(li.state)))
    except (ValueError, TypeError, OverflowError, KeyError) as e:
        raise MalformedHeader(f"{where}: {e}") from None
    if not token_addressed:
        return li
    heads = {t.shape[1] for t in li.arrays.values()}
    batch = {t.shape[0] for n, t in li.arrays.items() if n not in BLOCK_ARRAYS}
    if len(heads) > 1 or len(batch) > 1:
        raise MalformedHeader(f"{where}: arrays disagree on batch or heads ({sorted(batch)}, {sorted(heads)})")
    return li


def _tensors(v: Any, where: str) -> dict[str, TensorInfo]:
    if not isinstance(v, dict):
        raise MalformedHeader(f"{where}: expected an object of tensors")
    out = {}
    for name, t in v.items():
        t = _exact(t, ("dtype", "shape", "sha256", "encoding"), f"{where}.{name}")
        shape = t["shape"]
        if not _name_ok(name) or not isinstance(t["dtype"], str) or t["dtype"] not in DTYPES \
                or not isinstance(t["encoding"], str) or t["encoding"] not in ENCODINGS \
                or not isinstance(shape, list) or len(shape) > 8 \
                or not all(type(d) is int and 0 <= d < MAX_ELEMENTS for d in shape) \
                or math.prod(shape) >= MAX_ELEMENTS or _digest(t["sha256"], f"{where}.{name}.sha256") is None:
            raise MalformedHeader(f"{where}.{name!s:.40}: bad name, dtype, shape, sha256 or encoding")
        out[name] = TensorInfo(t["dtype"], tuple(shape), t["sha256"], t["encoding"])
    return out


def _exact(v: Any, keys: Sequence[str], where: str) -> dict:
    if not isinstance(v, dict) or set(v) != set(keys):
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


def _scalars(v: Any, where: str) -> dict[str, Any]:
    def scalar(x: Any) -> bool:
        return x is None or isinstance(x, (bool, int, str)) or (type(x) is float and math.isfinite(x))

    if not isinstance(v, dict) or not all(scalar(x) for x in v.values()):
        raise MalformedHeader(f"{where}: expected an object of scalars (int, float, str, bool, null)")
    return v


def _name_ok(name: Any) -> bool:
    return isinstance(name, str) and name != "" and "/" not in name
