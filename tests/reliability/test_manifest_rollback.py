"""A replayed older manifest in an encrypted bucket is refused (issue 19, finding 10), with the
real moto S3 server. AES-GCM binds a manifest to its entry name; the sealed manifest now also
carries a version each push raises, and every machine remembers the highest version it has seen
per entry. Push v1, push v2, put v1's ciphertext back in place: pulls on machines that saw v2
are refused with a rollback error and their entries stay v2; the owner recovers with
`rm --remote` and a new push. A machine that never saw v2 cannot tell (docs/reliability.md).
"""

from __future__ import annotations

import base64

import pytest

from harness import open_store, s3_settings
from tqstore.store import crypto
from tqstore.errors import ConflictError
from workers import put, snapshot_digest

KEY = base64.b64encode(bytes(range(32))).decode()


def _entry(store, name: str) -> tuple[tuple[int, ...], str]:
    snap, _ = store.load(name)
    return tuple(store.get(name).tokens), snapshot_digest(snap)


def test_a_replayed_older_manifest_is_refused(s3, tmp_path, monkeypatch, ledger):
    monkeypatch.setenv(crypto.KEY_ENV, KEY)
    owner = open_store(tmp_path / "owner", **s3_settings(s3))
    reader = open_store(tmp_path / "reader", **s3_settings(s3))
    key = owner._tiers.s3.manifest_name("doc")

    put(owner, "doc", 300, 1)
    put(owner, "other", 200, 3)
    owner.push()
    v1 = s3.client.get_object(Bucket=s3.bucket, Key=key)
    v1_body, v1_meta = v1["Body"].read(), v1["Metadata"]
    reader.pull("doc")
    put(owner, "doc", 300, 2)  # the same name saved again: other tokens
    owner.push("doc")
    reader.pull("doc")
    v2 = _entry(owner, "doc")
    assert _entry(reader, "doc") == v2

    # A bucket writer (or a restored backup) puts v1's ciphertext back: still authentic, but old.
    s3.client.put_object(Bucket=s3.bucket, Key=key, Body=v1_body, Metadata=v1_meta)
    for label, store in (("reader", reader), ("owner", owner)):
        with pytest.raises(crypto.ManifestRollback, match=r"version \d+ of entry doc's manifest.*seen version \d+"):
            store.pull("doc")
        assert _entry(store, "doc") == v2  # nothing overwritten
        ledger.count("encryption at rest/replayed manifest", f"pull refused, entry kept ({label})")
    with pytest.raises((crypto.ManifestRollback, ConflictError)):
        owner.push("doc")  # told about the rollback (or a conflict), never to pull the old entry
    ledger.count("encryption at rest/replayed manifest", "push refused")
    # Listings leave the rolled-back manifest out (and show the rest); a remote gc, which
    # would otherwise delete v2's objects as unreferenced, deletes nothing.
    assert [e.name for e in reader.ls(remote=True)] == ["other"]
    stats = reader.gc(remote=True, remote_grace=0)
    assert stats.remote_orphans == 0 and "doc" in stats.notes[0], stats
    ledger.count("encryption at rest/replayed manifest", "ls --remote shows the rest, remote gc deletes nothing")

    # The owner recovers: drop the bucket's copy, push again; the reader takes the new version.
    owner.rm("doc", remote=True)
    owner.push("doc")
    reader.pull("doc")
    assert _entry(reader, "doc") == v2
    ledger.count("encryption at rest/replayed manifest", "recovered by rm --remote and push")

    # A machine that has never seen the entry cannot tell a replay: it takes what the bucket has.
    s3.client.put_object(Bucket=s3.bucket, Key=key, Body=v1_body, Metadata=v1_meta)
    fresh = open_store(tmp_path / "fresh", **s3_settings(s3))
    fresh.pull("doc")
    assert _entry(fresh, "doc") != v2
    ledger.count("encryption at rest/replayed manifest", "a machine that never saw v2 takes v1 (documented)")
    for store in (owner, reader, fresh):
        store.close()


def test_a_new_entry_under_a_removed_name_is_no_rollback(s3, tmp_path, monkeypatch):
    """Versions counted per machine restarted at 1 on a machine that never saw the name: after
    `rm --remote` (or expiry and `gc --remote`), its new entry was refused as a rollback by
    every machine that had seen the old one, whose advice (rm --remote) would destroy it."""
    monkeypatch.setenv(crypto.KEY_ENV, KEY)
    owner, reader, other = (open_store(tmp_path / who, **s3_settings(s3)) for who in ("owner", "reader", "other"))
    for seed in (1, 2, 3):  # three versions of doc
        put(owner, "doc", 300, seed)
        owner.push("doc")
    reader.pull("doc")
    reader.rm("doc", remote=True)
    put(other, "doc", 200, 5)  # another document under the same name, from a machine that never saw doc
    other.push("doc")
    for store in (reader, owner):
        store.rm("doc")
        store.pull("doc")
        assert _entry(store, "doc") == _entry(other, "doc")
    for store in (owner, reader, other):
        store.close()


def test_versions_without_a_versions_file_and_after_one(tmp_path):
    """A cipher that keeps no versions seals by the clock; one that does refuses what is older
    than the highest it has seen. (Manifests sealed by a tqstore before issue 27, without their
    address, are refused: test_manifest_binding.py.)"""
    where = "s3://b/manifests/doc.json"
    plain = crypto.ObjectCipher(base64.b64decode(KEY), "a test key")
    sealed = plain.seal(b'{"first": true}', "manifest", "doc", where)
    versioned = crypto.ObjectCipher(base64.b64decode(KEY), "a test key",
                                    crypto.ManifestVersions(tmp_path / crypto.VERSIONS_FILE, "s3://b/"))
    assert versioned.open(sealed, "manifest", "doc", where) == b'{"first": true}'
    newer = versioned.seal(b"{}", "manifest", "doc", where)
    versioned.written(newer, "manifest", "doc", where)
    with pytest.raises(crypto.ManifestRollback):
        versioned.open(sealed, "manifest", "doc", where)
