"""Encryption at rest for the cold tier (tqstore/store/crypto.py): AES-256-GCM envelopes, client-side.

Off by default (the bucket then holds plaintext objects and manifests carrying the document's
tokens in clear). With TQSTORE_S3_KEY or s3.key_file: nothing readable reaches the bucket, the
key never does, a pull with the same key loads identically, a wrong or missing key is a clear
EncryptionKeyError naming where the key came from, and a tampered, truncated, moved or
unencrypted object is a miss with a reason.
"""

from __future__ import annotations

import base64
import os

import pytest

from harness import open_store, s3_settings
from test_blocks import assert_same_snapshot
from tqstore.store import crypto
from tqstore.format import objects as F
from tqstore.errors import ConfigError, CorruptBlock, RemoteAuthError
from workers import put

KEY = base64.b64encode(bytes(range(32))).decode()
OTHER_KEY = base64.b64encode(bytes(range(1, 33))).decode()


def bucket_objects(s3) -> dict[str, tuple[bytes, dict]]:
    """Every object of the bucket: its bytes and metadata, read without tqstore."""
    out = {}
    for page in s3.client.get_paginator("list_objects_v2").paginate(Bucket=s3.bucket):
        for item in page.get("Contents", []):
            got = s3.client.get_object(Bucket=s3.bucket, Key=item["Key"])
            out[item["Key"]] = (got["Body"].read(), got["Metadata"])
    return out


@pytest.fixture
def pushed(s3, tmp_path, monkeypatch):
    """Entries "a" and "b" pushed with encryption on (key from the environment)."""
    monkeypatch.setenv(crypto.KEY_ENV, KEY)
    store = open_store(tmp_path / "origin", **s3_settings(s3))
    snaps = {n: put(store, n, k, seed).snapshot for n, k, seed in (("a", 600, 1), ("b", 300, 2))}
    for name in snaps:
        store.push(name)
    tokens = store.get("a").tokens
    store.close()
    return snaps, tokens


def test_off_by_default_the_bucket_holds_plaintext(s3, tmp_path, ledger):
    store = open_store(tmp_path / "home", **s3_settings(s3))
    put(store, "a", 300, 1)
    store.push("a")
    tokens = store.get("a").tokens
    store.close()
    objects = bucket_objects(s3)
    manifest = next(body for key, (body, _) in objects.items() if key.endswith("a.json"))
    assert str(list(tokens[:8]))[1:-1].replace(" ", "") in manifest.decode()  # the tokens, in clear
    packs = [body for key, (body, _) in objects.items() if "/packs/" in key]
    assert packs and all(body.startswith(F.MAGIC) and b"tqstore-pack" in body for body in packs)
    ledger.count("encryption at rest", "off by default: manifests carry the tokens in clear", 1)


def test_pushed_with_a_key_nothing_readable_reaches_the_bucket(s3, tmp_path, pushed, ledger):
    snaps, tokens = pushed
    objects = bucket_objects(s3)
    assert objects
    needle = ",".join(map(str, tokens[:8])).encode()
    raw_key = base64.b64decode(KEY)
    for name, (body, meta) in objects.items():
        assert body.startswith(crypto.MAGIC) and meta["tq-enc"] == crypto.SCHEME, name
        assert needle not in body and F.MAGIC not in body and b"tqstore" not in body[len(crypto.MAGIC):], name
        assert raw_key not in body and KEY.encode() not in body and KEY not in str(meta), name
    reader = open_store(tmp_path / "reader", **s3_settings(s3))
    for name, snap in snaps.items():
        reader.pull(name)
        assert_same_snapshot(reader.load(name)[0], snap)
    assert [e.name for e in reader.ls(remote=True)] == ["a", "b"]
    reader.close()
    ledger.count("encryption at rest", "objects and manifests sealed (no plaintext, no key in the bucket)",
                 len(objects))
    ledger.count("encryption at rest", "entries pulled with the key and loaded identically", len(snaps))


def test_the_key_file_works_and_the_variable_wins(s3, tmp_path, pushed, monkeypatch):
    snaps, _ = pushed
    key_file = tmp_path / "s3.key"
    key_file.write_text(KEY + "\n")
    monkeypatch.delenv(crypto.KEY_ENV)
    reader = open_store(tmp_path / "reader", **s3_settings(s3, s3_key_file=str(key_file)))
    reader.pull("a")
    assert_same_snapshot(reader.load("a")[0], snaps["a"])
    reader.close()
    monkeypatch.setenv(crypto.KEY_ENV, OTHER_KEY)  # the variable wins over the file
    other = open_store(tmp_path / "other", **s3_settings(s3, s3_key_file=str(key_file)))
    with pytest.raises(crypto.EncryptionKeyError, match=crypto.KEY_ENV):
        other.pull("a")
    other.close()


