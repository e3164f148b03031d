"""LayerPlan: the data-independent configuration of one compressed layer.

A plan is fixed when the cache is made (head dims and dtype come from a one-token probe of
the model) and is what the codec identity hashes: formats, bits, codecs, group sizes, the
calibration recipe and boundary protection. Data-dependent choices (whether calibration came
out flat) live in the cache and its snapshot, not here.
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass, field, replace
from typing import Any

import mlx.core as mx

from turboquant.codec.affine import AffineCodec, UnsupportedHeadDim
from turboquant.codec.calibration import CalibrationConfig
from turboquant.codec.codebook import MIN_DIM
from turboquant.codec.turbo import NormMode, TurboCodec
from turboquant.codec.rotation import Rotation
from turboquant.codec.schemes import NORM_BYTES, Format, SchemeSpec, side_bytes
from turboquant.codec.sides import AffineSide, NativeSide, TurboSide
from turboquant.memo import once
from turboquant.records import CodecRecord, Scalar

PROTECTED_BITS = 8
# An auto scheme's key options per layer (LayerPlan.key_options), as recorded in snapshots.
BASE_KEYS, TURBO4_KEYS, TURBO5_KEYS, AFFINE8_KEYS = "base", "keys4", "keys5", "keys8"
TURBO_KEY_OPTIONS = {TURBO4_KEYS: 4, TURBO5_KEYS: 5}
# Below 4-bit values (auto budgets under 4.5 bits) the allocation chooses each layer's value
# width too: an option is then "<key option>+values<b>" ("keys4+values2"); a bare key option
# keeps the base's values, so every recorded option of an older entry reads as before.
VALUE_OPTION_BITS = (2, 3, 4)
VALUES_PREFIX = "values"
# Measured on Qwen2.5-Coder-0.5B (docs/quality.md): all three parts together are best.
DEFAULT_CALIBRATION = CalibrationConfig(center=True, channel_scale=True, rotated_scale=True)
# Noise gain (calibration.noise_gain) above which a TurboQuant-key layer is stored as affine8
# instead. It does not depend on the bit width, so a scheme protects the same few outlier layers
# at 2 bits as at 4. On Qwen2.5-Coder-0.5B it picks layers 0 and 8 (gains 4.6 and 4.1, the rest
# <= 3.2), the two layers the per-layer diagnosis blames most.
DEFAULT_GUARD = 3.6


@functools.lru_cache(maxsize=None)
def shared_codec(d: int, bits: int, seed: int, norm_mode: NormMode = NormMode.RAW) -> TurboCodec:
    """One codec per (d, bits, seed, norm mode), shared by every layer (an explicit registry)."""
    return TurboCodec(d, bits, seed, norm_mode)


def codec_name(codec: TurboCodec, seed: int) -> str:
    return f"turbo-d{codec.d}-b{codec.bits}-s{seed}-{codec.norm_mode.value}"


def codec_record(codec: TurboCodec) -> CodecRecord:
    arrays = {"centroids": codec.centroids, "boundaries": codec.boundaries, **codec.rotation.arrays()}
    return CodecRecord(rotation_kind=codec.rotation.kind.value, norm_mode=codec.norm_mode.value, arrays=arrays)


# The codec rebuilt from each persisted record, for as long as the record lives (an explicit
# registry). The memory tier keeps an entry's codec records, so every restore from it, and every
# layer of one restore, gets the same codec object, and the kernels' tables made from a codec
# (rotation matrices, padded codebooks; attention/kernels/host.py) are made once, not again by
# each layer of each restore (a question's forward on the GPU paid their launches every time).
_FROM_RECORD: weakref.WeakKeyDictionary[CodecRecord, TurboCodec] = weakref.WeakKeyDictionary()


# Plans rebuilt from persisted scalars, by those scalars, beside the codec records they were
# built with. Every restore rebuilt every layer's plan (about 10 us a layer here); a restore
# from memory hands its layers the same records each time (the memory tier keeps them), so its
# plans are built once per entry. Plans are frozen, and a restored plan has no allocation group.
FROM_META_KEPT = 512
_FROM_META: dict[tuple, tuple[tuple, "LayerPlan"]] = {}


def codec_from_record(record: CodecRecord) -> TurboCodec:
    """The codec a persisted record describes (one object per record; nothing regenerated)."""
    codec = _FROM_RECORD.get(record)
    if codec is None:
        a = record.arrays
        rotation = Rotation.from_arrays(record.rotation_kind, a.get("signs"), a.get("matrix"))
        codec = _FROM_RECORD[record] = TurboCodec.from_arrays(a["centroids"], a["boundaries"], rotation,
                                                              record.norm_mode)
    return codec


@dataclass(frozen=True, eq=False)
class SidePlan:
    """How one side (K or V) is stored."""

    format: Format
    bits: int = 0
    turbo: TurboCodec | None = None
    turbo_name: str | None = None
    affine: AffineCodec | None = None
    norm_dtype: str | None = None  # TurboQuant row norms stored at this width (float32 when None)

    def side(self, name: str, calibration=None):
        """The side object that encodes and attends for this plan."""
        if self.format is Format.NATIVE:
            return NativeSide(name)
        if self.format is Format.AFFINE:
            return AffineSide(name, self.affine, calibration)
        return TurboSide(name, self.turbo, calibration, self.norm_dtype)

    @property
    def norm_bytes(self) -> int:
        return NORM_BYTES if self.norm_dtype is None else mx.finfo(getattr(mx, self.norm_dtype)).bits // 8

    def meta(self, prefix: str) -> dict[str, Scalar]:
        # Only sides with narrower norms carry the key, so every older scheme's identity is unchanged.
        return {f"{prefix}_format": self.format.value, f"{prefix}_bits": self.bits,
                f"{prefix}_codec": self.turbo_name,
                f"{prefix}_group_size": self.affine.group_size if self.affine else None,
                **({} if self.norm_dtype is None else {f"{prefix}_norms": self.norm_dtype})}


@dataclass(frozen=True, eq=False)
class LayerPlan:
    """Everything needed to build, persist and rebuild one compressed layer."""

    scheme: str
    key: SidePlan
    value: SidePlan
    n_kv_heads: int
    head_dim_k: int
    head_dim_v: int
    dtype: str
    seed: int = 0
    calibration: CalibrationConfig = DEFAULT_CALIBRATION
    protected: bool = False  # a boundary layer under position-based protection: affine8 from the start
    guard: float | None = None  # statistics-chosen protection: see DEFAULT_GUARD
    boundary: bool = False  # what the guard falls back to when no queries were observed
    budget: float | None = None  # autoB schemes: bits per value the allocation spends (allocation.py)
    protect_values: bool = True  # protection stores the values as affine8 too (else the keys only)
    # The layers of one model that share the budget (an allocation.AllocationGroup); runtime
    # only: restored layers carry their decision in their record instead.
    group: Any = field(default=None, compare=False, repr=False)

    @property
    def calibrated(self) -> bool:
        return self.key.format is not Format.NATIVE and self.calibration.enabled

    def protected_plan(self) -> "LayerPlan":
        """This layer stored as affine8 K and V (keys calibrated in the original basis only); with
        `protect_values` off, affine8 keys and the values as planned."""
        key = SidePlan(Format.AFFINE, PROTECTED_BITS, affine=AffineCodec.for_dim(self.head_dim_k, PROTECTED_BITS))
        value = (SidePlan(Format.AFFINE, PROTECTED_BITS, affine=AffineCodec.for_dim(self.head_dim_v, PROTECTED_BITS))
                 if self.protect_values else self.value)
        return replace(self, key=key, value=value, calibration=replace(self.calibration, rotated_scale=False),
                       protected=True, guard=None)

    def key_options(self) -> tuple[str, ...]:
        """The key layouts an auto scheme's allocation may give this layer, cheapest first:
        the base, TurboQuant keys at each width above the base's (4, and 5 when norms are
        narrow), 8-bit affine keys."""
        wider = [o for o, b in TURBO_KEY_OPTIONS.items()
                 if b > self.key.bits and (b < 5 or self.key.norm_dtype is not None)]
        return (BASE_KEYS, *wider, *((AFFINE8_KEYS,) if self._affine_keys_fit else ()))

    @property
    def _affine_keys_fit(self) -> bool:
        """Whether 8-bit affine keys have a group size at this head dim (80 has none)."""
        try:
            AffineCodec.for_dim(self.head_dim_k, PROTECTED_BITS)
        except UnsupportedHeadDim:
            return False
        return True

    def layout_options(self) -> tuple[str, ...]:
        """Every layout an auto scheme's allocation may give this layer: the key options, each
        with every value width when the base's TurboQuant values are narrower than 4 bits (auto
        budgets under 4.5), else with the base's values."""
        if self.value.format is not Format.TURBO or self.value.bits >= max(VALUE_OPTION_BITS):
            return self.key_options()
        return tuple(k if b == self.value.bits else f"{k}+{VALUES_PREFIX}{b}"
                     for k in self.key_options() for b in VALUE_OPTION_BITS)

    def with_layout(self, option: str, codecs: dict[str, CodecRecord] | None = None) -> "LayerPlan":
        """This layer with the keys and values of `option` (layout_options, or a bare key option);
        `codecs` (a restore) supplies the TurboQuant codecs as persisted."""
        keys, _, values = option.partition("+")
        plan = self.with_keys(keys, codecs)
        if not values:
            return plan
        if not values.startswith(VALUES_PREFIX) or not values[len(VALUES_PREFIX):].isdigit():
            raise ValueError(f"unknown value option {values!r}")
        bits = int(values[len(VALUES_PREFIX):])
        if bits not in VALUE_OPTION_BITS or self.value.format is not Format.TURBO:
            raise ValueError(f"value option {values!r} needs TurboQuant values at {VALUE_OPTION_BITS} bits")
        value = _side_plan(Format.TURBO, bits, self.head_dim_v, self.seed + 1, self.value.norm_dtype)
        return replace(plan, value=_persisted(value, codecs), guard=None, group=None)

    def with_keys(self, option: str, codecs: dict[str, CodecRecord] | None = None) -> "LayerPlan":
        """This layer with the keys of `option` (key_options) and its values unchanged; 8-bit
        affine keys are calibrated in the original basis, as turbo8vN's. `codecs` (a restore)
        supplies the TurboQuant key codec as persisted."""
        if option == BASE_KEYS:
            return self
        if option == AFFINE8_KEYS:
            key = SidePlan(Format.AFFINE, PROTECTED_BITS, affine=AffineCodec.for_dim(self.head_dim_k, PROTECTED_BITS))
            return replace(self, key=key, calibration=replace(self.calibration, rotated_scale=False), guard=None,
                           group=None)
        if option in TURBO_KEY_OPTIONS:
            key = _side_plan(Format.TURBO, TURBO_KEY_OPTIONS[option], self.head_dim_k, self.seed, self.key.norm_dtype)
            return replace(self, key=_persisted(key, codecs), guard=None, group=None)
        raise ValueError(f"unknown key option {option!r}")

    @property
    def can_protect(self) -> bool:
        try:
            self.protected_plan()
        except UnsupportedHeadDim:
            return False
        return True

    def meta(self) -> dict[str, Scalar]:
        """Data-independent scalars for the snapshot's layer config (hashed by the codec identity)."""
        return {
            "class": "TurboQuantKVCache", "scheme": self.scheme, "seed": self.seed,
            "n_kv_heads": self.n_kv_heads, "head_dim_k": self.head_dim_k, "head_dim_v": self.head_dim_v,
            "dtype": self.dtype, "protected": self.protected, "guard": self.guard, "boundary": self.boundary,
            "calibration_center": self.calibrated and self.calibration.center,
            "calibration_channel_scale": self.calibrated and self.calibration.channel_scale,
            "calibration_rotated_scale": self.calibrated and self.calibration.rotated_scale,
            **self.key.meta("key"), **self.value.meta("value"),
            # Only auto schemes carry it, so every other scheme's identity is unchanged.
            **({} if self.budget is None else {"budget": self.budget}),
            **({} if self.protect_values else {"protect_values": False}),
        }

    def bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """K + V bytes per token over all KV heads of this layer at the given activation width."""
        k = side_bytes(self.key.format, self.key.bits, self.head_dim_k, dtype_bytes, self.key.norm_bytes)
        v = side_bytes(self.value.format, self.value.bits, self.head_dim_v, dtype_bytes, self.value.norm_bytes)
        return self.n_kv_heads * (k + v)

    def codecs(self) -> dict[str, CodecRecord]:
        """The TurboQuant codecs this layer references, by name (with an auto scheme's, those
        its allocation may choose too)."""
        sides = [self.key, self.value]
        if self.budget is not None:
            for option in self.layout_options():
                plan = self.with_layout(option)
                sides += [plan.key, plan.value]
        return {s.turbo_name: codec_record(s.turbo) for s in sides if s.turbo is not None}

    @classmethod
    def from_meta(cls, meta: dict[str, Scalar], codecs: dict[str, CodecRecord]) -> "LayerPlan":
        """Rebuild a plan from persisted scalars and codec arrays (nothing regenerated); one
        object per scalars and codec records (`_FROM_META`)."""
        records = tuple(codecs.get(meta.get(f"{prefix}_codec")) for prefix in ("key", "value"))
        return once(_FROM_META, tuple(meta.items()), records, FROM_META_KEPT, cls._from_meta, meta, codecs)

    @classmethod
    def _from_meta(cls, meta: dict[str, Scalar], codecs: dict[str, CodecRecord]) -> "LayerPlan":
        def side(prefix: str) -> SidePlan:
            fmt = Format(meta[f"{prefix}_format"])
            bits = int(meta[f"{prefix}_bits"])
            if fmt is Format.TURBO:
                name = meta[f"{prefix}_codec"]
                if name not in codecs:
                    raise ValueError(f"layer references codec {name!r}, which the snapshot lacks")
                norms = meta.get(f"{prefix}_norms")
                return SidePlan(fmt, bits, turbo=codec_from_record(codecs[name]), turbo_name=name,
                                norm_dtype=None if norms is None else _norm_dtype(str(norms)))
            if fmt is Format.AFFINE:
                return SidePlan(fmt, bits, affine=AffineCodec(bits, int(meta[f"{prefix}_group_size"])))
            return SidePlan(fmt)

        calibration = CalibrationConfig(bool(meta["calibration_center"]), bool(meta["calibration_channel_scale"]),
                                        bool(meta["calibration_rotated_scale"]))
        return cls(scheme=str(meta["scheme"]), key=side("key"), value=side("value"),
                   n_kv_heads=int(meta["n_kv_heads"]), head_dim_k=int(meta["head_dim_k"]),
                   head_dim_v=int(meta["head_dim_v"]), dtype=str(meta["dtype"]), seed=int(meta["seed"]),
                   calibration=calibration, protected=bool(meta["protected"]),
                   guard=None if meta["guard"] is None else float(meta["guard"]), boundary=bool(meta["boundary"]),
                   budget=None if meta.get("budget") is None else float(meta["budget"]),
                   protect_values=bool(meta.get("protect_values", True)))


