"""mlx-lm's side: a model's per-layer caches, the attention dispatch, snapshots and restores of
every layer kind (native, compressed, windows, recurrent states), and where each layer lives."""
