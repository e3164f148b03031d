"""The progress callback shared by the installer's stages; the library itself never prints."""

from __future__ import annotations

from collections.abc import Callable

ProgressFn = Callable[[str, int, int], None]
"""``progress(stage, done, total)``; stages: download, assemble, convert, publish."""


def report(progress: ProgressFn | None, stage: str, done: int, total: int) -> None:
    """Call ``progress`` if there is one."""
    if progress is not None:
        progress(stage, done, total)
