"""An encrypted manifest copied from another prefix is refused (issue 27, finding 3), with the
real moto S3 server.

AES-GCM bound a sealed manifest to its entry name only, and the rollback check compares
versions per prefix; so `base` pushed four times under p2, its manifest and objects copied over
p1/, was pulled by a machine that had seen version 3 of p1/base (4 > 3), which then answered from
the other document, and `verify` said ok. A manifest now seals its address (bucket, prefix and
name): a copy anywhere else is ManifestMoved for pull, lookups and `verify --remote`. Manifests
sealed by an older tqstore carry no address and are refused too (UnboundManifest); the machine
that pushed one replaces it with its next push.
"""

from __future__ import annotations

import base64
import json
import os

import pytest
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from harness import open_store, s3_settings
from tqstore.errors import CorruptBlock
from tqstore.store import crypto
from tqstore_cli import main as cli_main
from workers import put, snapshot_digest

KEY = base64.b64encode(bytes(range(32))).decode()


def at(s3, prefix: str) -> dict[str, object]:
    return s3_settings(s3, s3_url=f"s3://{s3.bucket}/{prefix}")


def entry(store, name: str) -> tuple[tuple[int, ...], str]:
    snap, _ = store.load(name)
    return tuple(store.get(name).tokens), snapshot_digest(snap)


def copy_prefix(s3, source: str, target: str) -> None:
    """What a bucket writer does: every object under `source`/ put again under `target`/."""
    for page in s3.client.get_paginator("list_objects_v2").paginate(Bucket=s3.bucket, Prefix=f"{source}/"):
        for item in page.get("Contents", []):
            got = s3.client.get_object(Bucket=s3.bucket, Key=item["Key"])
            s3.client.put_object(Bucket=s3.bucket, Key=target + item["Key"][len(source):], Body=got["Body"].read(),
                                 Metadata=got["Metadata"])


