"""A model's plain Linear layers multiplying a decode batch's 2-8 rows through
`kernels.rows_matmul`, which reads each weight row once (turboquant/attention/kernels/few_rows.py
says why: on CUDA, MLX's matmul of 2-16 rows ran 1.1-3.3x slower than of one row at the 8B
model's shapes). One row, more than 8, and everything off CUDA take nn.Linear's own path."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from turboquant.attention import kernels
from turboquant.attention.kernels.few_rows import MMAX


class FewRowsLinear(nn.Linear):
    """nn.Linear whose products of 2 to MMAX rows go through `kernels.rows_matmul` where it
    applies. Same parameters, so a layer becomes one by its class alone."""

    def __call__(self, x: mx.array) -> mx.array:
        rows = x.size // x.shape[-1] if x.ndim and x.shape[-1] else 0
        if 2 <= rows <= MMAX:
            y = kernels.rows_matmul(x, self["weight"])
            if y is not None:
                return y + self["bias"] if "bias" in self else y
        return super().__call__(x)


def use_few_rows_matmul(model: nn.Module) -> int:
    """Make every plain nn.Linear of `model` a FewRowsLinear (idempotent); how many changed.
    Quantized layers keep MLX's quantized kernels."""
    changed = 0
    for _, module in model.named_modules():
        if type(module) is nn.Linear:
            module.__class__ = FewRowsLinear
            changed += 1
    return changed
