"""Opt-in faster BLAS for MLX's Linux CPU backend.

The `mlx[cpu]` wheel ships a reference BLAS (about 4-8 GFLOP/s for float32 matmul on a 2-core
x86 box). Debian's OpenBLAS, preloaded, reaches 90-420 GFLOP/s there, but it sums in another
order (logits differ by ~5e-6), so it is never switched on silently: the user asks for it
(`--blas openblas`, `TQSTORE_BLAS=openblas` or `blas = "openblas"` in the config's [store] table), the CPU is
checked first, and every benchmark records which BLAS ran.
"""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path

from .errors import ConfigError

OPENBLAS_PATHS = (
    Path("/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0"),
    Path("/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0"),
)
MARKER = "TQSTORE_BLAS_ACTIVE"
CHOICES = ("bundled", "openblas")


def active_blas() -> str:
    """Which BLAS this process runs on ("openblas" only when preloaded by `reexec_with`)."""
    return os.environ.get(MARKER, "bundled")


def openblas_library() -> Path | None:
    return next((p for p in OPENBLAS_PATHS if p.exists()), None)


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def openblas_environment() -> dict[str, str]:
    """Environment variables that preload OpenBLAS; raises ConfigError when it cannot work here."""
    if sys.platform != "linux":
        raise ConfigError("--blas openblas is for MLX's Linux CPU backend; on macOS MLX uses Accelerate/Metal")
    lib = openblas_library()
    if lib is None:
        raise ConfigError("OpenBLAS is not installed: apt-get install libopenblas0-pthread")
    env = {"LD_PRELOAD": str(lib), MARKER: "openblas"}
    if platform.machine() == "x86_64":
        # OpenBLAS 0.3.21 does not recognise newer x86 CPUs; the SKYLAKEX kernels need AVX-512.
        if "avx512f" not in _cpu_flags():
            raise ConfigError("this CPU lacks AVX-512, which the OpenBLAS core type override needs")
        env["OPENBLAS_CORETYPE"] = "SKYLAKEX"
    return env


def reexec_with(choice: str, argv: list[str] | None = None) -> None:
    """Restart this process (same interpreter and arguments by default) with the chosen BLAS;
    a no-op when it is already the active one."""
    if choice not in CHOICES:
        raise ConfigError(f"blas must be one of {', '.join(CHOICES)}, got {choice!r}")
    if choice == active_blas() or choice == "bundled":
        return
    env = dict(os.environ, **openblas_environment())
    args = sys.orig_argv[1:] if argv is None else argv
    os.execve(sys.executable, [sys.executable, *args], env)
