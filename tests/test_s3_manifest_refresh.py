"""A push of an entry the bucket holds as the same entry but not as it is here: with another
expiry or other metadata (re-saved with or without a TTL), expired in the bucket, or recording
copies of its objects that the bucket has lost. The push must bring the bucket's manifest to the
local one (conditionally) and leave an entry every machine can pull; "up to date" only when
nothing differs. Against a real S3 server (moto, `s3` fixture)."""

from __future__ import annotations

import time

import pytest

from test_blocks import assert_same_snapshot, make_snapshot
from test_store import PLAIN, put, token_ids
from test_store_s3 import _packs_of, bucket_keys, count_puts, s3_store
from tqstore.errors import NotFound


def test_a_push_brings_the_bucket_copy_to_the_local_expiry_and_metadata(s3, tmp_path):
    snap, tokens = make_snapshot(600, layouts=PLAIN), token_ids(600)
    a = s3_store(tmp_path / "a", s3)
    put(a, "e", snap, tokens, ttl=0.5)
    a.push("e")
    put(a, "e", snap, tokens)  # the same document again, now without a TTL
    stats = a.push("e")
    assert stats.up_to_date == () and stats.transferred == 0  # only the manifest (and its map) written
    assert a.info("e", remote=True).expires is None
    put(a, "e", snap, tokens, ttl=3600, metadata={"file": "contract.txt"})
    assert a.push("e").up_to_date == ()
    remote = a.info("e", remote=True)
    assert remote.expires == a.get("e").expires and remote.metadata == {"file": "contract.txt"}
    puts = count_puts(a)
    assert a.push("e").up_to_date == ("e",) and sum(puts.values()) == 0  # now nothing differs
    a.close()


def test_an_expired_bucket_copy_is_never_up_to_date(s3, tmp_path):
    snap, tokens = make_snapshot(600, layouts=PLAIN), token_ids(600)
    a = s3_store(tmp_path / "a", s3)
    put(a, "e", snap, tokens, ttl=0.3)
    a.push("e")
    time.sleep(0.4)  # expired in the bucket, and here
    put(a, "e", snap, tokens, ttl=3600)
    assert a.push("e").up_to_date == ()
    b = s3_store(tmp_path / "b", s3)
    b.pull("e")  # before: NotFound, "expired ... push it again", and that push was "up to date"
    assert_same_snapshot(b.load("e")[0], snap)
    a.close()
    b.close()


def test_a_push_again_heals_an_entry_whose_bucket_manifest_names_a_lost_copy(s3, tmp_path):
    """Machine B saved `longer`; A pushed `short`, whose first block has the same key (another
    prefill's bytes); B's push of `longer` reused A's copy of that block. A's pack is lost: the
    error says to push the entry again from a machine that has it, and B's push must then send
    its own copy and replace the manifest (it named A's), so that the entry pulls."""
    tokens = token_ids(600)
    b = s3_store(tmp_path / "b", s3)
    longer = make_snapshot(900, layouts=PLAIN, seed=4)
    put(b, "longer", longer, tokens[:256] + token_ids(644, seed=1))
    a = s3_store(tmp_path / "a", s3)
    put(a, "short", make_snapshot(600, layouts=PLAIN), tokens)
    a.push("short")
    assert b.push("longer").skipped == 2  # A's block 0 and codecs
    assert b.info("longer", remote=True).name == "longer"
    for key in bucket_keys(s3, "kv/packs/"):
        if key.rpartition("/")[2] in _packs_of(a, s3, "short"):
            s3.client.delete_object(Bucket=s3.bucket, Key=key)
    c = s3_store(tmp_path / "c", s3)
    with pytest.raises(NotFound, match="push the entry again"):
        c.pull("longer")
    stats = b.push("longer")
    assert stats.up_to_date == () and stats.transferred == 2
    assert c.verify("longer", remote=True) == []
    c.pull("longer")
    assert_same_snapshot(c.load("longer")[0], b.load("longer")[0])
    puts = count_puts(b)
    assert b.push("longer").up_to_date == ("longer",) and sum(puts.values()) == 0
    for store in (a, b, c):
        store.close()
