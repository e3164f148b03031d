"""Entry names: the one rule every tier and command applies to a user-chosen name."""

from __future__ import annotations

import re

from tqstore.errors import InvalidName

# ASCII only and no separators, so a name is safe as an LMDB key, an S3 key part and a file name
# on every platform; it cannot start with '.' or '-' (no hidden files, no ".." and no flag lookalikes).
MAX_NAME_LENGTH = 128
_NAME = re.compile(rf"[A-Za-z0-9][A-Za-z0-9._-]{{0,{MAX_NAME_LENGTH - 1}}}", re.ASCII)

NAME_RULE = (
    f"1 to {MAX_NAME_LENGTH} ASCII characters from A-Z a-z 0-9 . _ -, starting with a letter or a digit"
)


def is_valid_name(name: object) -> bool:
    """Whether `name` follows the rule (for filtering listings; `validate_name` to refuse)."""
    return isinstance(name, str) and _NAME.fullmatch(name) is not None


def validate_name(name: object) -> str:
    """Return `name` unchanged if it is a valid entry name; raise InvalidName otherwise.

    The message repeats the rule, so a user can fix the name without reading the docs.
    """
    if not isinstance(name, str):
        raise InvalidName(f"entry names are strings, not {type(name).__name__}: use {NAME_RULE}")
    if not is_valid_name(name):
        shown = name if len(name) <= 40 else name[:40] + "..."
        raise InvalidName(f"invalid entry name {shown!r}: use {NAME_RULE}")
    return name
