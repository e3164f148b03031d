"""A snapshot of a model's KV caches as plain data: per-layer records plus shared codec arrays.

A snapshot is what the storage layer persists and what `restore` rebuilds caches from; nothing
in it depends on a random generator or on the process that made it.

Array naming: every per-token array is named `<side><suffix>` (side = `keys` or `values`) and
has the token axis at position 2 ([B, H, T, ...]), so a record can be cut into token blocks
along one axis and joined back. Suffixes by side format: native `""`, affine `_w` / `_scales` /
`_biases`, TurboQuant `_packed` / `_norms`. Layers that are not token-addressable hold other
names: recurrent states `state<j>` (plus `state<j>@<t>`, the state after token t, at block
boundaries), a CacheList's children under `c<i>.` prefixes, a model's own cache class its
attribute names. A compressed layer also holds the raw rows that do
not yet fill a block (`tail_keys`, `tail_values`) and the per-block key means (`keys_shift`,
[1, H, blocks, D]: axis 2 counts 256-token blocks). `token_span` says which tokens an array
covers.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass, field

import mlx.core as mx

TOKEN_AXIS = 2
BLOCK_TOKENS = 256  # the block of per-block arrays (keys_shift), equal to the storage block
TAIL_ARRAYS = ("tail_keys", "tail_values")
BLOCK_ARRAYS = ("keys_shift",)
Scalar = int | float | str | bool | None


class Layout(str, enum.Enum):
    """How one layer's arrays are stored (an explicit enum, never inferred from array counts)."""

    RAW = "raw"  # native K and V: raw scheme, native layers, or the prefill phase of any scheme
    RAWK_TURBO = "rawk-turbo"  # turbo0vN: native K, TurboQuant V
    AFFINEK_TURBO = "affinek-turbo"  # turbo8vN: 8-bit affine K, TurboQuant V
    TURBO = "turbo"  # TurboQuant K and V, calibration skipped (too few rows or flat keys)
    CALIBRATED = "calibrated"  # TurboQuant K with per-dimension calibration, TurboQuant V
    AFFINE = "affine"  # affine K and V (affine schemes and protected boundary layers)
    ROTATING = "rotating"  # sliding-window layer: mlx-lm RotatingKVCache ring buffers, native
    QUANTIZED = "quantized"  # mlx-lm QuantizedKVCache: its affine K and V as it holds them
    CHUNKED = "chunked"  # mlx-lm ChunkedKVCache: the rows after start_position (front trimmed), native
    STATE = "state"  # mlx-lm ArraysCache: recurrent / conv states, native, one per block boundary
    LIST = "list"  # mlx-lm CacheList: child records flattened under "c<i>." prefixes, any depth
    FIELDS = "fields"  # a model module's own cache class: its array attributes and scalars


SIDE_SUFFIXES = {"native": ("",), "affine": ("_w", "_scales", "_biases"), "turbo": ("_packed", "_norms")}

# The array names each layout holds (the array-name table of docs/format.md).
LAYOUT_ARRAYS: dict[Layout, tuple[str, ...]] = {
    Layout.RAW: ("keys", "values"),
    Layout.RAWK_TURBO: ("keys", "values_packed", "values_norms"),
    Layout.AFFINEK_TURBO: ("keys_w", "keys_scales", "keys_biases", "values_packed", "values_norms"),
    Layout.TURBO: ("keys_packed", "keys_norms", "values_packed", "values_norms"),
    Layout.CALIBRATED: ("keys_packed", "keys_norms", "values_packed", "values_norms"),
    Layout.AFFINE: ("keys_w", "keys_scales", "keys_biases", "values_w", "values_scales", "values_biases"),
    Layout.ROTATING: ("keys", "values"),
    Layout.QUANTIZED: ("keys_w", "keys_scales", "keys_biases", "values_w", "values_scales", "values_biases"),
    Layout.CHUNKED: ("keys", "values"),
}
# Layouts whose arrays are not cut along the token axis (what they hold is checked by their own rule).
WHOLE_LAYOUTS = frozenset({Layout.ROTATING, Layout.CHUNKED, Layout.STATE, Layout.LIST, Layout.FIELDS})
_STATE_NAME = re.compile(r"state(\d+)(?:@(\d+))?")
_CHILD_NAME = re.compile(r"c(\d+)\.(.+)")


