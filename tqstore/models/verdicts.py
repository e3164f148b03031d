"""A model's plan verdicts on disk (turboquant.adapter.verdicts), one small JSON file per model and code.

Making a model's caches runs the model to learn which layers its code reads itself and whether
a scheme's plan passes its check; that costs several seconds of every fresh process on a CPU
(8 of 21 s of a `tqstore ask` with a 0.5B model) and never changes for one model and one
version of the code. The file is named by the model's identity digest and a fingerprint of
the code that decides (MLX's and mlx-lm's versions and turboquant's own files: tqstore takes no
part in a plan's check), so a changed model or an upgrade reads nothing stale. A file that cannot be read or written is ignored: the verdicts
are computed again, as without a book.
"""

from __future__ import annotations

import hashlib
import json
import threading
from functools import lru_cache
from pathlib import Path
from typing import Any

from tqstore.durable import write_cache_file


@lru_cache(maxsize=1)
def code_fingerprint() -> str:
    """A digest of what decides a verdict: package versions and turboquant's files (name, size,
    modification time), so an edited checkout never reads the verdicts of the code before."""
    import mlx.core as mx
    import mlx_lm

    import turboquant

    parts = [f"mlx {mx.__version__}", f"mlx_lm {mlx_lm.__version__}"]
    root = Path(turboquant.__file__).parent
    for path in sorted(root.rglob("*")):
        if path.suffix in {".py", ".h", ".cuh", ".metal"}:
            stat = path.stat()
            parts.append(f"{path.relative_to(root)} {stat.st_size} {stat.st_mtime_ns}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


class FileVerdicts:
    """turboquant.adapter.verdicts.VerdictBook kept in `folder`/<model digest>-<code fingerprint>.json."""

    def __init__(self, folder: Path, model_digest: str) -> None:
        self.path = Path(folder) / f"{model_digest}-{code_fingerprint()}.json"
        self._lock = threading.Lock()
        self._values = self._read()

    def _read(self) -> dict[str, Any]:
        try:
            values = json.loads(self.path.read_bytes())
        except (OSError, ValueError):
            return {}
        return values if isinstance(values, dict) else {}

    def get(self, key: str) -> Any | None:
        """The verdict kept under `key` (None: none kept)."""
        with self._lock:
            return self._values.get(key)

    def put(self, key: str, value: Any) -> None:
        """Keep `value` under `key`, merged with what other processes wrote meanwhile."""
        with self._lock:
            self._values = {**self._read(), **self._values, key: value}
            try:
                write_cache_file(self.path, json.dumps(self._values, sort_keys=True).encode())
            except OSError:
                pass  # a read-only home: the verdicts are computed again next time
