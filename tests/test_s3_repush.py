"""The remedy a damaged bucket pack's error names works: `rm --remote` then `push` from a machine
that has the entry writes a sound pack in place of the damaged one (same name: it is named by
its index), so a pull from a fresh home restores the entry bit-exact; a sound pack left in the
bucket (a push cut off, or an entry removed and pushed again) is still not sent again. Against a
real S3 server (moto, `s3` fixture), plain and encrypted buckets."""

from __future__ import annotations

import base64
import hashlib
import os

import pytest

from test_blocks import assert_same_snapshot, make_snapshot
from test_store import PLAIN, put, token_ids
from test_store_s3 import bucket_keys, count_puts, s3_store
from tqstore.errors import CorruptBlock
from tqstore.store import crypto


def _encrypt(monkeypatch) -> None:
    monkeypatch.setenv(crypto.KEY_ENV, base64.b64encode(bytes(range(32))).decode())


@pytest.mark.parametrize("encrypted, same_store", [(False, False), (False, True), (True, False)],
                         ids=["plain", "plain-same-store", "encrypted"])
def test_rm_remote_then_push_replaces_a_damaged_pack(s3, tmp_path, monkeypatch, encrypted, same_store):
    if encrypted:
        _encrypt(monkeypatch)
    snap, tokens = make_snapshot(600, layouts=PLAIN), token_ids(600)  # 2 blocks, window, codecs: one pack
    a = s3_store(tmp_path / "a", s3)
    put(a, "p", snap, tokens)
    a.push("p")
    m = a.get("p")
    packs = bucket_keys(s3, "kv/packs/")
    assert len(packs) == 1
    s3.damage(a._tiers.s3, "p", m.blocks[1].key)  # one byte in the middle of a member, metadata kept
    b = s3_store(tmp_path / "b", s3)
    with pytest.raises(CorruptBlock, match=m.blocks[1].key.hex()):
        b.pull("p")
    b.close()

    a.rm("p", remote=True)  # what the error says: remove the entry from the bucket, push it again
    if not same_store:  # another process on the machine that has the entry (the CLI)
        a.close()
        a = s3_store(tmp_path / "a", s3)
    puts = count_puts(a)
    stats = a.push("p")
    assert (stats.transferred, stats.skipped) == (len(m.objects), 0)  # the pack went up again
    assert puts["packs"] == 1 and bucket_keys(s3, "kv/packs/") == packs  # under its own name
    assert len(stats.warnings) == 1 and "sent again" in stats.warnings[0]

    c = s3_store(tmp_path / "c", s3)
    c.pull("p")
    assert_same_snapshot(c.load("p")[0], snap)  # every array bit-identical (array_equal) to the save
    assert c.verify() == [] and a.verify(remote=True) == []
    a.close()
    c.close()


@pytest.mark.parametrize("encrypted", [False, True], ids=["plain", "encrypted"])
def test_a_sound_pack_left_in_the_bucket_is_not_sent_again(s3, tmp_path, monkeypatch, encrypted):
    """As after a push cut off after its packs: the pack the push would write is there and
    sound (a HEAD shows its size and ETag; an encrypted one, whose bytes differ at every push,
    is read back and its members verified), so only the map and manifest go up."""
    if encrypted:
        _encrypt(monkeypatch)
    snap, tokens = make_snapshot(600, layouts=PLAIN), token_ids(600)
    a = s3_store(tmp_path / "a", s3)
    put(a, "p", snap, tokens)
    a.push("p")
    a.rm("p", remote=True)
    a.close()
    a = s3_store(tmp_path / "a", s3)
    puts = count_puts(a)
    stats = a.push("p")
    assert (stats.transferred, stats.skipped) == (0, len(a.get("p").objects))
    assert (puts["packs"], puts["manifests"]) == (0, 1) and stats.warnings == ()
    b = s3_store(tmp_path / "b", s3)
    b.pull("p")
    assert_same_snapshot(b.load("p")[0], snap)
    a.close()
    b.close()


@pytest.mark.parametrize("size", [1000, 11 * 1024 * 1024 + 17], ids=["one-put", "multipart"])
def test_the_etag_a_push_expects_is_the_one_the_server_gives(s3, size):
    """A kept pack is recognised by its ETag: the MD5 of its bytes for one PUT, the MD5 of the
    parts' MD5s for a multipart upload (a pack larger than a part), as `put_pack` sends them."""
    tier = s3.tier(part_size=5 * 1024 * 1024)
    body = os.urandom(size)
    name = hashlib.sha256(body).hexdigest()
    assert tier.put_pack(name, body)
    head = s3.client.head_object(Bucket=s3.bucket, Key=tier.pack_name(name))
    assert head["ETag"].strip('"') == tier.upload_etag(body)
    assert tier.pack_head(name) == (size, tier.upload_etag(body)) and tier.pack_head("ab" * 32) is None
    assert ("-" in head["ETag"]) == (size > tier.part_size)


def test_a_long_lived_store_pushes_again_after_another_machine_collected_its_entry(s3, tmp_path):
    """A server or notebook (one Store) pushed an entry; another machine removed it from the
    bucket and collected the bucket; the long-lived Store's next push must write the map again
    (it remembered writing it), or its manifest names a map that is gone."""
    snap, tokens = make_snapshot(600, layouts=PLAIN), token_ids(600)
    a = s3_store(tmp_path / "a", s3)
    put(a, "p", snap, tokens)
    a.push("p")
    c = s3_store(tmp_path / "c", s3)
    c.rm("p", remote=True)
    assert c.gc(remote=True, remote_grace=0).remote_maps == 1 and not bucket_keys(s3, "kv/")
    stats = a.push("p")
    assert stats.up_to_date == () and stats.transferred == len(a.get("p").objects)
    d = s3_store(tmp_path / "d", s3)
    d.pull("p")
    assert_same_snapshot(d.load("p")[0], snap)
    assert d.verify(remote=True) == []
    puts = count_puts(a)
    assert a.push("p").up_to_date == ("p",) and sum(puts.values()) == 0  # the map read back, not sent again
    for store in (a, c, d):
        store.close()
