"""The scheme grammar: a name such as `turbo8v3` -> a typed, canonical SchemeSpec.

    raw                 native K and V (the dtype the model produces, never cast)
    affine8, affine4    MLX affine K and V (QuantizedKVCache-compatible)
    turbo0vN            native K, TurboQuant V at N bits          (N in 2..4)
    turbo8vN            8-bit affine K, TurboQuant V at N bits
    turboN              TurboQuant K and V at N bits, keys calibrated
    turboKvN            TurboQuant K at K bits and V at N bits (turbo4v4 is turbo4)
    turbo5vN            TurboQuant K at 5 bits and V at N bits, row norms in float16, and the
                        layers the guard protects get 8-bit affine keys only (turbo5v4 is the
                        default: docs/quality.md)
    autoB               a bit budget of B stored bits per K/V value (B in AUTO_BUDGETS; any B from
                        AUTO_MIN to AUTO_MAX parses): TurboQuant K and V with float16 row norms,
                        and wider keys (4 or 5 bits, 8-bit affine) in the layers where
                        measurements at compression say they matter most, as many as the budget
                        pays for; under 4.5 bits each layer's value width (2 to 4 bits) is
                        chosen with its keys (turboquant/cache/allocation.py)
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass

from turboquant.codec.affine import UnsupportedHeadDim, affine_group_size
from turboquant.codec.packing import packed_width

TURBO_BITS = (2, 3, 4)
WIDE_KEY_BITS = 5  # turbo5vN: keys one bit wider than any turbo value side
HALF_NORMS = "float16"
AUTO_BUDGETS = (4, 5, 6)  # auto4, auto5, auto6; any budget in [AUTO_MIN, AUTO_MAX] parses
AUTO_MIN, AUTO_MAX = 3.5, 9.0
NORM_BYTES = 4  # one float32 norm per TurboQuant row


class Format(str, enum.Enum):
    """How one side (K or V) of a layer is stored."""

    NATIVE = "native"
    AFFINE = "affine"
    TURBO = "turbo"


def side_bytes(side: Format, bits: int, d: int, dtype_bytes: int, norm_bytes: int = NORM_BYTES) -> int:
    """Bytes per token per KV head of one side (K or V) at head dim d, scales and norms included."""
    if side is Format.NATIVE:
        return d * dtype_bytes
    if side is Format.AFFINE:
        return d * bits // 8 + 2 * (d // affine_group_size(d)) * dtype_bytes
    return 4 * packed_width(d, bits) + norm_bytes


@dataclass(frozen=True)
class SchemeSpec:
    """A parsed scheme. `name` is canonical and is what identities hash."""

    name: str
    key_format: Format
    value_format: Format
    key_bits: int  # 0 for native keys
    value_bits: int  # 0 for native values
    budget: float | None = None  # autoB: stored bits per K/V value the allocation may spend
    norm_dtype: str | None = None  # TurboQuant row norms: None is float32; "float16" halves their cost
    protect_values: bool = True  # the guard stores protected layers' values as affine8 too (else keys only)

    @property
    def norm_bytes(self) -> int:
        return NORM_BYTES if self.norm_dtype is None else 2

    @property
    def calibrated(self) -> bool:
        """TurboQuant keys are always calibrated (per-dimension scales from the prefill)."""
        return self.key_format is Format.TURBO

    @property
    def fragile(self) -> bool:
        """Boundary-layer protection applies: TurboQuant keys, or 2-bit TurboQuant values."""
        return self.key_format is Format.TURBO or (self.value_format is Format.TURBO and self.value_bits <= 2)

    @property
    def compressed(self) -> bool:
        return self.name != "raw"

    @property
    def uses_affine(self) -> bool:
        return Format.AFFINE in (self.key_format, self.value_format)

    def bytes_per_token(self, d: int, dtype_bytes: int = 2) -> int:
        """K + V bytes per token per KV head; layers no affine group size fits stay native."""
        try:
            return (side_bytes(self.key_format, self.key_bits, d, dtype_bytes, self.norm_bytes)
                    + side_bytes(self.value_format, self.value_bits, d, dtype_bytes, self.norm_bytes))
        except UnsupportedHeadDim:
            return 2 * d * dtype_bytes

    def compression(self, d: int, dtype_bytes: int = 2) -> float:
        """Compression against an fp16 cache (always fp16, whatever the model's dtype)."""
        return (2 * d * 2) / self.bytes_per_token(d, dtype_bytes)


def _spec(name: str, kf: Format, vf: Format, kb: int, vb: int) -> SchemeSpec:
    return SchemeSpec(name=name, key_format=kf, value_format=vf, key_bits=kb, value_bits=vb)


def auto_spec(budget: float) -> SchemeSpec:
    """The autoB scheme: its base layout is what every layer gets before the allocation spends
    the rest of the budget on wider keys. With float16 norms and key means, K4 V4 costs 4.31
    bits per value, K4 V3 3.81, K3 V3 3.31: 4-bit values from 4.5 bits up, 4-bit keys from 3.9
    (3-bit keys below, which the allocation raises where they matter most)."""
    if not AUTO_MIN <= budget <= AUTO_MAX:
        raise ValueError(f"an auto scheme's budget is {AUTO_MIN:g} to {AUTO_MAX:g} bits per value, got {budget:g}")
    value_bits = 4 if budget >= 4.5 else 3
    key_bits = 4 if budget >= 3.9 else 3
    return SchemeSpec(name=f"auto{budget:g}", key_format=Format.TURBO, value_format=Format.TURBO, key_bits=key_bits,
                      value_bits=value_bits, budget=float(budget), norm_dtype=HALF_NORMS)


def _build_table() -> dict[str, SchemeSpec]:
    table = {"raw": _spec("raw", Format.NATIVE, Format.NATIVE, 0, 0)}
    for b in (8, 4):
        table[f"affine{b}"] = _spec(f"affine{b}", Format.AFFINE, Format.AFFINE, b, b)
    for k, kf in ((0, Format.NATIVE), (8, Format.AFFINE)):
        for v in reversed(TURBO_BITS):
            table[f"turbo{k}v{v}"] = _spec(f"turbo{k}v{v}", kf, Format.TURBO, k, v)
    for b in reversed(TURBO_BITS):
        table[f"turbo{b}"] = _spec(f"turbo{b}", Format.TURBO, Format.TURBO, b, b)
    for k in reversed(TURBO_BITS):
        for v in reversed(TURBO_BITS):
            if k != v:
                table[f"turbo{k}v{v}"] = _spec(f"turbo{k}v{v}", Format.TURBO, Format.TURBO, k, v)
    for v in reversed(TURBO_BITS):
        table[f"turbo{WIDE_KEY_BITS}v{v}"] = SchemeSpec(
            name=f"turbo{WIDE_KEY_BITS}v{v}", key_format=Format.TURBO, value_format=Format.TURBO,
            key_bits=WIDE_KEY_BITS, value_bits=v, norm_dtype=HALF_NORMS, protect_values=False)
    for b in AUTO_BUDGETS:
        table[f"auto{b}"] = auto_spec(b)
    return table


SCHEMES: dict[str, SchemeSpec] = _build_table()
_ALIAS = re.compile(r"turbo([234])v\1")
_AUTO = re.compile(r"auto(\d+(?:\.\d+)?)")


def parse_scheme(name: str) -> SchemeSpec:
    """Parse a scheme name (case-insensitive); raises ValueError listing the valid names."""
    if not isinstance(name, str):
        raise ValueError(f"a scheme name is a string, got {type(name).__name__}")
    key = name.strip().lower()
    alias = _ALIAS.fullmatch(key)
    if alias:
        key = f"turbo{alias.group(1)}"
    auto = _AUTO.fullmatch(key)
    if auto and key not in SCHEMES:
        return auto_spec(float(auto.group(1)))
    try:
        return SCHEMES[key]
    except KeyError:
        raise ValueError(f"unknown scheme {name!r}; valid schemes: {', '.join(SCHEMES)}") from None