def test_a_wrong_or_missing_key_is_a_clear_error(s3, tmp_path, pushed, monkeypatch, ledger):
    key_file = tmp_path / "wrong.key"
    key_file.write_text(OTHER_KEY)
    monkeypatch.delenv(crypto.KEY_ENV)
    wrong = open_store(tmp_path / "wrong", **s3_settings(s3, s3_key_file=str(key_file)))
    with pytest.raises(crypto.EncryptionKeyError, match=f"another key than the one from {key_file}") as exc:
        wrong.pull("a")
    assert isinstance(exc.value, RemoteAuthError)
    with pytest.raises(crypto.EncryptionKeyError):
        wrong.ls(remote=True)
    assert wrong.ls() == [] and wrong.verify() == []
    wrong.close()
    none = open_store(tmp_path / "none", **s3_settings(s3))
    with pytest.raises(crypto.EncryptionKeyError, match="is encrypted.*TQSTORE_S3_KEY"):
        none.pull("b")
    none.close()
    ledger.count("encryption at rest", "wrong key: EncryptionKeyError naming the key file", 2)
    ledger.count("encryption at rest", "no key: EncryptionKeyError naming TQSTORE_S3_KEY", 1)


def test_a_push_with_another_key_or_none_writes_nothing(s3, tmp_path, pushed, monkeypatch, ledger):
    """Before: such a push replaced the entry's map (sealed with its key, or plaintext) and
    uploaded packs (plaintext without a key) before its manifest check failed, and a machine
    with the right key could no longer pull; a new entry went up readable into the prefix."""
    snaps, _ = pushed
    key_file = tmp_path / "wrong.key"
    key_file.write_text(OTHER_KEY)
    monkeypatch.delenv(crypto.KEY_ENV)
    before = bucket_objects(s3)
    for home, settings in (("wrong", {"s3_key_file": str(key_file)}), ("none", {})):
        store = open_store(tmp_path / home, **s3_settings(s3, **settings))
        try:
            put(store, "a", 600, 1)  # the same entry, as another machine saved it
            put(store, "new", 200, 3)
            for name in ("a", "new"):
                with pytest.raises(crypto.EncryptionKeyError, match="nothing was pushed"):
                    store.push(name)
        finally:
            store.close()
        assert bucket_objects(s3) == before, home
    monkeypatch.setenv(crypto.KEY_ENV, KEY)
    right = open_store(tmp_path / "right", **s3_settings(s3))
    try:
        right.pull("a")
        assert_same_snapshot(right.load("a")[0], snaps["a"])
    finally:
        right.close()
    ledger.count("encryption at rest", "push with another key or none: refused, the bucket untouched", 4)