NORM_DTYPES = ("float16",)  # narrower norm widths a plan may name (float32 is the default)


def _norm_dtype(name: str) -> str:
    if name not in NORM_DTYPES:
        raise ValueError(f"unknown norm dtype {name!r}; known: float32 (default), {', '.join(NORM_DTYPES)}")
    return name


def _persisted(side: SidePlan, codecs: dict[str, CodecRecord] | None) -> SidePlan:
    """A TurboQuant side with its codec as a snapshot persisted it (unchanged without `codecs`)."""
    if codecs is None:
        return side
    if side.turbo_name not in codecs:
        raise ValueError(f"layer references codec {side.turbo_name!r}, which the snapshot lacks")
    return replace(side, turbo=codec_from_record(codecs[side.turbo_name]))


def _side_plan(fmt: Format, bits: int, d: int, seed: int, norm_dtype: str | None = None) -> SidePlan:
    if fmt is Format.TURBO:
        if d < MIN_DIM:  # the Lloyd-Max codebook needs d >= 16 (tiny configs have smaller heads)
            raise UnsupportedHeadDim(f"head dim {d} is below the TurboQuant minimum {MIN_DIM}; such layers stay native")
        codec = shared_codec(d, bits, seed)
        return SidePlan(fmt, bits, turbo=codec, turbo_name=codec_name(codec, seed),
                        norm_dtype=None if norm_dtype is None else _norm_dtype(norm_dtype))
    if fmt is Format.AFFINE:
        return SidePlan(fmt, bits, affine=AffineCodec.for_dim(d, bits))
    return SidePlan(Format.NATIVE)


