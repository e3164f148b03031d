"""The store on CUDA (issue 28). MLX's CUDA arrays live in managed memory, so a put reads its
groups from a copy joined on the device (a host read of the snapshot's own arrays would move a
live cache's pages to the host) and the arrays a put or a restore builds on the host are moved
to the device before anything reads them. Whatever path the bytes take, a put keeps the
snapshot it was given unchanged, writes the same objects, and both tiers give it back bit for
bit. The managed-memory path also runs here on the CPU (forced), against the unified one."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from test_blocks import assert_same_snapshot, make_snapshot
from test_store import open_store, put, reopen, token_ids
from tqstore.format import runs
from turboquant.records import Layout


def raw_bytes(snap) -> list[bytes]:
    """Every array's bytes (the snapshots hold NaN and infinities: compared as bytes)."""
    return [np.array(a).tobytes() for a in snap.arrays()]


def put_and_restore(home, snap, tokens) -> dict[bytes, bytes]:
    """Put `snap`, check it unchanged and restored bit for bit from both tiers; the objects'
    stored bytes by key."""
    store = open_store(home)
    before = raw_bytes(snap)
    manifest = put(store, "e", snap, tokens).manifest
    assert raw_bytes(snap) == before, "the put changed the snapshot it stored"
    from_memory, stats = store.load("e")
    assert stats.tier == "memory"
    assert_same_snapshot(from_memory, snap)
    store = reopen(store)
    from_lmdb, stats = store.load("e")
    assert stats.tier == "lmdb"
    assert_same_snapshot(from_lmdb, snap)
    stored = {ref.key: store._tiers.lmdb.get_object(ref.key) for ref in manifest.objects}
    store.close()
    return stored


@pytest.mark.gpu
@pytest.mark.parametrize("n_tokens", [600, 1_000])
def test_a_put_and_its_restores_on_the_gpu_are_bit_exact(tmp_path, n_tokens, on_gpu):
    assert runs.managed_memory() or not mx.cuda.is_available(), "the put would not take the managed-memory path"
    snap = make_snapshot(n_tokens, layouts=[Layout.RAW, Layout.TURBO], seed=5)
    put_and_restore(tmp_path / "home", snap, token_ids(n_tokens))


def test_the_managed_memory_path_writes_the_objects_the_unified_path_writes(tmp_path, monkeypatch):
    snap, tokens = make_snapshot(600, layouts=[Layout.RAW, Layout.TURBO], seed=5), token_ids(600)
    unified = put_and_restore(tmp_path / "unified", snap, tokens)
    monkeypatch.setattr(runs, "managed_memory", lambda: True)
    managed = put_and_restore(tmp_path / "managed", snap, tokens)
    assert managed.keys() == unified.keys() and len(unified) > 2
    assert all(managed[k] == unified[k] for k in unified), "the two paths wrote different bytes"
