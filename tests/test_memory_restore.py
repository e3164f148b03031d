"""A restore from the memory tier is a slice of arrays kept there (issue 28): what a put or a
restore joined stays in memory as the joined arrays, the blocks as views of them; restoring it
again (or a prefix of it) copies nothing, counts its bytes once, and the caches built from it
never change it, however they decode."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from test_blocks import HETEROGENEOUS, assert_same_array, assert_same_snapshot, make_snapshot
from test_store import (CODEC, MODEL, decode_logits, open_store, put, reopen, stored_model_entry, token_ids)
from tqstore.format.blocks import Joined
from turboquant import restore
from turboquant.records import Layout


def address(a: mx.array) -> int:
    """Where an evaluated array's first element lies in memory (numpy shares MLX's buffer)."""
    return np.asarray(a).__array_interface__["data"][0]


def copies(snap) -> list[np.ndarray]:
    return [np.array(a) for a in snap.arrays()]


def same_bytes(snap, before: list[np.ndarray]) -> bool:
    return all(np.array_equal(np.asarray(a), b) for a, b in zip(snap.arrays(), before, strict=True))


def resident(store, manifest) -> list[Joined]:
    """The joined groups the memory tier's blocks of `manifest` are views of."""
    found = {}
    for ref in manifest.blocks:
        for g in store._tiers.memory.get(ref.key).obj.layers.groups:
            found[id(g.base)] = g.base
    return list(found.values())


def test_a_restore_from_memory_is_a_slice_of_what_the_put_joined(tmp_path):
    store = open_store(tmp_path / "home")
    snap, tokens = make_snapshot(600, layouts=[Layout.RAW, Layout.TURBO], seed=4), token_ids(600)
    result = put(store, "e", snap, tokens)
    bases = resident(store, result.manifest)
    assert bases and None not in bases, "every block of the put is a view of a joined group"
    # counted once: the tier holds the joined groups and the window's and codecs' arrays, no copy per block
    held = store._tiers.memory.stats().bytes
    assert held == sum(j.nbytes for j in bases) + sum(
        store._tiers.memory.get(k).nbytes for k in (result.manifest.window.key, result.manifest.shared.key))
    first, stats = store.load("e")
    again, _ = store.load("e")
    assert stats.tier == "memory" and store._tiers.memory.stats().bytes == held
    assert_same_snapshot(first, snap)
    assert [address(a) for a in first.arrays()] == [address(a) for a in again.arrays()] \
        == [address(a) for a in result.snapshot.arrays()], "the restore copied the arrays"
    store.close()


def test_a_restore_from_lmdb_is_kept_joined_and_then_restores_as_a_slice(tmp_path):
    store = open_store(tmp_path / "home")
    snap, tokens = make_snapshot(600, layouts=[Layout.RAW, Layout.TURBO], seed=4), token_ids(600)
    put(store, "e", snap, tokens)
    store = reopen(store)
    from_lmdb, stats = store.load("e")
    from_memory, again = store.load("e")
    assert (stats.tier, again.tier) == ("lmdb", "memory")
    assert_same_snapshot(from_memory, snap)
    assert [address(a) for a in from_lmdb.arrays()] == [address(a) for a in from_memory.arrays()]
    store.close()


def test_a_prefix_of_a_kept_join_is_copied_out_of_it(tmp_path):
    """A prefix of the blocks kept in memory is restored as row-contiguous arrays (a layer's view
    of a token slice would be strided: kernels would copy it at every step); memory keeps the
    whole join as it was."""
    store = open_store(tmp_path / "home")
    snap, tokens = make_snapshot(600, layouts=[Layout.RAW, Layout.RAW]), token_ids(600)
    result = put(store, "e", snap, tokens)
    held = store._tiers.memory.stats().bytes
    match = store.lookup(tokens[:512] + token_ids(100, seed=5), model=MODEL.digest, codec=CODEC.digest)
    prefix, stats = store.restore(match)
    assert (stats.tier, stats.tokens) == ("memory", 512)
    for got, whole in zip(prefix.layers, result.snapshot.layers):
        for name, a in got.arrays.items():
            assert_same_array(a, whole.arrays[name][:, :, :512], name)
            assert np.asarray(a).flags.c_contiguous
    assert store._tiers.memory.stats().bytes == held
    again, stats = store.load("e")
    assert stats.tier == "memory" and [address(a) for a in again.arrays()] == [
        address(a) for a in result.snapshot.arrays()]
    store.close()


