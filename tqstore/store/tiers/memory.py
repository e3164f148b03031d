"""The memory tier: decoded objects (blocks, windows, shared codecs) as MLX arrays, by key.

What lives here was verified before it arrived: the Store puts an object only after
`format.loads` checked its bytes against its key, identity and tokens (promotion from LMDB or
S3), or after writing it itself (`put`). Each object keeps the provenance it was verified
against, so a reader checks it against what it expects without touching the arrays.

A byte budget bounds the arrays held; the least recently used unpinned objects go first.
Pinned keys (the objects of pinned entries) stay even over the budget. Thread-safe: one lock
around a dict in LRU order; no MLX work happens here.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from tqstore.format.blocks import Block, GroupedLayers, SharedCodecs, Window
from tqstore.format.objects import Provenance

Decoded = Block | Window | SharedCodecs


@dataclass(frozen=True, eq=False)
class HotObject:
    """A verified, decoded object and what it was verified as."""

    obj: Decoded
    kind: str  # "block", "window" or "shared"
    provenance: Provenance  # the header's identity, tokens and keys
    sha256: str  # hex digest of the payload it was decoded from (or written as)
    nbytes: int  # bytes of its arrays


@dataclass(frozen=True)
class MemoryStats:
    """What the memory tier holds."""

    bytes: int
    objects: int
    pinned_bytes: int
    budget_bytes: int
    evictions: int  # objects dropped for the budget since the tier was made


def decoded_nbytes(obj: Decoded) -> int:
    """Bytes of the arrays of a decoded object."""
    if isinstance(obj, SharedCodecs):
        return sum(a.nbytes for c in obj.codecs.values() for a in c.arrays.values())
    if isinstance(obj.layers, GroupedLayers):
        return obj.layers.nbytes  # without building a record per layer
    layers = obj.layers.values() if isinstance(obj, Block) else obj.layers
    return sum(r.nbytes for r in layers)


class MemoryTier:
    """Decoded objects by 32-byte key under a byte budget (LRU over unpinned objects)."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self._lock = threading.Lock()
        self._objects: OrderedDict[bytes, HotObject] = OrderedDict()  # least recently used first
        self._pinned: frozenset[bytes] = frozenset()
        self._bytes = 0
        self._evictions = 0

    def get(self, key: bytes) -> HotObject | None:
        """The object under `key` (marked as just used), or None."""
        with self._lock:
            hot = self._objects.get(key)
            if hot is not None:
                self._objects.move_to_end(key)
            return hot

    def has(self, key: bytes) -> bool:
        """Whether `key` is held (without marking it used)."""
        with self._lock:
            return key in self._objects

    def put(self, key: bytes, hot: HotObject) -> bool:
        """Hold `hot` under `key` (replacing what was there), then evict down to the budget.

        Returns False, holding nothing, for an unpinned object larger than the whole budget
        (it would only push everything else out and then go itself).
        """
        with self._lock:
            if key not in self._pinned and hot.nbytes > self.budget_bytes:
                return False
            old = self._objects.pop(key, None)
            if old is not None:
                self._bytes -= old.nbytes
            self._objects[key] = hot
            self._bytes += hot.nbytes
            self._evict()
            return True

    def drop(self, keys: Iterable[bytes]) -> int:
        """Forget `keys` (a failed check, a deleted entry); returns how many were held."""
        with self._lock:
            dropped = 0
            for key in keys:
                hot = self._objects.pop(key, None)
                if hot is not None:
                    self._bytes -= hot.nbytes
                    dropped += 1
            return dropped

    def set_pinned(self, keys: Iterable[bytes]) -> None:
        """Make `keys` (held now or later) the pinned set, replacing the previous one."""
        with self._lock:
            self._pinned = frozenset(keys)
            self._evict()

    def stats(self) -> MemoryStats:
        """Bytes, objects and evictions."""
        with self._lock:
            pinned = sum(h.nbytes for k, h in self._objects.items() if k in self._pinned)
            return MemoryStats(self._bytes, len(self._objects), pinned, self.budget_bytes, self._evictions)

    def _evict(self) -> None:
        if self._bytes <= self.budget_bytes:
            return
        for key in [k for k in self._objects if k not in self._pinned]:  # LRU order
            self._bytes -= self._objects.pop(key).nbytes
            self._evictions += 1
            if self._bytes <= self.budget_bytes:
                return
