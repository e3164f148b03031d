"""A CUDA kernel's header and body handed to MLX as `#include` lines of files on disk.

MLX 0.32.4 assembles a custom kernel's whole source on every call and names the kernel's module
by a hash of it, so each launch costs the host time in proportion to the source's length, long
after the kernel is compiled (`bench/kernel_source_cost.py`; pass 1's tensor-core variant is
about 27 KB). So the texts are written once into files named by their SHA-256 under MLX's
cache folder, and MLX gets a few lines that include them by absolute path. The digests in the
paths keep the module name, a hash of those lines, tied to the code it compiles: a changed
kernel includes another file and never meets an old module.

MLX passes an input's shape, strides or ndim only where the body names `NAME_shape` and the
like, so the short body names the ones the kernel's body reads in a comment. Wherever the files
cannot be written, MLX gets the texts themselves, as before.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from turboquant.attention.kernels import cubin_cache

SUFFIXES = ("_shape", "_strides", "_ndim")


@dataclass(frozen=True)
class Included:
    """The texts MLX gets (`header`, `body`) and the files they include: (path, text) pairs."""

    header: str
    body: str
    files: tuple[tuple[Path, str], ...] = ()

    def ensure(self) -> None:
        """Write back any included file that went missing or changed since (a cleaned temporary
        folder, a damaged disk): MLX reads them at its compile, which may come later."""
        for path, text in self.files:
            if not _holds(path, text):
                _write(path, text)


def included(header: str, body: str, input_names: list[str]) -> Included:
    """What to hand MLX for a kernel of this `header` and `body`: short includes of files that
    hold them, or the texts themselves where the files cannot be written or the short body
    would not name the same shape and stride arguments."""
    try:
        header_file, body_file = (_stored(text) for text in (header, body))
    except OSError:
        return Included(header, body)
    if any(c in str(p) for p in (header_file, body_file) for c in '"\n'):
        return Included(header, body)
    named = [n + s for n in input_names for s in SUFFIXES if n + s in body]
    short_body = f'#include "{body_file}"\n' + (f"// reads {' '.join(named)}\n" if named else "")
    if any((n + s in short_body) != (n + s in body) for n in input_names for s in SUFFIXES):
        return Included(header, body)
    return Included(f'#include "{header_file}"\n', short_body, ((header_file, header), (body_file, body)))


def folder() -> Path:
    return cubin_cache.folder() / "turboquant-src"


def _stored(text: str) -> Path:
    """The file holding `text` (written now unless a file of that name already holds it)."""
    path = folder() / f"{hashlib.sha256(text.encode()).hexdigest()[:32]}.cuh"
    if not _holds(path, text):
        _write(path, text)
    return path


def _holds(path: Path, text: str) -> bool:
    try:
        return path.read_text() == text
    except (OSError, UnicodeDecodeError):
        return False


def _write(path: Path, text: str) -> None:
    """Written whole and renamed into place: a compile in another process sees whole files only."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tq-")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