def test_tampered_moved_and_plaintext_objects_are_misses(s3, tmp_path, pushed, monkeypatch, ledger):
    snaps, tokens = pushed
    reader = open_store(tmp_path / "reader", **s3_settings(s3))
    s3tier = reader._tiers.s3
    manifest = reader._tiers.remote_manifests(["a"])[0][0].manifest
    block1, block2 = manifest.blocks[1].key, manifest.blocks[2].key
    objects = bucket_objects(s3)
    name, start, end = s3.where(s3tier, "a", block1)  # block 1's envelope: a range of a pack
    pack, meta = objects[name]
    body1 = pack[start:end]
    plain = s3tier.cipher.open(body1, "object", block1.hex(), "x")
    cases = {  # what the pack holds in block 1's place
        "a flipped bit": body1[:100] + bytes([body1[100] ^ 1]) + body1[101:],
        "truncated": b"",  # the pack cut off half-way through it
        "another object's envelope": s3tier.cipher.seal(plain, "object", block2.hex(), "x"),  # same length
        "plaintext": F.MAGIC + b"\0" * (len(body1) - len(F.MAGIC)),
    }
    for label, body in cases.items():
        changed = pack[:start] + body + pack[end:] if body else pack[:(start + end) // 2]
        s3.client.put_object(Bucket=s3.bucket, Key=name, Body=changed, Metadata=meta)
        with pytest.raises(CorruptBlock, match=block1.hex()[:12]):
            reader.pull("a")
        reader._tiers.remote.note_objects([block1])
        match = reader.lookup(list(tokens) + [1], model=manifest.model_digest, codec=manifest.codec_digest)
        snap, stats = reader.restore(match)  # a miss: the prefix before the damaged block
        assert stats.tokens == 256 and any(block1.hex()[:12] in m for m in stats.misses), stats.misses
        assert not reader._tiers.remote.has(block1) and not reader._tiers.lmdb.has_object(block1)
        ledger.count("encryption at rest", f"{label} object: a miss with a reason (pull refused, prefix kept)")
    s3.client.put_object(Bucket=s3.bucket, Key=name, Body=pack, Metadata=meta)
    reader._tiers.remote.note_objects([block1])
    reader.pull("a")
    assert_same_snapshot(reader.load("a")[0], snaps["a"])
    # A tampered manifest: `ls --remote` lists the others, pull names it, nothing is collected.
    key = s3tier.manifest_name("b")
    body, meta = objects[key]
    s3.client.put_object(Bucket=s3.bucket, Key=key, Body=body[:-1] + bytes([body[-1] ^ 1]), Metadata=meta)
    assert [e.name for e in reader.ls(remote=True)] == ["a"]
    with pytest.raises(CorruptBlock, match="failed authentication"):
        reader.pull("b")
    stats = reader.gc(remote=True, remote_grace=0)
    assert stats.remote_orphans == 0 and "b" in stats.notes[0]
    reader.close()
    ledger.count("encryption at rest", "tampered manifest: others listed, pull refused, gc collects nothing", 1)


def test_the_envelope_binds_kind_and_name_and_works_multipart(s3, tmp_path):
    cipher = crypto.ObjectCipher(base64.b64decode(KEY), "a test key")
    sealed = cipher.seal(b"payload", "object", "ab" * 32, "s3://b/objects/ab/" + "ab" * 32)
    assert cipher.open(sealed, "object", "ab" * 32, "x") == b"payload"
    assert len(sealed) == len(b"payload") + crypto.OVERHEAD
    for kind, name in (("manifest", "ab" * 32), ("object", "cd" * 32)):
        with pytest.raises(CorruptBlock, match="failed authentication"):
            cipher.open(sealed, kind, name, "x")
    tier = s3.tier(cipher=cipher, multipart_threshold=64 << 10)  # a multipart upload of one 5 MiB part
    payload = os.urandom(300_000)
    key = bytes(range(32))
    assert tier.put_object(key, payload) and tier.get_object(key) == payload
    assert tier.object_info(key).size == len(payload) and not tier.put_object(key, payload)


@pytest.mark.parametrize("text", ["", "not base64!", base64.b64encode(b"short").decode()])
def test_a_bad_key_is_a_config_error_naming_its_source(text, s3, tmp_path, monkeypatch):
    # Raised by the first use of the bucket: local use goes on (test_a_missing_key_file_...).
    monkeypatch.setenv(crypto.KEY_ENV, text or " ")
    store = open_store(tmp_path / "home", **s3_settings(s3))
    with pytest.raises(ConfigError, match=crypto.KEY_ENV):
        store.ls(remote=True)
    store.close()
    monkeypatch.delenv(crypto.KEY_ENV)
    store = open_store(tmp_path / "home2", **s3_settings(s3, s3_key_file=str(tmp_path / "missing.key")))
    with pytest.raises(ConfigError, match="missing.key"):
        store.push()
    store.close()


def test_a_missing_key_file_stops_the_bucket_not_local_use(s3, tmp_path, monkeypatch):
    # With s3.url set and the key file gone, ls, info, ask, rm... all failed with the key's
    # ConfigError: the S3 tier built its cipher when the store opened.
    monkeypatch.delenv(crypto.KEY_ENV, raising=False)
    key_file = tmp_path / "k.key"
    key_file.write_text(KEY)
    settings = s3_settings(s3, s3_key_file=str(key_file))
    store = open_store(tmp_path / "home", **settings)
    snap = put(store, "a", 300, 1).snapshot
    store.close()
    key_file.unlink()
    store = open_store(tmp_path / "home", **settings)
    try:
        assert [e.name for e in store.ls()] == ["a"] and store.verify() == []
        assert_same_snapshot(store.load("a")[0], snap)
        for call in (lambda: store.push("a"), lambda: store.ls(remote=True), lambda: store.pull("a")):
            with pytest.raises(ConfigError, match="k.key"):
                call()
    finally:
        store.close()


def test_one_manifest_sealed_with_another_key_is_one_problem(s3, tmp_path, pushed, ledger):
    """Before: one such manifest made ls --remote, verify --remote and gc --remote raise
    EncryptionKeyError for every machine, naming only that entry, and no lookup found the others."""
    _, tokens = pushed
    objects = bucket_objects(s3)
    key = next(k for k in objects if k.endswith("manifests/b.json"))
    where = f"s3://{s3.bucket}/{key}"
    plain = crypto.ObjectCipher(base64.b64decode(KEY), "test").open(objects[key][0], "manifest", "b", where)
    resealed = crypto.ObjectCipher(base64.b64decode(OTHER_KEY), "test").seal(plain, "manifest", "b", where)
    s3.client.put_object(Bucket=s3.bucket, Key=key, Body=resealed, Metadata=objects[key][1])
    reader = open_store(tmp_path / "reader", **s3_settings(s3))
    try:
        manifest = reader._tiers.remote_manifests(["a"])[0][0].manifest
        match = reader.lookup(list(tokens) + [1], model=manifest.model_digest, codec=manifest.codec_digest)
        assert match is not None and match.entry == "a" and match.remote
        assert reader.stats().remote_error is None
        assert [e.name for e in reader.ls(remote=True)] == ["a"]
        problems = reader.verify(remote=True)
        assert [(p.entry, p.kind) for p in problems] == [("b", "remote_manifest")]
        assert "another key" in problems[0].detail
        before = bucket_objects(s3)
        stats = reader.gc(remote=True)
        assert any("b" in note and "another key" in note for note in stats.notes)
        assert bucket_objects(s3).keys() == before.keys()
        with pytest.raises(crypto.EncryptionKeyError, match="another key"):
            reader.info("b", remote=True)
    finally:
        reader.close()
    ledger.count("encryption at rest", "one manifest under another key: a problem, the others listed", 1)
