"""The decode kernels' compiled modules on disk, so a process pays NVRTC only for variants no
earlier process on the machine built.

MLX 0.32.4 compiles an `mx.fast.cuda_kernel` with NVRTC at its first launch in a process and keeps
the module in memory only: it looks for `<folder>/<module>.ptx` (and `<module>.txt`, the kernel
name and its lowered symbol) in its cache folder before compiling, but never writes custom
kernels there (its own JIT kernels, gathers and fused elementwise graphs, it does write). Measured
on the H200: a second process paid the same builds again (turbo4, 8 layers: 4.2 s at the first
cache fill and 4.7 s at the first question, against 0.02-0.1 s once built; issue 28).

So the first launch of each variant (per input and output dtypes) writes that file itself:
`mlx_source` rebuilds the exact source MLX compiles (its header line, the signature with strides
where the body names them, the body), `module_name` its module name (the kernel name and
libstdc++'s std::hash of that source, as MLX 0.32.4 names it), and `ensure` compiles it once
with NVRTC (through ctypes, the library MLX itself uses) into the folder. MLX then finds it, and
so does every later process. The module name carries the hash of the source, so a changed kernel
is never served an old binary. Anything that fails (no NVRTC, another MLX naming, a compile
error) only leaves the file out: MLX compiles the kernel as before. `TQSTORE_KERNEL_CACHE=0`
turns the writing off.

The folder is MLX's: `MLX_PTX_CACHE_DIR`, else `<tmp>/mlx/<version>/ptx`. /tmp does not outlive a
container or a reboot; the `tqstore` CLI points `MLX_PTX_CACHE_DIR` into the store's home.
"""

from __future__ import annotations

import ctypes
import glob
import os
import tempfile
import threading
from pathlib import Path

import mlx.core as mx

from turboquant.attention.kernels.dialects import section

# What MLX 0.32.4's custom_kernel.cpp writes around a kernel (checked against the strings of its
# libmlx.so): the default header, the namespace opening, the parameter lines, the closing.
DEFAULT_HEADER = '\n#include "mlx/backend/cuda/device/utils.cuh"\n\n#include <cooperative_groups.h>\n\n'
NAMESPACE_OPEN = "namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n"
CLOSING = "\n}\n\n} // namespace mlx::core::cu\n"
UTILS_HEADER = "mlx/backend/cuda/device/utils.cuh"
CUDA_TYPES = {mx.float32: "float", mx.float16: "__half", mx.bfloat16: "__nv_bfloat16", mx.uint32: "uint32_t",
              mx.int32: "int32_t"}
MASK64 = (1 << 64) - 1
_MUL = (0xC6A4A793 << 32) + 0x5BD1E995
_SEED = 0xC70F6907


def std_hash(data: bytes) -> int:
    """libstdc++'s std::hash<std::string> on a 64-bit machine (`_Hash_bytes`, seed 0xc70f6907)."""

    def shift_mix(v: int) -> int:
        return v ^ (v >> 47)

    n = len(data)
    h = (_SEED ^ (n * _MUL)) & MASK64
    aligned = n & ~7
    for i in range(0, aligned, 8):
        word = int.from_bytes(data[i:i + 8], "little")
        h ^= (shift_mix((word * _MUL) & MASK64) * _MUL) & MASK64
        h = (h * _MUL) & MASK64
    if n & 7:
        h ^= int.from_bytes(data[aligned:], "little")
        h = (h * _MUL) & MASK64
    h = (shift_mix(h) * _MUL) & MASK64
    return shift_mix(h)


def kernel_name(name: str) -> str:
    """The __global__ function's name (no template arguments: none are used)."""
    return "custom_kernel_" + name


def mlx_source(name: str, header: str, body: str, input_names: list[str], input_dtypes: list,
               output_names: list[str], output_dtypes: list) -> str:
    """The translation unit MLX builds for this kernel launch (inputs of ndim > 0 only, as ours
    are: shapes, strides and ndim appear where the body names `NAME_shape` and so on)."""
    text = DEFAULT_HEADER + header + NAMESPACE_OPEN + "__global__ void " + kernel_name(name) + "(\n"
    for n, dtype in zip(input_names, input_dtypes):
        text += f"    const {CUDA_TYPES[dtype]}* {n},\n"
        if n + "_shape" in body:
            text += f"    const __grid_constant__ Shape {n}_shape,\n"
        if n + "_strides" in body:
            text += f"    const __grid_constant__ Strides {n}_strides,\n"
        if n + "_ndim" in body:
            text += f"    const __grid_constant__ int {n}_ndim,\n"
    for i, (n, dtype) in enumerate(zip(output_names, output_dtypes)):
        text += f"    {CUDA_TYPES[dtype]}* {n}" + (",\n" if i < len(output_names) - 1 else ") {\n")
    return text + body + CLOSING


def module_name(name: str, source: str) -> str:
    return f"{kernel_name(name)}_{std_hash(source.encode()):x}"


def folder() -> Path:
    """MLX's cache folder (read by MLX once, at its first JIT build)."""
    configured = os.environ.get("MLX_PTX_CACHE_DIR")
    if configured:
        return Path(configured)
    return Path(tempfile.gettempdir()) / "mlx" / mx.__version__ / "ptx"


def enabled() -> bool:
    return os.environ.get("TQSTORE_KERNEL_CACHE", "1") != "0"


