"""Run the generated kernels on the CPU: one OS thread per GPU thread (a test and debug tool).

The kernel body is the very text the CUDA and Metal kernels use (`template.body`), compiled as
C++20 with a third set of dialect macros (`emulator.h`): threadgroup memory becomes function
statics shared by the threads of the one threadgroup that runs at a time, `SYNC()` a barrier of
the threadgroup and a SIMD shuffle a barrier of the 32 threads of its SIMD group. Threadgroups run one after
another. `kernel(variant)` returns a callable with the call signature of an MLX custom kernel,
so `host.launch(kernel, ...)` runs the whole decode (inputs, both passes) on the CPU.

Needs a C++20 compiler (`CXX`, default g++) with `_Float16`; `available()` says whether one works.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import mlx.core as mx
import numpy as np

from turboquant.attention.kernels.cuda import input_types
from turboquant.attention.kernels.merge import Pass2
from turboquant.attention.kernels.query import Pass0
from turboquant.attention.kernels.template import Pass1, body, output_names

# The third dialect: the macros and helpers of the kernel text as plain C++20 (emulator.h, read verbatim).
HEADER = Path(__file__).with_name("emulator.h").read_text(encoding="utf-8")

PROLOGUE = """const int tid = tq_tid;
const int blk = tq_bx;
const int gy = tq_by;"""

C_TYPES = {"float32": "float", "float16": "_Float16", "bfloat16": "tq_bf16", "uint32": "uint32_t",
           "int32": "int32_t"}
NP_TYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16, "uint32": np.uint32,
            "int32": np.int32}


def compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "g++"))


@functools.lru_cache(maxsize=1)
def available() -> bool:
    cxx = compiler()
    if cxx is None:
        return False
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "probe.cc"
        src.write_text("#include <barrier>\nint main() { _Float16 h = 1.5f; std::barrier<> b(1); "
                       "b.arrive_and_wait(); return (float)h == 1.5f ? 0 : 1; }\n")
        try:
            subprocess.run([cxx, "-std=c++20", "-pthread", str(src), "-o", str(Path(tmp) / "probe")],
                           check=True, capture_output=True, timeout=120)
            subprocess.run([str(Path(tmp) / "probe")], check=True, capture_output=True, timeout=30)
        except (OSError, subprocess.SubprocessError):
            return False
    return True


def translation_unit(variant: Pass0 | Pass1 | Pass2) -> str:
    types = input_types(variant)
    text = body(variant, PROLOGUE)
    outputs = output_names(variant)
    params, unpack = [], []
    for i, (name, t) in enumerate(types.items()):
        params.append(f"const {C_TYPES[t]}* {name}")
        unpack.append(f"(const {C_TYPES[t]}*)ptrs[{i}]")
        if f"{name}_strides" in text:
            params.append(f"const Strides {name}_strides")
            unpack.append(f"tq_strides(strides, {i})")
    for j, name in enumerate(outputs):
        params.append(f"float* {name}")
        unpack.append(f"(float*)ptrs[{len(types) + j}]")
    return (HEADER + "static Strides tq_strides(const int64_t* s, int i) { Strides r{}; "
            "for (int k = 0; k < 10; ++k) r[k] = s[i * 10 + k]; return r; }\n"
            f"static void tq_kernel({', '.join(params)}) {{\n{text}\n}}\n"
            "extern \"C\" void tq_run(void** ptrs, const int64_t* strides, int gx, int gy, int nt) {\n"
            "  for (int by = 0; by < gy; ++by) {\n"
            "    for (int bx = 0; bx < gx; ++bx) {\n"
            "      std::barrier<> tg(nt);\n"
            "      std::vector<std::barrier<>*> warps;\n"
            "      std::vector<std::vector<float>> slots(nt / 32, std::vector<float>(32));\n"
            "      std::vector<std::vector<uint32_t>> uslots(nt / 32, std::vector<uint32_t>(32 * 6));\n"
            "      for (int w = 0; w < nt / 32; ++w) warps.push_back(new std::barrier<>(32));\n"
            "      std::vector<std::thread> threads;\n"
            "      for (int t = 0; t < nt; ++t) {\n"
            "        threads.emplace_back([&, t]() {\n"
            "          tq_tid = t; tq_bx = bx; tq_by = by; tq_tg_bar = &tg;\n"
            "          tq_warp_bar = warps[t / 32]; tq_warp_slots = slots[t / 32].data();\n"
            "          tq_warp_u = uslots[t / 32].data();\n"
            f"          tq_kernel({', '.join(unpack)});\n"
            "        });\n"
            "      }\n"
            "      for (auto& th : threads) th.join();\n"
            "      for (auto* w : warps) delete w;\n"
            "    }\n"
            "  }\n"
            "}\n")


_BUILD = Path(tempfile.gettempdir()) / "tq_kernel_emulator"


@functools.lru_cache(maxsize=None)
def _library(variant: Pass0 | Pass1 | Pass2):
    src = translation_unit(variant)
    digest = hashlib.sha256(src.encode()).hexdigest()[:16]
    _BUILD.mkdir(parents=True, exist_ok=True)
    so = _BUILD / f"{variant.name}_{digest}.so"
    if not so.exists():
        cc = _BUILD / f"{variant.name}_{digest}.cc"
        cc.write_text(src)
        tmp = so.with_suffix(f".{os.getpid()}.tmp")
        subprocess.run([compiler(), "-std=c++20", "-O1", "-w", "-pthread", "-shared", "-fPIC", str(cc), "-o",
                        str(tmp)], check=True, capture_output=True, timeout=600)
        os.replace(tmp, so)
    lib = ctypes.CDLL(str(so))
    lib.tq_run.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_int64), ctypes.c_int,
                           ctypes.c_int, ctypes.c_int]
    return lib


def _to_numpy(a: mx.array, t: str) -> np.ndarray:
    if t == "bfloat16":
        a = a.view(mx.uint16)
    return np.ascontiguousarray(np.array(a), dtype=NP_TYPES[t])


class _Kernel:
    def __init__(self, variant: Pass0 | Pass1 | Pass2):
        self.variant = variant

    def __call__(self, *, inputs, grid, threadgroup, output_shapes, output_dtypes, init_value=None, **_):
        types = list(input_types(self.variant).values())
        arrays = [_to_numpy(a, t) for a, t in zip(inputs, types)]
        outs = [np.full(s, np.nan if init_value is None else init_value, dtype=np.float32) for s in output_shapes]
        strides = np.zeros((len(arrays), 10), dtype=np.int64)
        for i, a in enumerate(arrays):
            strides[i, : a.ndim] = [s // a.itemsize for s in a.strides]
        ptrs = (ctypes.c_void_p * (len(arrays) + len(outs)))(*[a.ctypes.data for a in arrays + outs])
        nt = threadgroup[0]
        _library(self.variant).tq_run(ptrs, strides.ctypes.data_as(ctypes.POINTER(ctypes.c_int64)),
                                      grid[0] // nt, grid[1], nt)
        # (outputs are float32 here; an activation-dtype output is rounded as the GPU's store would)
        return [mx.array(o).astype(dt) for o, dt in zip(outs, output_dtypes)]


def kernel(variant: Pass0 | Pass1 | Pass2) -> _Kernel:
    return _Kernel(variant)