def test_blocks_that_do_not_fit_the_budget_together_are_not_kept(tmp_path):
    store = open_store(tmp_path / "home", memory_budget_bytes=40_000)
    snap, tokens = make_snapshot(600, layouts=[Layout.RAW, Layout.RAW]), token_ids(600)
    assert snap.nbytes > 40_000
    result = put(store, "e", snap, tokens)
    memory = store._tiers.memory
    assert not any(memory.has(ref.key) for ref in result.manifest.blocks)
    assert memory.stats().bytes <= 40_000
    loaded, stats = store.load("e")
    assert stats.tier == "lmdb"
    assert_same_snapshot(loaded, snap)
    store.close()


@pytest.mark.parametrize("scheme", ["turbo4", "raw"])
def test_caches_restored_from_memory_never_change_what_memory_holds(tmp_path, scheme):
    """Decoding appends to the restored caches (and a TurboQuant cache compresses its tail):
    the arrays kept in memory, and every later restore from them, stay as they were."""
    store = open_store(tmp_path / "home")
    model, prompt, caches, snap, model_id, codec_id = stored_model_entry(scheme, n=300)
    tokens = prompt[:-1].tolist()
    store.put("tiny", snap, tokens, model=model_id, codec=codec_id, model_ref="tiny", prefill_seconds=0.1)
    kept, stats = store.load("tiny")
    assert stats.tier == "memory"
    before = copies(kept)
    expected = decode_logits(model, caches, prompt[-1:], steps=3)
    for prefix in (300, 256):  # the whole entry, and a prefix: a view of part of the kept arrays
        match = store.lookup(tokens[:prefix] + [7] * (300 - prefix), model=model_id.digest, codec=codec_id.digest)
        restored, stats = store.restore(match)
        assert (stats.tier, stats.tokens) == ("memory", prefix)
        restored_caches = restore(restored)
        logits = decode_logits(model, restored_caches, prompt[-1:], steps=3)
        if prefix == 300:
            assert all(mx.array_equal(a, b).item() for a, b in zip(expected, logits))
        for c in restored_caches:
            if hasattr(c, "compress"):
                c.compress()
        decode_logits(model, restored_caches, prompt[-1:], steps=16)
        assert same_bytes(kept, before), "a restored cache wrote into the arrays kept in memory"
    again, stats = store.load("tiny")
    assert stats.tier == "memory" and same_bytes(again, before)
    store.close()


@pytest.mark.parametrize("layouts, seed, joined", [
    ([Layout.RAW, Layout.RAW], 0, True),  # a KVCache layer, and an uncompressed TurboQuant one calibrated in block 0
    ([Layout.RAW, Layout.RAW], 1, True),
    ([Layout.TURBO, Layout.CALIBRATED], 1, True),  # compressed to the last token, per-block key means
    (HETEROGENEOUS, 0, False),  # layers whose last blocks differ (raw tails): joined layer by layer, as before
])
def test_blocks_read_from_lmdb_are_decoded_into_one_joined_array(tmp_path, layouts, seed, joined):
    """An LMDB restore decodes each block's groups straight into their slice of one joined
    array per name (calibration and per-block rows included), bit for bit; a restore mixing
    blocks from memory and from LMDB joins them as well."""
    store = open_store(tmp_path / "home")
    snap, tokens = make_snapshot(700, layouts=layouts, seed=seed), token_ids(700)
    m = put(store, "e", snap, tokens).manifest
    store = reopen(store)
    loaded, stats = store.load("e")
    assert stats.objects == {"lmdb": 5}
    assert_same_snapshot(loaded, snap)
    bases = {}
    for ref in m.blocks:  # every block's groups are consecutive views of one joined group per name
        for g in store._tiers.memory.get(ref.key).obj.layers.groups:
            base, stop = bases.get(g.name, (g.base, 0))
            assert (g.base is base is not None and g.start == stop) == joined
            bases[g.name] = (base, g.stop)
    store._tiers.memory.drop([m.blocks[1].key])
    mixed, stats = store.load("e")
    assert stats.objects == {"memory": 4, "lmdb": 1}
    assert_same_snapshot(mixed, snap)
    store.close()


def test_blocks_joined_layer_by_layer_are_kept_as_each_fits(tmp_path):
    """Blocks that share no joined array (their layers differ block to block) are kept one by
    one, as many as the budget holds, as before."""
    snap, tokens = make_snapshot(700, layouts=HETEROGENEOUS), token_ids(700)
    store = open_store(tmp_path / "home", memory_budget_bytes=snap.nbytes // 2)
    m = put(store, "e", snap, tokens).manifest
    held = [store._tiers.memory.has(ref.key) for ref in m.blocks]
    assert any(held) and not all(held)
    loaded, stats = store.load("e")
    assert set(stats.objects) == {"memory", "lmdb"}
    assert_same_snapshot(loaded, snap)
    store.close()