def verify_remote(home, s3, prefix: str, capsys) -> tuple[int, dict]:
    """`tqstore verify --remote --json` on `home`, configured as a user would."""
    env = {"TQSTORE_S3_URL": f"s3://{s3.bucket}/{prefix}", "TQSTORE_S3_ENDPOINT": s3.endpoint,
           "TQSTORE_S3_REGION": "us-east-1", "TQSTORE_S3_MAX_ATTEMPTS": "2"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        capsys.readouterr()
        code = cli_main.main(["--home", str(home), "verify", "--remote", "--json"])
        out, err = capsys.readouterr()
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    assert err == "" and "Traceback" not in out
    return code, json.loads(out)


def test_a_manifest_copied_from_another_prefix_is_refused(s3, tmp_path, monkeypatch, capsys, ledger):
    monkeypatch.setenv(crypto.KEY_ENV, KEY)
    owner1 = open_store(tmp_path / "owner1", **at(s3, "p1"))
    reader = open_store(tmp_path / "reader", **at(s3, "p1"))
    for version in (1, 2, 3):  # p1/base: version 3, seen by the reader
        put(owner1, "base", 300, version)
        owner1.push("base")
    put(owner1, "other", 200, 9)
    owner1.push("other")
    reader.pull("base")
    ours = entry(reader, "base")
    owner2 = open_store(tmp_path / "owner2", **at(s3, "p2"))
    for version in (4, 5, 6, 7):  # p2/base: another document, version 4
        put(owner2, "base", 280, version)
        owner2.push("base")
    theirs = tuple(owner2.get("base").tokens)
    assert theirs != ours[0]

    copy_prefix(s3, "p2", "p1")
    fresh = open_store(tmp_path / "fresh", **at(s3, "p1"))  # never saw p1/base: the address still tells
    for label, store in (("a machine that saw version 3", reader), ("a fresh machine", fresh)):
        with pytest.raises(CorruptBlock, match=rf"sealed for s3://{s3.bucket}/p2/manifests/base\.json") as refused:
            store.pull("base")
        assert type(refused.value).__name__ == "ManifestMoved" and "\n" not in str(refused.value)
        ledger.count("encryption at rest/moved manifest", f"pull refused ({label})")
    assert entry(reader, "base") == ours  # what `ask base` restores: still p1's document
    reader._tiers.remote.refresh()
    assert [m.name for m, _ in reader._tiers.remote.manifests()] == ["other"]
    match = reader.lookup(list(theirs) + [1], model=owner2.get("base").model_digest,
                          codec=owner2.get("base").codec_digest)
    assert match is None or not match.remote  # at most the tokens both documents share, from p1's own entry
    assert [e.name for e in reader.ls(remote=True)] == ["other"]
    stats = reader.gc(remote=True, remote_grace=0)
    assert stats.remote_orphans == 0 and "base" in stats.notes[0]  # nothing of p1's entries collected
    ledger.count("encryption at rest/moved manifest", "ask restores p1's entry, lookups and listings leave it out")
    reader.close()

    code, report = verify_remote(tmp_path / "reader", s3, "p1", capsys)
    assert code == 1 and not report["ok"] and report["entries"] == ["base", "other"]
    (problem,) = report["problems"]
    assert problem["entry"] == "base" and f"sealed for s3://{s3.bucket}/p2/" in problem["detail"], problem
    ledger.count("encryption at rest/moved manifest", "verify --remote reports it (exit 1)")

    # The owner is told too, and recovers as the message says: rm --remote, push again.
    with pytest.raises(CorruptBlock, match="sealed for"):
        owner1.push("base")
    owner1.rm("base", remote=True)
    owner1.push("base")
    reader = open_store(tmp_path / "reader", **at(s3, "p1"))
    reader.pull("base")
    assert entry(reader, "base") == ours
    ledger.count("encryption at rest/moved manifest", "the owner's push refused, recovered by rm --remote and push")
    for store in (owner1, owner2, fresh, reader):
        store.close()


def test_a_manifest_sealed_by_an_older_tqstore_is_refused_until_pushed_again(s3, tmp_path, monkeypatch, ledger):
    """Old envelopes carry no address, so a copy from another prefix could not be told from
    them: refused, naming the way out; the machine that pushed the entry replaces its own."""
    monkeypatch.setenv(crypto.KEY_ENV, KEY)
    owner = open_store(tmp_path / "owner", **at(s3, "p1"))
    put(owner, "base", 300, 1)
    owner.push("base")
    tier = owner._tiers.s3
    key = tier.manifest_name("base")
    got = s3.client.get_object(Bucket=s3.bucket, Key=key)
    plain = tier.get_manifest("base")[0]
    old = s3.client.put_object(Bucket=s3.bucket, Key=key, Body=legacy_seal(tier.cipher, plain, "base"),
                               Metadata=got["Metadata"])
    local = owner.get("base")  # as the older tqstore recorded its push
    owner._tiers.lmdb.put_manifest("base", local.replace(remote_etag=old["ETag"]).to_bytes())

    reader = open_store(tmp_path / "reader", **at(s3, "p1"))
    with pytest.raises(crypto.UnboundManifest, match=r"older tqstore.*tqstore push base"):
        reader.pull("base")
    ledger.count("encryption at rest/unbound manifest", "pull refused, naming the way out")
    owner.push("base")  # its own: replaced, now sealed with its address
    reader.pull("base")
    assert entry(reader, "base") == entry(owner, "base")
    ledger.count("encryption at rest/unbound manifest", "replaced by the owner's push, then pulled")
    for store in (owner, reader):
        store.close()


def legacy_seal(cipher: crypto.ObjectCipher, data: bytes, name: str) -> bytes:
    """A manifest envelope as tqstore sealed it before issue 27 (version 2: a counter, no address)."""
    header = crypto._HEADER.pack(crypto.MAGIC, 2, cipher.key_id)
    nonce = os.urandom(12)
    plain = crypto._COUNTER.pack(1) + data
    return header + nonce + AESGCM(cipher.key).encrypt(nonce, plain, crypto._aad(header, "manifest", name))


def test_the_sealed_address_covers_bucket_prefix_and_name(tmp_path):
    cipher = crypto.ObjectCipher(base64.b64decode(KEY), "a test key",
                                 crypto.ManifestVersions(tmp_path / crypto.VERSIONS_FILE, "s3://b/p1"))
    where = "s3://b/p1/manifests/doc.json"
    sealed = cipher.seal(b"{}", "manifest", "doc", where)
    assert cipher.open(sealed, "manifest", "doc", where) == b"{}"
    for elsewhere in ("s3://c/p1/manifests/doc.json", "s3://b/p2/manifests/doc.json", "s3://b/manifests/doc.json",
                      "s3://b/p1/manifests/other.json"):
        with pytest.raises(crypto.ManifestMoved, match=f"sealed for {where}"):
            cipher.open(sealed, "manifest", "doc", elsewhere)
    with pytest.raises(CorruptBlock, match="failed authentication"):  # an object envelope is never a manifest
        cipher.open(cipher.seal(b"{}", "object", "ab" * 32, where), "manifest", "doc", where)
