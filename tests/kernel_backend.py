"""Test support for the fused decode kernels without a GPU: route `fused_decode` to a backend
with a stand-in kernel factory (the emulator, or a deliberately broken one)."""

import functools

from turboquant.attention import compressed as attention
from turboquant.attention import kernels
from turboquant.attention.kernels import metal, steps
from turboquant.cache.mirror import MIRROR_ENV


def force_backend(monkeypatch, backend, factory, tuning=None):
    """Route fused_decode to `backend` with `factory` standing in for the GPU kernel; with
    `tuning` (a KernelTuning), the attention path's calls use that value. Short contexts reach
    the kernels too: no decoded mirror (turboquant/cache/mirror.py) stands in for them. The
    process's call templates (kernels/steps.py) start empty and go with the test: they hold the
    factory's kernels."""
    monkeypatch.setattr(kernels, "select_backend", lambda: backend)
    monkeypatch.setattr(steps, "TEMPLATES", {})
    monkeypatch.setenv(MIRROR_ENV, "0")
    if tuning is not None:
        monkeypatch.setattr(attention, "fused_decode", functools.partial(kernels.fused_decode, tuning=tuning))
    if backend == "cuda":
        import turboquant.attention.kernels.cuda as cuda_mod

        monkeypatch.setattr(cuda_mod, "kernel", factory)
    else:
        monkeypatch.setattr(metal, "kernel", factory)
