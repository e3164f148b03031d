"""tqstore: a persistent, tiered KV-cache store for MLX / mlx-lm with TurboQuant compression."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tqstore.store.store import Store

__all__ = ["Store"]


def __getattr__(name: str) -> object:
    # Imported on first use: the Store pulls in MLX and mlx-lm, which `tqstore.config` users do not need.
    if name == "Store":
        from tqstore.store.store import Store

        return Store
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
