"""A machine without the encryption key must not push into a prefix that holds encrypted
entries, also when the manifest its key check probes is a plaintext one pushed before encryption
was turned on (the first name of the prefix, say). Against a real S3 server (moto, `s3` fixture)."""

from __future__ import annotations

import base64

import pytest

from test_blocks import make_snapshot
from test_store import PLAIN, put, token_ids
from test_store_s3 import bucket_keys, s3_store
from tqstore.store import crypto


def test_a_keyless_push_is_refused_where_any_manifest_is_encrypted(s3, tmp_path, monkeypatch):
    a = s3_store(tmp_path / "a", s3)
    put(a, "aaa-old", make_snapshot(300, layouts=PLAIN), token_ids(300))
    a.push("aaa-old")  # before encryption was turned on
    a.close()
    monkeypatch.setenv(crypto.KEY_ENV, base64.b64encode(bytes(range(32))).decode())
    keyed = s3_store(tmp_path / "keyed", s3)
    put(keyed, "secret", make_snapshot(300, layouts=PLAIN, seed=3), token_ids(300, seed=1))
    keyed.push("secret")
    keyed.close()
    monkeypatch.delenv(crypto.KEY_ENV)

    b = s3_store(tmp_path / "b", s3)
    put(b, "zzz-new", make_snapshot(300, layouts=PLAIN, seed=6), token_ids(300, seed=2))
    before = bucket_keys(s3, "kv/")
    with pytest.raises(crypto.EncryptionKeyError, match=r"encrypted entries \(secret\).*nothing was pushed"):
        b.push("zzz-new")
    with pytest.raises(crypto.EncryptionKeyError, match="nothing was pushed"):
        b.push()
    assert bucket_keys(s3, "kv/") == before  # nothing went up in clear
    b.close()