def state_boundary(name: str) -> tuple[int, int | None]:
    """(state index, token boundary or None for the current state) of a STATE array name."""
    m = _STATE_NAME.fullmatch(name)
    if m is None:
        raise ValueError(f"{name!r} is not a recurrent state array name (state<j> or state<j>@<t>)")
    return int(m.group(1)), None if m.group(2) is None else int(m.group(2))


def state_boundaries(record: "LayerRecord") -> list[int]:
    """The token boundaries at which a STATE record holds a checkpoint, in order."""
    return sorted({t for t in (state_boundary(n)[1] for n in record.arrays) if t is not None})


def state_at(record: "LayerRecord", boundary: int) -> dict[str, mx.array]:
    """A STATE record's arrays after `boundary` tokens (its current state at its own offset)."""
    if boundary == record.offset:
        return {n: a for n, a in record.arrays.items() if state_boundary(n)[1] is None}
    suffix = f"@{boundary}"
    found = {n[:-len(suffix)]: a for n, a in record.arrays.items() if n.endswith(suffix)}
    if not found:
        raise ValueError(f"no recurrent state stored at token {boundary}")
    return found


def split_children(record: "LayerRecord") -> list["LayerRecord"]:
    """The child records of a LIST record (their names, config and state without the prefix)."""
    n = int(record.config["children"])

    def part(d: dict, i: int) -> dict:
        prefix = f"c{i}."
        return {k[len(prefix):]: v for k, v in d.items() if k.startswith(prefix)}

    children = []
    for i in range(n):
        config, state = part(record.config, i), part(record.state, i)
        layout, offset = Layout(config.pop("layout")), int(state.pop("offset"))
        children.append(LayerRecord(layout, offset, part(record.arrays, i), config, state))
    return children


def join_children(children: list["LayerRecord"], config: dict[str, Scalar]) -> "LayerRecord":
    """A LIST record of `children` (the inverse of `split_children`)."""
    arrays, cfg, state = {}, {**config, "children": len(children)}, {}
    for i, c in enumerate(children):
        if c.calibration:
            raise ValueError("a CacheList child with calibration arrays cannot be stored")
        arrays.update({f"c{i}.{k}": v for k, v in c.arrays.items()})
        cfg.update({f"c{i}.{k}": v for k, v in c.config.items()} | {f"c{i}.layout": c.layout.value})
        state.update({f"c{i}.{k}": v for k, v in c.state.items()} | {f"c{i}.offset": c.offset})
    return LayerRecord(Layout.LIST, max((c.offset for c in children), default=0), arrays, cfg, state)


Path = int | tuple[int, ...]  # a layer index, or (layer, member, ...) for a CacheList's members at any depth


def child_path(path: Path, j: int) -> tuple[int, ...]:
    """The path of member `j` of the CacheList at `path`."""
    return (*((path,) if isinstance(path, int) else path), j)


def leaf_records(layers: list["LayerRecord"]) -> list[tuple[Path, "LayerRecord"]]:
    """Every record that is not a LIST, with its path: LIST records are opened into their
    members (as `windows.leaves` opens a model's CacheLists), at any depth."""
    out: list[tuple[Path, LayerRecord]] = []
    for i, r in enumerate(layers):
        if r.layout is Layout.LIST:
            out += [(child_path(i, p) if isinstance(p, int) else (i, *p), c) for p, c in leaf_records(split_children(r))]
        else:
            out.append((i, r))
    return out


@dataclass(frozen=True)
class FieldPlan:
    """How a model's own cache class is cut at block ends: `grows` are fields only ever appended
    to along `axis` (their rows at a block end are a prefix of the final ones, so each block holds
    the rows it added), `ends` fields a block keeps as they are at its end (small, replaced on
    every update). None-valued fields are recorded as None scalars in the record's state."""

    grows: tuple[str, ...]
    ends: tuple[str, ...]
    axis: int = 1


# Explicit registry: the model cache classes read field by field (mlx-lm 0.32's deepseek_v41:
# the compressed groups and their index keys only grow; the sliding window (its last
# `window_size` rows) and the rows of the still open group are replaced on every update).
FIELD_PLANS: dict[str, FieldPlan] = {
    "mlx_lm.models.deepseek_v41:LayerCache": FieldPlan(grows=("compress_kv", "index_k"),
                                                       ends=("window", "pending_kv", "pending_gate")),
}


