"""Sizes and durations as people write them: the one grammar for settings, flags and messages.

Sizes (`parse_size`): a whole number of bytes, given as a non-negative int or as text "N" or
"N UNIT" where N may have a fraction and UNIT is B, KB, MB, GB, TB (powers of 1000) or KiB, MiB,
GiB, TiB (powers of 1024), in any letter case, with spaces around. The result must be a whole
number of bytes ("1.5KiB" is 1536; "0.5" is refused rather than rounded to 0). Zero is allowed;
callers that need more check their own range. Single-letter units ("5M") are refused: they are
ambiguous between the two families.

Durations (`parse_duration`): seconds, given as a non-negative int or float, or as text "N" or
"N UNIT" where N may have a fraction and UNIT is s, m, h, d or w (any case). Zero is refused
unless the caller gives it a meaning (`allow_zero`, e.g. "never expire"), and so is anything
over 100 years (`MAX_DURATION`): an expiry that far out overflows the clock's timestamps.

Numbers (`parse_number`): a finite decimal within the caller's range (a temperature, a top-p);
nan, inf and values outside the range are refused. Whole numbers (`parse_integer`): digits only,
within the caller's range (a seed, a token count).

Anything else (negative numbers, booleans, None, other units, empty text) raises ConfigError
naming `where` (the file key, variable or flag the value came from), the value and the grammar.
`format_size` writes sizes back for people; `flag_type` makes any of the parsers an argparse `type`.
"""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Callable
from typing import TypeVar

from tqstore.errors import ConfigError

T = TypeVar("T")

KiB, MiB, GiB, TiB = 1 << 10, 1 << 20, 1 << 30, 1 << 40

_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*")
_SIZE_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": KiB, "mib": MiB, "gib": GiB, "tib": TiB,
}
SIZE_HELP = "bytes, or a number with a unit (B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), e.g. 512MiB"

_DURATION = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]?)\s*")
_DURATION_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
DURATION_HELP = "seconds, or a number with s, m, h, d or w (e.g. 90, 30m, 12h, 7d)"
MAX_DURATION = 100 * 365.25 * 86400  # seconds; now + this stays a valid timestamp everywhere


def parse_size(raw: object, where: str = "size") -> int:
    """Bytes from 4096, "10GB" (decimal) or "512MiB" (binary); ConfigError otherwise."""
    if isinstance(raw, int) and not isinstance(raw, bool):
        if raw < 0:
            raise ConfigError(f"{where}={raw!r} is negative: use {SIZE_HELP}")
        return raw
    if isinstance(raw, str):
        m = _SIZE.fullmatch(raw)
        if m and m.group(2).lower() in _SIZE_UNITS:
            exact = float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()]
            if exact != int(exact):  # "0.5" would silently become 0 bytes
                raise ConfigError(f"{where}={raw!r} is not a whole number of bytes: use {SIZE_HELP}")
            return int(exact)
    raise ConfigError(f"{where}={raw!r} is not a size: use {SIZE_HELP}")


def parse_duration(raw: object, where: str = "duration", allow_zero: bool = False) -> float:
    """Seconds from 90, "90s", "30m", "12h", "7d" or "1w"; ConfigError otherwise (and for zero,
    unless `allow_zero`)."""
    text = str(raw) if isinstance(raw, (int, float)) and not isinstance(raw, bool) else raw
    m = _DURATION.fullmatch(text) if isinstance(text, str) else None
    if not m or m.group(2).lower() not in _DURATION_UNITS:
        raise ConfigError(f"{where}={raw!r} is not a duration: use {DURATION_HELP}")
    value = float(m.group(1)) * _DURATION_UNITS[m.group(2).lower()]
    if value == 0 and not allow_zero:
        raise ConfigError(f"{where}={raw!r} must be positive: use {DURATION_HELP}")
    if not value <= MAX_DURATION:  # also inf, from a number with hundreds of digits
        raise ConfigError(f"{where}={raw!r} is over 100 years: use {DURATION_HELP}")
    return value


def parse_number(raw: object, where: str = "number", low: float = 0.0, high: float | None = None,
                 above: bool = False) -> float:
    """A finite number from `low` (excluded when `above`) up to `high` (if any); ConfigError
    otherwise, nan and inf included."""
    try:
        value = float(raw) if isinstance(raw, (int, float, str)) and not isinstance(raw, bool) else math.nan
    except ValueError:
        value = math.nan
    lowest = f"above {low:g}" if above else f"from {low:g}"
    grammar = f"a number {lowest}" + (f" up to {high:g}" if high is not None else "")
    if not math.isfinite(value) or value < low or (above and value == low) or (high is not None and value > high):
        raise ConfigError(f"{where}={raw!r} is out of range: use {grammar}")
    return value


def parse_integer(raw: object, where: str = "count", low: int = 0, high: int | None = None) -> int:
    """A whole number from `low` up to `high` (if any); ConfigError otherwise."""
    text = str(raw).strip() if isinstance(raw, (int, str)) and not isinstance(raw, bool) else ""
    grammar = f"a whole number from {low}" + (f" up to {high}" if high is not None else "")
    if not re.fullmatch(r"[+-]?\d+", text) or not low <= int(text) <= (int(text) if high is None else high):
        raise ConfigError(f"{where}={raw!r} is out of range: use {grammar}")
    return int(text)


def flag_type(parse: Callable[..., T], where: str, **options: object) -> Callable[[str], T]:
    """An argparse `type` that runs `parse(text, where, **options)` and turns its ConfigError
    into argparse's error, so a bad flag value is a usage error (exit 2) with the grammar."""
    def convert(text: str) -> T:
        try:
            return parse(text, where, **options)
        except ConfigError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return convert


def format_size(n: int) -> str:
    """Bytes for messages: "5 MiB" when exact, else one decimal ("12.3 GiB")."""
    for unit, size in (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= size:
            return f"{n // size} {unit}" if n % size == 0 else f"{n / size:.1f} {unit}"
    return f"{n} B"

