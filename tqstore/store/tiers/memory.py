"""The memory tier: decoded objects (blocks, windows, shared codecs) as MLX arrays, by key.

What lives here was verified before it arrived: the Store puts an object only after
`format.loads` checked its bytes against its key, identity and tokens (promotion from LMDB or
S3), or after writing it itself (`put`). Each object keeps the provenance it was verified
against, so a reader checks it against what it expects without touching the arrays.

A restore (or a put) leaves the blocks it joined here as views of the joined arrays
(`format.blocks.join_resident`): the next restore of them is a slice of those arrays, with no
decode and no copy, and the arrays live on the device where MLX put them. A joined group is
shared by every block that views it, and counted once, while any of them is held.

A byte budget bounds the arrays held; the least recently used unpinned objects go first.
Pinned keys (the objects of pinned entries) stay even over the budget. Thread-safe: one lock
around a dict in LRU order; no MLX work happens here.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from tqstore.format.blocks import Block, CutLayers, GroupedLayers, Joined, SharedCodecs, Window
from tqstore.format.objects import Provenance

Decoded = Block | Window | SharedCodecs


@dataclass(frozen=True, eq=False)
class HotObject:
    """A verified, decoded object and what it was verified as."""

    obj: Decoded
    kind: str  # "block", "window" or "shared"
    provenance: Provenance  # the header's identity, tokens and keys
    sha256: str  # hex digest of the payload it was decoded from (or written as)
    nbytes: int  # bytes of its arrays (of its views, for a block kept as views of joined groups)


@dataclass(frozen=True)
class MemoryStats:
    """What the memory tier holds."""

    bytes: int
    objects: int
    pinned_bytes: int
    budget_bytes: int
    evictions: int  # objects dropped for the budget since the tier was made


def holdings(obj: Decoded) -> tuple[int, tuple[Joined, ...]]:
    """(bytes of the arrays held by `obj` alone, the joined groups it holds views of)."""
    if isinstance(obj, Block) and isinstance(obj.layers, GroupedLayers):
        return obj.layers.holdings()
    return decoded_nbytes(obj), ()


def decoded_nbytes(obj: Decoded) -> int:
    """Bytes of the arrays of a decoded object."""
    if isinstance(obj, SharedCodecs):
        return sum(a.nbytes for c in obj.codecs.values() for a in c.arrays.values())
    if isinstance(obj.layers, (GroupedLayers, CutLayers)):
        return obj.layers.nbytes  # without building a record per layer
    layers = obj.layers.values() if isinstance(obj, Block) else obj.layers
    return sum(r.nbytes for r in layers)


class MemoryTier:
    """Decoded objects by 32-byte key under a byte budget (LRU over unpinned objects).

    Bytes count what is held: each object's own arrays, and each joined group once while any
    held block views it (`holdings`)."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self._lock = threading.Lock()
        self._objects: OrderedDict[bytes, HotObject] = OrderedDict()  # least recently used first
        self._held: dict[bytes, tuple[int, tuple[Joined, ...]]] = {}  # key -> holdings of its object
        self._shared: dict[int, tuple[Joined, int]] = {}  # id -> (joined group, objects viewing it)
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
        return self.put_all([(key, hot)])

    def put_all(self, items: list[tuple[bytes, HotObject]]) -> bool:
        """Hold every object of `items` (the blocks of one join share its joined groups), then
        evict down to the budget. Returns False, holding none of them, when what they hold
        together, pinned keys aside, exceeds the whole budget."""
        with self._lock:
            held = [(key, hot, holdings(hot.obj)) for key, hot in items]
            unpinned = [h for key, _, h in held if key not in self._pinned]
            fresh = {id(j): j for _, shared in unpinned for j in shared if id(j) not in self._shared}
            if sum(own for own, _ in unpinned) + sum(j.nbytes for j in fresh.values()) > self.budget_bytes:
                return False
            for key, hot, holding in held:
                self._forget(key)
                self._objects[key] = hot
                self._hold(key, holding)
            self._evict()
            return True

    def drop(self, keys: Iterable[bytes]) -> int:
        """Forget `keys` (a failed check, a deleted entry); returns how many were held."""
        with self._lock:
            return sum(self._forget(key) for key in keys)

    def set_pinned(self, keys: Iterable[bytes]) -> None:
        """Make `keys` (held now or later) the pinned set, replacing the previous one."""
        with self._lock:
            self._pinned = frozenset(keys)
            self._evict()

    def stats(self) -> MemoryStats:
        """Bytes, objects and evictions."""
        with self._lock:
            pinned_shared = {id(j): j for k in self._objects if k in self._pinned for j in self._held[k][1]}
            pinned = sum(self._held[k][0] for k in self._objects if k in self._pinned) \
                + sum(j.nbytes for j in pinned_shared.values())
            return MemoryStats(self._bytes, len(self._objects), pinned, self.budget_bytes, self._evictions)

    def _hold(self, key: bytes, holding: tuple[int, tuple[Joined, ...]]) -> None:
        own, shared = holding
        self._held[key] = holding
        self._bytes += own
        for j in shared:
            found = self._shared.get(id(j))
            if found is None:
                self._bytes += j.nbytes
            self._shared[id(j)] = (j, 1 if found is None else found[1] + 1)

    def _forget(self, key: bytes) -> bool:
        if self._objects.pop(key, None) is None:
            return False
        own, shared = self._held.pop(key)
        self._bytes -= own
        for j in shared:
            _, count = self._shared[id(j)]
            if count == 1:
                del self._shared[id(j)]
                self._bytes -= j.nbytes
            else:
                self._shared[id(j)] = (j, count - 1)
        return True

    def _evict(self) -> None:
        if self._bytes <= self.budget_bytes:
            return
        for key in [k for k in self._objects if k not in self._pinned]:  # LRU order
            self._forget(key)
            self._evictions += 1
            if self._bytes <= self.budget_bytes:
                return
