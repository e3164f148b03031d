"""The memory tier (tqstore.store.tiers.memory): byte budget, LRU, pins, threads."""

from __future__ import annotations

import hashlib
import threading

import mlx.core as mx

from tqstore.format.blocks import ArrayGroup, Block, GroupedLayers, Joined, SharedCodecs, Window
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


def joined_blocks(n: int, tokens: int = 4) -> tuple[Joined, list[HotObject]]:
    """`n` blocks of one raw layer whose arrays are views of one joined group (as a join leaves them)."""
    base = Joined(mx.zeros((1, 1, 1, n * tokens, 4), dtype=mx.float32))
    shells = {0: LayerRecord(Layout.RAW, tokens, {"keys": None}, {"class": "KVCache"})}
    out = []
    for b in range(n):
        view = base.data[:, :, :, b * tokens:(b + 1) * tokens]
        block = Block(b, b * tokens, tokens, GroupedLayers(shells, (ArrayGroup("keys", (0,), view, base,
                                                                                   b * tokens, (b + 1) * tokens),)))
        out.append(HotObject(block, "block", Provenance(), "0" * 64, decoded_nbytes(block)))
    return base, out


def test_blocks_viewing_one_joined_group_count_it_once():
    base, blocks = joined_blocks(3)
    assert base.nbytes == 3 * 64 and all(h.nbytes == 64 for h in blocks)
    tier = MemoryTier(1000)
    assert tier.put_all([(key(i), h) for i, h in enumerate(blocks)])
    assert tier.stats().bytes == base.nbytes
    tier.put(key(1), blocks[1])  # held again: still once
    assert tier.drop([key(0), key(1)]) == 2 and tier.stats().bytes == base.nbytes  # block 2 still holds it
    assert tier.drop([key(2)]) == 1 and tier.stats().bytes == 0


def test_a_joined_group_goes_with_the_last_block_evicted():
    base, blocks = joined_blocks(2, tokens=128)  # 2 x 2048 bytes
    tier = MemoryTier(5000)
    assert tier.put_all([(key(i), h) for i, h in enumerate(blocks)])
    tier.put(key(9), hot(1600))  # over the budget: both blocks go (the first alone frees nothing)
    assert not tier.has(key(0)) and not tier.has(key(1)) and tier.has(key(9))
    assert (tier.stats().bytes, tier.stats().evictions) == (1600, 2)


def test_blocks_larger_than_the_budget_together_are_not_held():
    _, blocks = joined_blocks(4, tokens=64)  # 4 KiB together, 1 KiB each
    tier = MemoryTier(3000)
    tier.put(key(9), hot(320))
    assert not tier.put_all([(key(i), h) for i, h in enumerate(blocks)])
    assert tier.has(key(9)) and not any(tier.has(key(i)) for i in range(4)) and tier.stats().bytes == 320
    tier.set_pinned([key(i) for i in range(4)])  # pinned: held even over the budget
    assert tier.put_all([(key(i), h) for i, h in enumerate(blocks)]) and tier.stats().pinned_bytes == 4096
