"""Argument values shared by several commands: durations, KEY=VALUE pairs, schemes, documents."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tqstore.errors import BadInput, NotFound
from tqstore.units import flag_type, parse_duration

# argparse type: "90", "90s", "10m", "2h", "7d" or "1w" -> seconds (zero refused).
duration = flag_type(parse_duration, "duration")


# Metadata namespaces tqstore writes itself (the quality receipt, a chat turn's parent, the
# server's marks): a user's key there was dropped from view, or could pose as a receipt.
RESERVED_META = ("quality.", "chat.", "tqstore.")


def key_value(text: str) -> tuple[str, str]:
    """argparse type: "key=value" -> (key, value), keys outside tqstore's own namespaces."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE")
    if key.strip().startswith(RESERVED_META):
        raise argparse.ArgumentTypeError(f"{key.strip()!r}: keys starting with {', '.join(RESERVED_META)} are "
                                         "tqstore's own (the receipt shows as quality in info)")
    return key.strip(), value


def scheme_name(name: str | None) -> str | None:
    """The canonical name of a --scheme value (None: not given); BadInput listing the valid ones
    otherwise (exit 1, not a usage error: the list is the help)."""
    from turboquant import parse_scheme

    if name is None:
        return None
    try:
        return parse_scheme(name).name
    except ValueError as exc:
        raise BadInput(f"{exc} (docs/quality.md compares them)") from None


def read_text(path: str) -> str:
    """A UTF-8 text file ("-": stdin) with messages that say what is wrong."""
    if path == "-":
        return sys.stdin.read()
    file = Path(path).expanduser()
    if not file.exists():
        raise NotFound(f"no such file: {path}")
    if file.is_dir():
        raise BadInput(f"{path} is a folder: pass a text file")
    try:  # newline="": the file's text as it is (CRLF kept), as stdin and --prompt give it
        with open(file, encoding="utf-8", newline="") as f:
            return f.read()
    except UnicodeDecodeError:
        raise BadInput(f"{path} is not UTF-8 text: convert it first (e.g. iconv -t UTF-8)") from None


def document(file: str | None, prompt: str | None, what: str = "document") -> str:
    """The text given by --file PATH, --prompt TEXT, or piped on stdin."""
    if prompt is not None:
        return prompt
    if file is not None:
        return read_text(file)
    if sys.stdin is None or sys.stdin.isatty():
        raise BadInput(f"no {what}: pass --file PATH or --prompt TEXT, or pipe it on stdin")
    return sys.stdin.read()
