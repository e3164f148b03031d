"""The BLAS under MLX's Linux CPU backend: OpenBLAS by default where it is installed.

The `mlx[cpu]` wheel ships a reference BLAS (about 1-8 GFLOP/s for float32 matmul on a 2-core
x86 box). Debian's OpenBLAS, preloaded, reaches 20-420 GFLOP/s there: a 16k-token prefill takes
minutes instead of an hour. `auto` (the default) restarts the command on OpenBLAS when the
library is installed and says in one line how to install it when it is not; `bundled` and
`openblas` pin one library. The two sum in different orders (logits differ by ~5e-6), which
matters to equality checks and not to a user: the tests pin `bundled` (tests/conftest.py) and
every benchmark records which BLAS ran. Stored entries are usable under either.
"""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path

from tqstore.errors import ConfigError

OPENBLAS_PATHS = (
    Path("/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0"),
    Path("/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0"),
)
MARKER = "TQSTORE_BLAS_ACTIVE"
CHOICES = ("auto", "bundled", "openblas")
INSTALL_HINT = ("the CPU matmuls run on MLX's slow bundled BLAS: `apt-get install libopenblas0-pthread` "
                "makes prefill 10-40x faster (or set store.blas = bundled to silence this)")


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


def core_type(flags: set[str]) -> str | None:
    """The OpenBLAS x86 kernel set this CPU runs: SKYLAKEX with AVX-512, HASWELL with AVX2 + FMA,
    None (OpenBLAS's own detection) otherwise.

    OpenBLAS 0.3.21 does not recognise newer CPUs (Zen 4, Sapphire Rapids) and falls back to
    its slowest kernels, so the type is named from the instruction sets, never the model name.
    """
    if "avx512f" in flags and "avx512bw" in flags and "avx512vl" in flags:
        return "SKYLAKEX"
    if "avx2" in flags and "fma" in flags:
        return "HASWELL"
    return None


def openblas_environment() -> dict[str, str]:
    """Environment variables that preload OpenBLAS; raises ConfigError when it cannot work here."""
    if sys.platform != "linux":
        raise ConfigError("--blas openblas is for MLX's Linux CPU backend; on macOS MLX uses Accelerate/Metal")
    lib = openblas_library()
    if lib is None:
        raise ConfigError("OpenBLAS is not installed: apt-get install libopenblas0-pthread")
    env = {"LD_PRELOAD": str(lib), MARKER: "openblas"}
    if platform.machine() == "x86_64":
        kind = core_type(_cpu_flags())
        if kind is not None:
            env["OPENBLAS_CORETYPE"] = kind
    return env


def resolve(choice: str) -> tuple[str, str | None]:
    """The library a choice means on this machine, and the one line to tell the user (or None).

    `auto` means OpenBLAS on a Linux machine that has it installed and runs MLX on the CPU, else
    the bundled BLAS, with the install hint on a Linux machine without a GPU.
    """
    if choice not in CHOICES:
        raise ConfigError(f"blas must be one of {', '.join(CHOICES)}, got {choice!r}")
    if choice != "auto":
        return choice, None
    if sys.platform != "linux":
        return "bundled", None
    if gpu_default():
        return "bundled", None  # the matmuls run on the GPU: a restart would only pay every import twice
    if openblas_library() is None:
        return "bundled", INSTALL_HINT
    return "openblas", None


def gpu_default() -> bool:
    """Whether MLX runs on a GPU here by default (CUDA on Linux), so the CPU's BLAS does not matter."""
    import mlx.core as mx

    return mx.default_device().type == mx.DeviceType.gpu


def reexec_with(choice: str, argv: list[str] | None = None) -> None:
    """Restart this process (same interpreter and arguments by default) with the chosen BLAS;
    a no-op when it is already the active one."""
    library, _ = resolve(choice)
    if library == active_blas() or library == "bundled":
        return
    env = dict(os.environ, **openblas_environment())
    args = sys.orig_argv[1:] if argv is None else argv
    os.execve(sys.executable, [sys.executable, *args], env)
