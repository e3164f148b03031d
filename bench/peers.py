"""mlx-lm's own prompt-cache files for the same context: size, save and load time.

mlx-lm saves the padded buffers of a KVCache (or of its QuantizedKVCache under kv_bits) into
one safetensors file; the cache here is cast to float16, the dtype such caches have on a Mac.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx


@dataclass
class PeerRow:
    name: str
    file_bytes: int
    save_seconds: float
    load_seconds: float  # load_prompt_cache + mx.eval (mx.load is lazy)


def mlx_lm_files(raw_snapshot, model) -> list[PeerRow]:
    """Save and load the context with mlx-lm: fp16 KVCache, and QuantizedKVCache 8 and 4 bits."""
    from mlx_lm.models.cache import load_prompt_cache, make_prompt_cache, save_prompt_cache

    from turboquant import restore_as

    rows = []
    for label, bits in (("mlx-lm KVCache fp16", None), ("mlx-lm QuantizedKVCache 8-bit", 8),
                        ("mlx-lm QuantizedKVCache 4-bit", 4)):
        caches = restore_as(raw_snapshot, make_prompt_cache(model))
        for c in caches:
            c.keys, c.values = c.keys.astype(mx.float16), c.values.astype(mx.float16)
        if bits is not None:
            caches = [c.to_quantized(group_size=64, bits=bits) for c in caches]
        mx.eval([c.state for c in caches])
        with tempfile.TemporaryDirectory() as d:
            path = str(Path(d) / "cache.safetensors")
            t0 = time.perf_counter()
            save_prompt_cache(path, caches)
            t1 = time.perf_counter()
            loaded = load_prompt_cache(path)
            mx.eval([c.state for c in loaded])
            rows.append(PeerRow(label, Path(path).stat().st_size, t1 - t0, time.perf_counter() - t1))
    return rows
