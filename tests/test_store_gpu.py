"""The store on a GPU (issue 28). MLX's CUDA arrays live in managed memory, so a put reads its
groups from a copy joined on the device (a host read of the snapshot's own arrays would move a
live cache's pages to the host) and the arrays a put or a restore builds on the host are moved
to the device before anything reads them. Whatever path the bytes take, a put keeps the
snapshot it was given unchanged and both tiers give it back bit for bit."""

from __future__ import annotations

import numpy as np
import pytest

from test_blocks import assert_same_snapshot, make_snapshot
from test_store import open_store, put, reopen, token_ids
from turboquant.records import Layout

pytestmark = pytest.mark.gpu


def raw_bytes(snap) -> list[bytes]:
    """Every array's bytes (the snapshots hold NaN and infinities: compared as bytes)."""
    return [np.array(a).tobytes() for a in snap.arrays()]


@pytest.mark.parametrize("n_tokens", [600, 1_000])
def test_a_put_and_its_restores_on_the_gpu_are_bit_exact(tmp_path, n_tokens):
    store = open_store(tmp_path / "home")
    snap, tokens = make_snapshot(n_tokens, layouts=[Layout.RAW, Layout.TURBO], seed=5), token_ids(n_tokens)
    before = raw_bytes(snap)
    put(store, "e", snap, tokens)
    assert raw_bytes(snap) == before, "the put changed the snapshot it stored"
    from_memory, stats = store.load("e")
    assert stats.tier == "memory"
    assert_same_snapshot(from_memory, snap)
    store = reopen(store)
    from_lmdb, stats = store.load("e")
    assert stats.tier == "lmdb"
    assert_same_snapshot(from_lmdb, snap)
    store.close()