def plan_layer(
    spec: SchemeSpec,
    n_kv_heads: int,
    head_dim_k: int,
    head_dim_v: int,
    dtype: mx.Dtype,
    *,
    seed: int = 0,
    protected: bool = False,
    calibration: CalibrationConfig = DEFAULT_CALIBRATION,
    calibrate_affine_keys: bool = True,
    guard: float | None = None,
    boundary: bool = False,
    group: Any = None,
) -> LayerPlan | None:
    """The plan of one attention layer under `spec`, or None when the layer stays native.

    A layer stays native for the raw scheme, when an affine side is needed but no MLX group
    size divides the head dim (turbo8vN and affine schemes at d = 80), and when a TurboQuant
    side's head dim is below 16. TurboQuant keys
    use `calibration`; the affine keys of turbo8vN schemes and of protected layers use its
    original-basis part when `calibrate_affine_keys`; affine schemes stay plain
    (QuantizedKVCache-compatible). `guard` enables statistics-chosen protection for
    TurboQuant-key layers (decided at compression; `boundary` is its fallback). Auto schemes
    (a budget) take no guard: their allocation, shared through `group`, decides at compression
    which layers get 8-bit keys.
    """
    if not spec.compressed and not protected:
        return None
    formats = (spec.key_format, spec.key_bits, spec.value_format, spec.value_bits)
    if protected:
        formats = (Format.AFFINE, PROTECTED_BITS, Format.AFFINE, PROTECTED_BITS)
    kf, kb, vf, vb = formats
    if kf is Format.AFFINE:
        plain = spec.key_format is Format.AFFINE and spec.value_format is Format.AFFINE and not protected
        calibration = (CalibrationConfig(False, False, False) if plain or not calibrate_affine_keys
                       else replace(calibration, rotated_scale=False))
    try:
        key = _side_plan(kf, kb, head_dim_k, seed, spec.norm_dtype)
        value = _side_plan(vf, vb, head_dim_v, seed + 1, spec.norm_dtype)
    except UnsupportedHeadDim:
        return None
    plan = LayerPlan(scheme=spec.name, key=key, value=value, n_kv_heads=n_kv_heads, head_dim_k=head_dim_k,
                     head_dim_v=head_dim_v, dtype=dtype_name(dtype), seed=seed, calibration=calibration,
                     protected=protected, protect_values=spec.protect_values)
    # Where no affine group fits (head dim 80) the budget still buys wider TurboQuant keys: it was
    # dropped, and autoB ran as its base scheme.
    if spec.budget is not None and not protected and kf is Format.TURBO:
        return replace(plan, budget=spec.budget, group=group)
    if guard is not None and kf is Format.TURBO and plan.can_protect:
        plan = replace(plan, guard=guard, boundary=boundary)
    return plan


def dtype_name(dtype: mx.Dtype) -> str:
    """'float16', 'bfloat16', ... for an MLX dtype."""
    return str(dtype).rsplit(".", 1)[-1]
