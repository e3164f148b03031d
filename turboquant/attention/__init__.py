"""Attention over compressed storage: plain MLX ops (the CPU and reference path), the
multi-token prefill, and the fused GPU kernels (`kernels/`)."""
