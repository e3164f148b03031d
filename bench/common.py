"""Shared pieces of the benchmark scripts: model/text locations, BLAS choice, table output."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

HOME = Path(os.environ.get("TQSTORE_HOME", Path.home() / ".cache" / "tqstore"))
DEFAULT_MODEL = HOME / "models" / "qwen2.5-coder-0.5b"
DEFAULT_TEXT = HOME / "corpus" / "devils_dictionary.txt"
LICENCE_CHARS = 5000  # the corpus files open with licence headers


def use_openblas(argv: list[str]) -> None:
    """Re-exec this script with Debian's OpenBLAS preloaded (opt-in; see tqstore/blas.py)."""
    from tqstore.blas import reexec_with
    from tqstore.errors import ConfigError

    try:
        reexec_with("openblas", argv)  # the script path and its arguments
    except ConfigError as e:
        sys.exit(f"--openblas: {e}")


def blas_name() -> str:
    from tqstore.blas import active_blas

    return "OpenBLAS (preloaded, opt-in)" if active_blas() == "openblas" else "bundled reference BLAS (mlx[cpu] wheel)"


def machine_line() -> str:
    import mlx.core as mx

    import mlx_lm

    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        cpu = platform.processor() or cpu
    return (f"{cpu}, {os.cpu_count()} cores, {platform.system()} {platform.machine()}, Python "
            f"{platform.python_version()}, MLX {mx.__version__} ({mx.default_device()}), mlx-lm "
            f"{mlx_lm.__version__}, BLAS: {blas_name()}")


def git_revision() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def replace_section(path: Path, marker: str, body: str) -> None:
    """Replace the text between `<!-- marker:start -->` and `<!-- marker:end -->` (appending if absent)."""
    start, end = f"<!-- {marker}:start -->", f"<!-- {marker}:end -->"
    text = path.read_text() if path.exists() else ""
    block = f"{start}\n{body.rstrip()}\n{end}"
    if start in text and end in text:
        text = text[:text.index(start)] + block + text[text.index(end) + len(end):]
    else:
        text = text.rstrip() + ("\n\n" if text else "") + block + "\n"
    path.write_text(text)
