"""The fused decode kernels through `mx.fast.cuda_kernel` (MLX's CUDA backend).

`kernel(variant)` builds (once) the kernel object of a pass-1 or pass-2 variant; the name
carries the whole variant (formats, bits, head dim, rows, dtypes), so MLX's per-name JIT cache
never hands one variant's module to another. Its first launch per input and output dtypes
writes the compiled module to MLX's cache folder (`cubin_cache`), which MLX 0.32.4 reads but
never writes for custom kernels: a later process loads it instead of running NVRTC again. `translation_unit` reproduces the file MLX hands to
NVRTC, so the source can be compiled offline (`nvcc`) where no GPU is present (with
`src/mlx_prelude.cuh` standing in for MLX's device header).
"""

from __future__ import annotations

import functools
import warnings

import mlx.core as mx

from turboquant.attention.kernels import cubin_cache
from turboquant.attention.kernels.dialects import section
from turboquant.attention.kernels.included import Included, included
from turboquant.attention.kernels.merge import Pass2
from turboquant.attention.kernels.query import Pass0
from turboquant.attention.kernels.ragged import Ragged
from turboquant.attention.kernels.template import Pass1, output_names, source

DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16, "uint32": mx.uint32,
          "int32": mx.int32}
STRIDED = ("k_raw", "k_w", "k_s", "k_b", "k_p", "k_n", "v_w", "v_s", "v_b", "v_p", "v_n", "t_k", "t_v")


class CachedKernel:
    """An `mx.fast.cuda_kernel` whose first launch per dtype signature makes sure its compiled
    module is in MLX's cache folder (`cubin_cache.ensure`), then launches it; called like the
    kernel object (keyword arguments)."""

    def __init__(self, variant: Pass0 | Pass1 | Pass2 | Ragged):
        self.name = variant.name
        self.input_names = variant.input_names()
        self.outputs = output_names(variant)
        # What MLX gets: the texts' files included by path (included.py), so a launch's host
        # time does not grow with the kernel's length.
        self.included: Included = included(*source(variant, "cuda"), self.input_names)
        # Cache views are token slices of larger buffers: read them through their strides.
        self.kernel = mx.fast.cuda_kernel(name=self.name, input_names=self.input_names, output_names=self.outputs,
                                          source=self.included.body, header=self.included.header,
                                          ensure_row_contiguous=False)
        self.cached: set[tuple] = set()

    def source_for(self, inputs: list[mx.array], output_dtypes: list) -> str:
        """The source MLX compiles for a launch with these inputs and output dtypes."""
        return self._source([a.dtype for a in inputs], output_dtypes)

    def __call__(self, *, inputs: list[mx.array], output_dtypes: list, **launch):
        self._ensure(tuple(a.dtype for a in inputs), tuple(output_dtypes))
        return self.kernel(inputs=inputs, output_dtypes=output_dtypes, **launch)

    def bound(self, input_dtypes: list, output_dtypes: list):
        """MLX's kernel object, for launches whose inputs and outputs have these dtypes: its
        module is made sure of on disk here, once, so a prepared decode step calls it directly.
        Checking each launch's dtype signature (`__call__`) cost about 5 us of a 12.8 us launch's
        host time on the H200 (docs/benchmarks.md, "One decode stream")."""
        self._ensure(tuple(input_dtypes), tuple(output_dtypes))
        return self.kernel

    def _source(self, input_dtypes: list, output_dtypes: list) -> str:
        return cubin_cache.mlx_source(self.name, self.included.header, self.included.body, self.input_names,
                                      list(input_dtypes), self.outputs, list(output_dtypes))

    def _ensure(self, input_dtypes: tuple, output_dtypes: tuple) -> None:
        """The compiled module of this dtype signature in MLX's cache folder (once per signature)."""
        signature = (input_dtypes, output_dtypes)
        if signature in self.cached:
            return
        self.cached.add(signature)
        try:
            self.included.ensure()
        except OSError as e:  # MLX's compile of this signature will say what is missing
            _warn_once(f"turboquant: kernel {self.name}'s source files not written ({e})")
        if cubin_cache.enabled():
            try:
                cubin_cache.ensure(self.name, self._source(input_dtypes, output_dtypes))
            except Exception as e:  # MLX compiles it itself, as without the cache
                _warn_once(f"turboquant: kernel {self.name} not cached on disk ({type(e).__name__}: {e}); "
                           "each process compiles it")


_warned: list[str] = []


def _warn_once(message: str) -> None:
    if not _warned:
        _warned.append(message)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


@functools.lru_cache(maxsize=None)
def kernel(variant: Pass0 | Pass1 | Pass2 | Ragged) -> CachedKernel:
    return CachedKernel(variant)


def input_types(variant: Pass0 | Pass1 | Pass2 | Ragged) -> dict[str, str]:
    """Element type of every input (what MLX would put in the signature)."""
    if isinstance(variant, Ragged):
        return variant.input_types()
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
        for n, norm in (("k_n", variant.key_norm), ("v_n", variant.value_norm)):
            if n in types and norm:
                types[n] = norm
    return {n: types[n] for n in variant.input_names()}



def translation_unit(variant: Pass0 | Pass1 | Pass2) -> str:
    """The kernel as MLX 0.32.4 assembles it (`cubin_cache.mlx_source`: the dtypes of
    `input_types`, float32 outputs), with a stand-in for MLX's device header: for offline
    compile checks."""
    header, body = source(variant, "cuda")
    inputs = input_types(variant)
    outputs = output_names(variant)
    text = cubin_cache.mlx_source(variant.name, header, body, list(inputs),
                                  [DTYPES[t] for t in inputs.values()], outputs, [mx.float32] * len(outputs))
    return text.replace(f'#include "{cubin_cache.UTILS_HEADER}"', section("mlx_prelude.cuh", "prelude"))
