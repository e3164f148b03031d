"""The fused decode kernels through `mx.fast.metal_kernel` (MLX's Metal backend, for Macs).

Same source as the CUDA kernels (one template per pass). This backend cannot be run where
it was written, so `checked` makes each kernel prove itself on the user's machine: the first
call of every shape runs the kernel and the plain-ops path, compares them, and caches the
verdict; a disagreement falls back to plain ops for that shape with a one-line warning.
"""

from __future__ import annotations

import functools
import warnings

import mlx.core as mx

from turboquant.attention.kernels.merge import Pass2
from turboquant.attention.kernels.query import Pass0
from turboquant.attention.kernels.template import Pass1, output_names, source

RTOL = 2e-3  # relative to max |reference|; the kernel computes in float32 like the plain path

_verdicts: dict[tuple, bool] = {}


@functools.lru_cache(maxsize=None)
def kernel(variant: Pass0 | Pass1 | Pass2):
    header, body = source(variant, "metal")
    outputs = output_names(variant)
    # math_mode "safe" keeps exp2(-inf) == 0, which the online softmax relies on.
    return mx.fast.metal_kernel(name=variant.name, input_names=variant.input_names(), output_names=outputs,
                                source=body, header=header, ensure_row_contiguous=False,
                                compile_options={"math_mode": "safe"})


def shape_key(call, sinks: bool = False) -> tuple:
    """What one self-check vouches for: the kernel variants (pass 1 names its rows bucket) and
    the batch and head counts. Not the GQA ratio itself: `fused_prefill` passes R * L query rows,
    and a key with it would check again at every new question length."""
    return (call.pass1, call.pass2, call.B, call.H, sinks)


def verdict(call, run, reference, sinks: bool = False) -> tuple | None:
    """Run the kernel (`run()` -> (out, lse)); on the first call of a shape (with or without
    attention sinks: another pass 2) also `reference()` and keep the kernel only if both agree.
    Returns the kernel's result, or None to fall back."""
    from turboquant.attention.kernels.host import close

    key = shape_key(call, sinks)
    ok = _verdicts.get(key)
    if ok is False:
        return None
    result = run()
    if result is None or ok:
        return result
    ref = reference()
    good_out, err_out = close(result[0], ref[0], RTOL)
    good_lse, err_lse = close(result[1], ref[1], RTOL)
    _verdicts[key] = good_out and good_lse
    if not _verdicts[key]:
        what = call.pass1.name + (" with sinks" if sinks else "")
        warnings.warn(f"turboquant: Metal decode kernel {what} disagrees with the plain-ops path "
                      f"(relative error {max(err_out, err_lse):.2e}); using plain ops for this shape",
                      RuntimeWarning, stacklevel=4)
        return None
    return result


def reset() -> None:
    _verdicts.clear()
