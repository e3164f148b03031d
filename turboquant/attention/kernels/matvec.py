"""A [D] x [D, D] product inside one threadgroup, written for memory-level parallelism.

Passes 0 and 2 apply a dense float32 rotation to one row per threadgroup. A loop in which each
thread walks a whole column keeps only a few loads of the matrix in flight and pays a memory
round trip per few elements; here every thread owns four adjacent columns over a slice of the
rows, so all its loads are independent 16-byte loads issued up front (one round trip), and the
slices are summed in threadgroup memory in a fixed order (repeated runs are bit-identical).
The text is `src/matvec.h`."""

from __future__ import annotations

from turboquant.attention.kernels.dialects import fill, section


def matvec(x: str, m: str, y: str, post: str = "") -> str:
    """Kernel text that sets `y` (an lvalue naming the column `e`) to (x @ m)[e] followed by the
    expression tail `post`, for every e < D. `x` is a [D] float array in threadgroup memory,
    written before a barrier; `m` a dense row-major [D, D] float32 device array. Needs D % 4 == 0
    and NT >= D / 4; every thread of the threadgroup must reach it (it has a barrier). Once per
    kernel (its names are kernel-scope)."""
    return fill(section("matvec.h", "matvec"), X=x, M=m, Y=y, POST=post)
