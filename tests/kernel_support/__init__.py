"""Test support for the fused decode kernels: the CPU emulator, the float64 reference, and the
grid of kernel variants whose source digests pin the generated text."""
