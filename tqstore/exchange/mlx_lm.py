"""mlx-lm prompt-cache files (`save_prompt_cache`, `mlx_lm.cache_prompt`) <-> Snapshots.

mlx-lm 0.32.2 writes `tree_flatten([c.state for c in caches])` with the class names and an
encoding of scalars in the safetensors metadata, and rebuilds each layer with
`globals()[class].from_state(state)`. Export builds real mlx-lm cache objects and lets
`save_prompt_cache` write them (to memory, then atomically to the file), so the file is exactly
what mlx-lm itself writes, except that buffers are cut to the tokens held: `from_state` accepts
that and the caches grow again on the next update. Only layers mlx-lm has a class for can be
exported: RAW (KVCache), AFFINE with equal key and value settings, no calibration and no raw
tail (QuantizedKVCache) and ROTATING (RotatingKVCache). Layers compressed at rest (the model
reads their arrays itself) are exported decoded, as the KVCache they restore into.
"""

from __future__ import annotations

import io
import os
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_unflatten
from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

from turboquant import NATIVE_CLASSES, NotNative, compress_snapshot, native_caches, native_snapshot
from turboquant.records import Snapshot

from tqstore.durable import write_file_atomic
from tqstore.errors import MalformedHeader, NotFound, UnsupportedCache

@dataclass(frozen=True, eq=False)
class PromptCacheFile:
    """An imported prompt-cache file: the snapshot and the file's user metadata (str -> str)."""

    snapshot: Snapshot
    metadata: dict[str, str]


def export_prompt_cache(path: str | os.PathLike, snapshot: Snapshot, metadata: dict[str, str] | None = None) -> None:
    """Write `snapshot` as a file that `mlx_lm.models.cache.load_prompt_cache` loads.

    Raises UnsupportedCache naming the first layer mlx-lm cannot represent (TurboQuant
    layouts, calibrated or mixed-setting affine layers).
    """
    path = Path(path)
    if path.suffix != ".safetensors":
        raise ValueError(f"mlx-lm prompt-cache files end in .safetensors (mlx.load picks the format by it): {path}")
    try:
        caches = native_caches(snapshot)
    except NotNative as e:
        raise UnsupportedCache(str(e)) from None
    buf = io.BytesIO()
    save_prompt_cache(buf, caches, dict(metadata or {}))
    write_file_atomic(path, buf.getvalue())


def import_prompt_cache(path: str | os.PathLike, *, model=None, scheme: str | None = None,
                        **cache_options) -> PromptCacheFile:
    """Read a prompt-cache file written by mlx-lm into a Snapshot.

    With `scheme` (e.g. "turbo0v4") and the `model` the file was made with, the raw layers
    are compressed as `make_prompt_cache(model, scheme, **cache_options)` caches would
    compress them (see `compress_snapshot`).
    """
    path = Path(path)
    if not path.is_file():
        raise NotFound(f"no prompt-cache file at {path}")
    try:
        _, flat = mx.load(str(path), return_metadata=True)
        _, classes, _ = tree_unflatten(list(flat.items()))
    except (RuntimeError, ValueError, TypeError, KeyError, IndexError) as e:
        raise MalformedHeader(f"{path} is not an mlx-lm prompt-cache file ({e}); write it with "
                              "mlx_lm.models.cache.save_prompt_cache or mlx_lm.cache_prompt") from None
    unknown = [(i, c) for i, c in enumerate(classes) if c not in NATIVE_CLASSES]
    if unknown:
        i, c = unknown[0]
        raise UnsupportedCache(f"{path}: layer {i} is a {c}, which tqstore cannot import (it imports "
                               f"{', '.join(NATIVE_CLASSES)})")
    try:
        caches, metadata = load_prompt_cache(str(path), return_metadata=True)
    except (RuntimeError, ValueError, TypeError, KeyError, IndexError) as e:
        raise MalformedHeader(f"{path}: mlx-lm cannot read this prompt-cache file ({e})") from None
    if scheme is not None and model is None:
        raise ValueError("compressing an imported cache to a scheme needs the model it was made with: its "
                         "caches decide each layer's plan")
    try:
        snap = native_snapshot(caches)
        if scheme is not None:
            snap = compress_snapshot(snap, model, scheme, **cache_options)
    except NotNative as e:
        raise UnsupportedCache(str(e)) from None
    return PromptCacheFile(snap, dict(metadata))
