"""The dialects the kernel texts are written over and the files the texts live in.

The kernel sources are C++ files under `src/` (package data), cut into named sections that the
Python templates fill: `sections` reads them (once), `fill` substitutes the `@@NAME@@` markers.
`src/dialect.cuh` (NVRTC) and `src/dialect.metal` (MSL) define the same macros (shuffles,
barriers, address spaces, bit casts, output conversions) and the prologues that read the thread
and threadgroup indices."""

from __future__ import annotations

import functools
import re
from importlib import resources

MARK = "@@"
SECTION = "//@@ "  # starts a named section of a kernel source file
NOTE = "//!"  # a reader's note in a kernel source file
DIALECTS = ("cuda", "metal")
SHORT = {"float16": "f16", "bfloat16": "bf16", "float32": "f32"}


def pow2ceil(n: int) -> int:
    p = 1
    while p < n:
        p *= 2
    return p


@functools.cache
def sections(filename: str) -> dict[str, str]:
    """The named sections of the kernel source file `src/<filename>`, read once.

    A line `//@@ name` starts section `name`; its text is every line up to the next such line,
    verbatim, joined by newlines (a blank line before the next marker is a trailing newline; the
    file's own final newline is not part of its last section). Lines starting with `//!` are
    notes for readers and belong to no section."""
    text = resources.files(__package__).joinpath("src", filename).read_text(encoding="utf-8")
    found: dict[str, list[str]] = {}
    lines = None
    for line in text.removesuffix("\n").split("\n"):
        if line.startswith(SECTION):
            lines = found.setdefault(line[len(SECTION):].strip(), [])
        elif lines is not None and not line.startswith(NOTE):
            lines.append(line)
    return {name: "\n".join(body) for name, body in found.items()}


def section(filename: str, name: str) -> str:
    """Section `name` of `src/<filename>` (see `sections`)."""
    return sections(filename)[name]


DIALECT_FILES = {"cuda": "dialect.cuh", "metal": "dialect.metal"}
# the macro header (guarded: a kernel's header may repeat it) and the thread-index prologue
HEADERS = {d: section(f, "header") for d, f in DIALECT_FILES.items()}
PROLOGUE = {d: section(f, "prologue") for d, f in DIALECT_FILES.items()}


def fill(text: str, **values) -> str:
    for k, v in values.items():
        text = text.replace(f"{MARK}{k}{MARK}", str(v))
    return text


def leftover_markers(text: str) -> list[str]:
    return re.findall(re.escape(MARK) + r"\w*" + re.escape(MARK) + "?", text)