def field_plan(record: "LayerRecord") -> FieldPlan | None:
    """The plan of a FIELDS record kept by block (config marked `rows` "token"), or None."""
    if record.layout is not Layout.FIELDS or record.config.get("rows") != "token":
        return None
    return FIELD_PLANS.get(str(record.config.get("class")))


def fields_at(record: "LayerRecord", boundary: int) -> tuple[dict[str, "mx.array | None"], dict[str, int]]:
    """A block-kept FIELDS record at a block end: ({end field: array or None}, {grown field:
    rows}), from its `<field>@<t>` checkpoints (its current fields at its own offset)."""
    plan = field_plan(record)
    assert plan is not None
    suffix = "" if boundary == record.offset else f"@{boundary}"
    if suffix and not all(f + suffix in record.arrays or f + suffix in record.state for f in (*plan.ends, *plan.grows)):
        raise ValueError(f"no fields stored at token {boundary}")
    ends = {f: record.arrays.get(f + suffix) for f in plan.ends}
    if suffix:
        grown = {f: int(record.state[f + suffix]) for f in plan.grows}
    else:
        grown = {f: record.arrays[f].shape[plan.axis] if f in record.arrays else 0 for f in plan.grows}
    return ends, grown


def field_boundaries(record: "LayerRecord") -> list[int]:
    """The block ends at which a FIELDS record holds its fields (`<field>@<t>` names), in order."""
    return sorted({int(n.rpartition("@")[2]) for n in (*record.arrays, *record.state) if "@" in n})


def list_config(record: "LayerRecord") -> dict[str, Scalar]:
    """A LIST record's own config, without its members' (what `join_children` is given)."""
    return {k: v for k, v in record.config.items() if k != "children" and _CHILD_NAME.fullmatch(k) is None}


def in_block_form(record: "LayerRecord", n_tokens: int) -> bool:
    """Whether a record is what a block of `n_tokens` tokens may hold for a layer: a per-token
    layer of those tokens, a recurrent state at the block's end (no earlier checkpoints), or a
    CacheList whose members are all of these, or a model's own cache class kept by block (its
    grown rows of those tokens and its other fields at the block's end: `FIELD_PLANS`)
    (docs/format.md, section 3)."""
    if record.offset != n_tokens:
        return False
    if record.layout is Layout.LIST:
        return all(in_block_form(c, n_tokens) for c in split_children(record))
    if record.layout is Layout.STATE:
        return all(state_boundary(n)[1] is None for n in record.arrays)
    if record.layout is Layout.FIELDS:
        return field_plan(record) is not None and not any("@" in n for n in (*record.arrays, *record.state))
    return record.per_token


def token_span(record: "LayerRecord", name: str) -> tuple[int, int] | None:
    """Tokens [start, end) that array `name` of `record` covers along axis 2; None for arrays
    that are not per token (ring buffers, and per-block arrays whose axis 2 counts blocks)."""
    return _span(record.layout, name, int(record.state.get("stored", 0)), record.offset)


def _span(layout: Layout, name: str, stored: int, offset: int) -> tuple[int, int] | None:
    if layout in WHOLE_LAYOUTS or name in BLOCK_ARRAYS:
        return None
    if layout in (Layout.RAW, Layout.QUANTIZED):
        return (0, offset)
    if name in TAIL_ARRAYS:
        return (stored, offset)
    return (0, stored)


