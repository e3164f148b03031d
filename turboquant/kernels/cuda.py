"""The fused decode kernels through `mx.fast.cuda_kernel` (MLX's CUDA backend).

`kernel(variant)` builds (once) the kernel object of a pass-1 or pass-2 variant; the name
carries the whole variant (formats, bits, head dim, rows, dtypes), so MLX's per-name JIT cache
never hands one variant's module to another. `translation_unit` reproduces the file MLX hands to
NVRTC, so the source can be compiled offline (`nvcc`) where no GPU is present (with
`src/mlx_prelude.cuh` standing in for MLX's device header).
"""

from __future__ import annotations

import functools

import mlx.core as mx

from .dialects import section
from .merge import Pass2
from .query import Pass0
from .template import Pass1, output_names, source

CUDA_TYPES = {"float32": "float", "float16": "__half", "bfloat16": "__nv_bfloat16", "uint32": "uint32_t",
              "int32": "int32_t"}
STRIDED = ("k_raw", "k_w", "k_s", "k_b", "k_p", "k_n", "v_w", "v_s", "v_b", "v_p", "v_n", "t_k", "t_v")


@functools.lru_cache(maxsize=None)
def kernel(variant: Pass0 | Pass1 | Pass2):
    header, body = source(variant, "cuda")
    outputs = output_names(variant)
    # Cache views are token slices of larger buffers: read them through their strides.
    return mx.fast.cuda_kernel(name=variant.name, input_names=variant.input_names(), output_names=outputs,
                               source=body, header=header, ensure_row_contiguous=False)


def input_types(variant: Pass0 | Pass1 | Pass2) -> dict[str, str]:
    """Element type of every input (what MLX would put in the signature)."""
    types = {n: "float32" for n in variant.input_names()}
    types["params"] = "int32"
    if isinstance(variant, Pass0):
        types["q"] = variant.q_dtype
    if isinstance(variant, Pass2) and variant.tail_dtype:
        types["tq"] = variant.q_dtype
        types["t_k"] = types["t_v"] = variant.tail_dtype
    if isinstance(variant, Pass1):
        if variant.q_dtype:
            types["q_raw"] = variant.q_dtype
        for n in ("k_w", "k_p", "v_w", "v_p"):
            types[n] = "uint32"
        for n in ("k_raw", "k_s", "k_b"):
            types[n] = variant.key_dtype
        for n in ("v_s", "v_b"):
            types[n] = variant.value_dtype
    return {n: types[n] for n in variant.input_names()}



def translation_unit(variant: Pass0 | Pass1 | Pass2) -> str:
    """The kernel as MLX 0.32.4 assembles it (signature from the inputs; strides where the body
    names them), with a stand-in for MLX's device header: for offline compile checks."""
    header, body = source(variant, "cuda")
    outputs = output_names(variant)
    params = []
    for name, t in input_types(variant).items():
        params.append(f"    const {CUDA_TYPES[t]}* {name}")
        if f"{name}_strides" in body:
            params.append(f"    const __grid_constant__ Strides {name}_strides")
    params += [f"    float* {name}" for name in outputs]
    return (section("mlx_prelude.cuh", "prelude") + header + "namespace mlx::core::cu {\n\n__global__ void "
            + variant.name + "(\n"
            + ",\n".join(params) + ") {\n" + body + "\n}\n\n} // namespace mlx::core::cu\n")
