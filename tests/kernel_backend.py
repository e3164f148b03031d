"""Test support for the fused decode kernels without a GPU: route `fused_decode` to a backend
with a stand-in kernel factory (the emulator, or a deliberately broken one)."""

from turboquant import kernels
from turboquant.kernels import metal


def force_backend(monkeypatch, backend, factory):
    """Route fused_decode to `backend` with `factory` standing in for the GPU kernel."""
    monkeypatch.setattr(kernels, "select_backend", lambda: backend)
    if backend == "cuda":
        import turboquant.kernels.cuda as cuda_mod

        monkeypatch.setattr(cuda_mod, "kernel", factory)
    else:
        monkeypatch.setattr(metal, "kernel", factory)