def check_record_arrays(record: "LayerRecord") -> None:
    """Raise ValueError unless the record holds exactly the arrays its layout and spans need."""
    if record.layout in (Layout.STATE, Layout.LIST, Layout.FIELDS):
        _check_whole(record)
        return
    stored = int(record.state.get("stored", 0))
    if record.layout in (Layout.RAW, Layout.ROTATING, Layout.QUANTIZED, Layout.CHUNKED):
        expected = set(LAYOUT_ARRAYS[record.layout]) if record.offset or record.arrays else set()
    else:
        if not 0 <= stored <= record.offset:
            raise ValueError(f"a {record.layout.value} layer with {record.offset} tokens cannot hold {stored} "
                             "compressed")
        expected = set(LAYOUT_ARRAYS[record.layout]) if stored else set()
        if record.offset > stored:
            expected |= set(TAIL_ARRAYS)
        if "keys_shift" in record.arrays:
            expected.add("keys_shift")
    if set(record.arrays) != expected:
        raise ValueError(f"a {record.layout.value} layer with {record.offset} tokens ({stored} compressed) "
                         f"needs arrays {sorted(expected)}, got {sorted(record.arrays)}")
    for name, array in record.arrays.items():
        span = _span(record.layout, name, stored, record.offset)
        if span is not None and array.shape[TOKEN_AXIS] != span[1] - span[0]:
            raise ValueError(f"array {name} holds {array.shape[TOKEN_AXIS]} tokens, expected {span[1] - span[0]}")
    if "keys_shift" in record.arrays and record.arrays["keys_shift"].shape[TOKEN_AXIS] != -(-stored // BLOCK_TOKENS):
        raise ValueError(f"keys_shift holds {record.arrays['keys_shift'].shape[TOKEN_AXIS]} blocks, "
                         f"expected {-(-stored // BLOCK_TOKENS)}")


def _check_whole(record: "LayerRecord") -> None:
    if record.layout is Layout.STATE:
        size = int(record.config["size"])
        for name in record.arrays:
            j, t = state_boundary(name)
            if j >= size or (t is not None and not 0 < t < record.offset):
                raise ValueError(f"state array {name} does not fit a cache of {size} states and {record.offset} tokens")
    elif record.layout is Layout.LIST:
        n = int(record.config["children"])
        for name in record.arrays:
            m = _CHILD_NAME.fullmatch(name)
            if m is None or int(m.group(1)) >= n:
                raise ValueError(f"array {name} belongs to no child of a CacheList of {n}")
        for child in split_children(record):
            check_record_arrays(child)


@dataclass(frozen=True, eq=False)
class CodecRecord:
    """A TurboQuant codec's persisted arrays (centroids, boundaries, rotation) and modes."""

    rotation_kind: str
    norm_mode: str
    arrays: dict[str, mx.array]  # centroids, boundaries, and signs and/or matrix


@dataclass(frozen=True, eq=False)
class LayerRecord:
    """One layer: its layout, token count, arrays and the scalars needed to rebuild it.

    `arrays` holds the per-token arrays sliced to `offset` (token axis 2), except for
    ROTATING layers, whose ring buffers are kept whole. `config` holds the data-independent
    scalars (cache class, formats, bits, codec names, group size, head dims, dtype, ...: what
    the codec identity hashes); `state` the data-dependent scalars beyond layout and offset
    (a ring buffer's write index). `calibration` holds per-layer key calibration arrays
    ([H, D]), fitted from the first 256 tokens.
    """

    layout: Layout
    offset: int
    arrays: dict[str, mx.array]
    config: dict[str, Scalar]
    state: dict[str, Scalar] = field(default_factory=dict)
    calibration: dict[str, mx.array] = field(default_factory=dict)

    @property
    def per_token(self) -> bool:
        """Whether the arrays can be cut along the token axis (not a ring buffer, state, list)."""
        return self.layout not in WHOLE_LAYOUTS

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays.values()) + sum(a.nbytes for a in self.calibration.values())


@dataclass(frozen=True, eq=False)
class Snapshot:
    """Per-layer records and the codecs they reference by name (stored once per snapshot)."""

    layers: list[LayerRecord]
    codecs: dict[str, CodecRecord]

    @property
    def offset(self) -> int:
        """Tokens held (the largest layer offset; every layer agrees for a plain model)."""
        return max((r.offset for r in self.layers), default=0)

    @property
    def nbytes(self) -> int:
        codec_bytes = sum(a.nbytes for c in self.codecs.values() for a in c.arrays.values())
        return sum(r.nbytes for r in self.layers) + codec_bytes

    def arrays(self) -> list[mx.array]:
        """Every array, for mx.eval."""
        out = [a for r in self.layers for a in (*r.arrays.values(), *r.calibration.values())]
        return out + [a for c in self.codecs.values() for a in c.arrays.values()]
