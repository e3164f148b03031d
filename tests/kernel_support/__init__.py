"""Test support for the fused decode kernels: the CPU emulator, the float64 reference, and the
grid of kernel variants whose source digests pin the generated text."""

import pytest


def on_demand(cases: list, keep: set[int], *, unpack: bool = False) -> list:
    """`cases` for a parametrize, every one outside `keep` (indices) marked `slow`.

    Each emulated case compiles its own C++ translation unit and runs one OS thread per GPU
    thread (3-20 s on 2 cores). The default run keeps one case per layout family; the rest run
    with `-m slow` and, on real kernels, in the GPU run. `test_kernel_digests.py` pins the text
    every variant builds, so a kernel edit fails the default run even where its case is slow.
    `unpack`: each case is a tuple of several argument values.
    """
    def slow(case):
        return pytest.param(*case, marks=pytest.mark.slow) if unpack else pytest.param(case, marks=pytest.mark.slow)

    return [case if i in keep else slow(case) for i, case in enumerate(cases)]
