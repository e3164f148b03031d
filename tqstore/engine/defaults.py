"""Engine defaults that the command line shows in its help: a module without imports, so that
building `tqstore`'s parser does not load the engine (MLX, mlx-lm, transformers)."""

DEFAULT_RECOMPUTE = 0.2  # the smallest measured budget that met KL <= 0.05 (docs/rag.md)
PREFILL_CHUNK = 512  # tokens per prefill step (the engine's default; compose_memory estimates one step's scores)
