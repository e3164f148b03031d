"""tqstore: a persistent, tiered KV-cache store for MLX / mlx-lm with TurboQuant compression."""
