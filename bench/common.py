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
OPENBLAS = Path("/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0")
LICENCE_CHARS = 5000  # the corpus files open with licence headers


def cpu_has_avx512() -> bool:
    try:
        return "avx512f" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def use_openblas(argv: list[str]) -> None:
    """Re-exec this script with Debian's OpenBLAS preloaded (opt-in; MLX's Linux wheel ships a
    reference BLAS 50x slower here). OPENBLAS_CORETYPE=SKYLAKEX assumes AVX-512: checked first."""
    if os.environ.get("TQSTORE_BLAS") == "openblas":
        return
    if not OPENBLAS.exists():
        sys.exit(f"--openblas: {OPENBLAS} not found (apt-get install libopenblas0-pthread)")
    if not cpu_has_avx512():
        sys.exit("--openblas: this CPU lacks AVX-512, so OPENBLAS_CORETYPE=SKYLAKEX would crash")
    env = dict(os.environ, LD_PRELOAD=str(OPENBLAS), OPENBLAS_CORETYPE="SKYLAKEX", TQSTORE_BLAS="openblas")
    os.execve(sys.executable, [sys.executable, *argv], env)


def blas_name() -> str:
    return os.environ.get("TQSTORE_BLAS", "bundled reference BLAS (mlx[cpu] wheel)")


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