class Nvrtc:
    """The few NVRTC calls a compile needs (the library MLX loaded, found by soname)."""

    def __init__(self):
        self.lib = _load("libnvrtc.so", "nvrtc")
        self.lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        self.lib.nvrtcGetLoweredName.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.POINTER(ctypes.c_char_p)]

    def check(self, result: int, what: str) -> None:
        if result:
            raise RuntimeError(f"{what}: {self.lib.nvrtcGetErrorString(result).decode()}")

    def compile(self, source: str, symbol: str, arch: str, include_paths: list[str],
                headers: dict[str, str]) -> tuple[bytes, str]:
        """(cubin, lowered name of `symbol`)."""
        lib = self.lib
        prog = ctypes.c_void_p()
        names = [k.encode() for k in headers]
        texts = [v.encode() for v in headers.values()]
        self.check(lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"kernel.cu", len(headers),
                                          (ctypes.c_char_p * len(texts))(*texts),
                                          (ctypes.c_char_p * len(names))(*names)), "nvrtcCreateProgram")
        try:
            self.check(lib.nvrtcAddNameExpression(prog, symbol.encode()), "nvrtcAddNameExpression")
            options = [f"--gpu-architecture={arch}".encode()] + [f"--include-path={p}".encode()
                                                                  for p in include_paths]
            result = lib.nvrtcCompileProgram(prog, len(options), (ctypes.c_char_p * len(options))(*options))
            if result:
                size = ctypes.c_size_t()
                lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
                log = ctypes.create_string_buffer(size.value + 1)
                lib.nvrtcGetProgramLog(prog, log)
                raise RuntimeError(f"NVRTC failed: {log.value.decode(errors='replace')[:2000]}")
            size = ctypes.c_size_t()
            self.check(lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)), "nvrtcGetCUBINSize")
            cubin = ctypes.create_string_buffer(size.value)
            self.check(lib.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
            lowered = ctypes.c_char_p()
            self.check(lib.nvrtcGetLoweredName(prog, symbol.encode(), ctypes.byref(lowered)), "nvrtcGetLoweredName")
            return cubin.raw, lowered.value.decode()
        finally:
            lib.nvrtcDestroyProgram(ctypes.byref(prog))


def _load(stem: str, package_dir: str) -> ctypes.CDLL:
    """A CUDA library: by soname (already loaded by MLX, or on the loader's path), else from the
    NVIDIA wheels next to MLX."""
    for name in (f"{stem}.13", f"{stem}.12", stem):
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    site = Path(mx.__file__).resolve().parent.parent
    for path in sorted(glob.glob(str(site / "nvidia" / "**" / f"{stem}*"), recursive=True), reverse=True):
        try:
            return ctypes.CDLL(path)
        except OSError:
            continue
    raise OSError(f"no {stem} found (looked in {site / 'nvidia'})")


def _architecture() -> str:
    """sm_XY of device 0 (the driver API: cuInit, cuDeviceGetAttribute)."""
    cuda = ctypes.CDLL("libcuda.so.1")
    if cuda.cuInit(0):
        raise RuntimeError("cuInit failed")
    device = ctypes.c_int()
    if cuda.cuDeviceGet(ctypes.byref(device), 0):
        raise RuntimeError("cuDeviceGet failed")
    major, minor = ctypes.c_int(), ctypes.c_int()
    cuda.cuDeviceGetAttribute(ctypes.byref(major), 75, device)  # CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR
    cuda.cuDeviceGetAttribute(ctypes.byref(minor), 76, device)  # ..._MINOR
    return f"sm_{major.value}{minor.value}"


def _include_paths() -> list[str]:
    """Where MLX points NVRTC: the CCCL headers in its wheel and the CUDA toolkit's."""
    paths = [Path(mx.__file__).resolve().parent / "include" / "cccl"]
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    paths.append(Path(home) / "include")
    return [str(p) for p in paths if p.is_dir()]


class _Compiler:
    """NVRTC, the device's architecture and the include paths, found once per process."""

    def __init__(self):
        self.nvrtc = Nvrtc()
        self.arch = _architecture()
        self.includes = _include_paths()
        # Our kernels need only MLX's Shape and Strides types from its device header.
        self.headers = {UTILS_HEADER: section("mlx_prelude.cuh", "nvrtc")}


_compiler: _Compiler | None = None
_lock = threading.Lock()


def ensure(name: str, source: str) -> Path | None:
    """The cached module of this kernel source, compiled and written now if no process wrote it
    yet; None when the folder cannot be written or the compile fails (MLX then compiles)."""
    global _compiler
    target = folder()
    module = module_name(name, source)
    ptx = target / f"{module}.ptx"
    if ptx.exists():
        return ptx
    with _lock:
        if _compiler is None:
            _compiler = _Compiler()
        symbol = "mlx::core::cu::" + kernel_name(name)
        cubin, lowered = _compiler.nvrtc.compile(source, symbol, _compiler.arch, _compiler.includes,
                                                  _compiler.headers)
    target.mkdir(parents=True, exist_ok=True)
    # The names file first and each file renamed into place: a reader sees whole files only.
    for suffix, data in ((".txt", f"{symbol}\t{lowered}\n".encode()), (".ptx", cubin)):
        fd, tmp = tempfile.mkstemp(dir=target, prefix=".tq-")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, target / f"{module}{suffix}")
    return ptx
