"""The memory tier (tqstore.store.tiers.memory): byte budget, LRU, pins, threads."""

from __future__ import annotations

import hashlib
import threading

import mlx.core as mx

from tqstore.format.blocks import SharedCodecs, Window
from tqstore.format.objects import Provenance
from tqstore.store.tiers.memory import HotObject, MemoryTier, decoded_nbytes
from turboquant.records import LayerRecord, Layout


def key(i) -> bytes:
    return hashlib.sha256(str(i).encode()).digest()


def hot(nbytes: int) -> HotObject:
    """A window whose one raw layer holds `nbytes` bytes of float32."""
    a = mx.zeros((1, 1, nbytes // 16, 4), dtype=mx.float32)
    obj = Window([LayerRecord(Layout.RAW, nbytes // 16, {"keys": a, "values": mx.zeros((1, 1, 0, 4))},
                              {"class": "KVCache"})])
    return HotObject(obj, "window", Provenance(), "0" * 64, decoded_nbytes(obj))


def test_nbytes_of_decoded_objects():
    assert hot(1600).nbytes == 1600
    assert decoded_nbytes(SharedCodecs({})) == 0


def test_lru_under_the_budget():
    tier = MemoryTier(1000)
    for i in range(3):
        assert tier.put(key(i), hot(320))
    assert tier.stats().bytes == 960
    tier.get(key(0))  # now 1 is the least recently used
    tier.put(key(3), hot(320))
    assert not tier.has(key(1)) and all(tier.has(key(i)) for i in (0, 2, 3))
    stats = tier.stats()
    assert (stats.bytes, stats.objects, stats.evictions) == (960, 3, 1)


def test_replacing_a_key_counts_its_bytes_once():
    tier = MemoryTier(1000)
    tier.put(key(0), hot(320))
    tier.put(key(0), hot(480))
    assert (tier.stats().bytes, tier.stats().objects) == (480, 1)


def test_an_object_larger_than_the_budget_is_not_held():
    tier = MemoryTier(1000)
    tier.put(key(0), hot(320))
    assert not tier.put(key(1), hot(1600))
    assert tier.has(key(0)) and not tier.has(key(1))


def test_pins_survive_the_budget():
    tier = MemoryTier(1000)
    tier.set_pinned([key(0), key(9)])
    assert tier.put(key(0), hot(640))
    assert tier.put(key(9), hot(1600))  # pinned: kept even over the budget
    tier.put(key(1), hot(320))
    assert tier.has(key(0)) and tier.has(key(9)) and not tier.has(key(1))
    assert tier.stats().pinned_bytes == 2240
    tier.set_pinned([key(0)])  # unpinning evicts down to the budget
    assert tier.has(key(0)) and not tier.has(key(9))


def test_drop():
    tier = MemoryTier(1000)
    tier.put(key(0), hot(320))
    assert tier.drop([key(0), key(1)]) == 1 and tier.stats().bytes == 0 and tier.get(key(0)) is None


def test_threads():
    tier = MemoryTier(16 * 320)
    objects = [hot(320) for _ in range(4)]
    errors = []

    def work(t):
        try:
            for i in range(300):
                k = key((t * 7 + i) % 40)
                tier.put(k, objects[i % 4])
                tier.get(key(i % 40))
                if i % 50 == 0:
                    tier.drop([k])
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stats = tier.stats()
    assert not errors and stats.bytes == 320 * stats.objects <= 16 * 320
