"""The S3 tier against a real S3 HTTP server (moto, fixtures in s3_server.py), plus Stubber unit
tests of the paths moto does not emulate faithfully (409 conflicts, BadDigest, auth refusals)."""

import base64
import datetime
import hashlib
import io
import random
import socket
import time

import pytest
from botocore.response import StreamingBody
from botocore.stub import Stubber

from tqstore.config import load_config
from tqstore.errors import (
    ConflictError, CorruptBlock, RemoteAuthError, RemoteError, RemoteNotConfigured, RemoteUnreachable,
)
from tqstore.store.tiers.s3 import S3Tier

MiB = 1 << 20


def key(i) -> bytes:
    return hashlib.sha256(str(i).encode()).digest()


def payload(i, size) -> bytes:
    return random.Random(str(i)).randbytes(size)


class Requests:
    """Counts the API operations a client makes (boto3's before-call event)."""

    def __init__(self, tier):
        self.operations = []
        self.headers = []
        tier.client.meta.events.register("before-call.s3", lambda model, **_: self.operations.append(model.name))
        tier.client.meta.events.register("before-send.s3", self._headers)

    def _headers(self, request, **_):
        self.headers.append({k: v.decode() if isinstance(v, bytes) else v for k, v in request.headers.items()})

    def count(self, operation):
        return self.operations.count(operation)


# --- objects ----------------------------------------------------------------------------------


def test_round_trip_and_bucket_layout(s3):
    tier = s3.tier()
    data = payload(1, 100_000)
    assert tier.put_object(key(1), data) is True
    assert tier.get_object(key(1)) == data
    hex_key = key(1).hex()
    assert tier.object_name(key(1)) == f"kv/objects/{hex_key[:2]}/{hex_key}"
    head = s3.client.head_object(Bucket=s3.bucket, Key=f"kv/objects/{hex_key[:2]}/{hex_key}")
    assert head["Metadata"] == {"tq-sha256": hashlib.sha256(data).hexdigest(), "tq-size": "100000"}
    info = tier.object_info(key(1))
    assert info.size == 100_000 and info.sha256 == hashlib.sha256(data).hexdigest()
    assert tier.has_object(key(1)) and not tier.has_object(key(2))
    assert tier.get_object(key(2)) is None and tier.object_info(key(2)) is None
    assert tier.put_object(key(3), b"") and tier.get_object(key(3)) == b""


def test_puts_send_an_explicit_sha256_and_no_chunked_trailer(s3):
    tier = s3.tier()
    requests = Requests(tier)
    tier.put_object(key(1), b"payload")
    [headers] = [h for h in requests.headers if "x-amz-checksum-sha256" in h]
    assert headers["x-amz-checksum-sha256"] == base64.b64encode(hashlib.sha256(b"payload").digest()).decode()
    assert headers["If-None-Match"] == "*"
    assert "x-amz-trailer" not in headers and "aws-chunked" not in headers.get("Content-Encoding", "")
    assert not any("x-amz-checksum-crc32" in h for h in requests.headers)


def test_objects_are_create_only(s3):
    tier = s3.tier()
    requests = Requests(tier)
    assert tier.put_object(key(1), b"first") is True
    assert tier.put_object(key(1), b"second") is False  # 412 from If-None-Match: not an error
    assert requests.count("PutObject") == 2
    assert tier.get_object(key(1)) == b"first"


def test_multipart_upload_round_trip(s3):
    tier = s3.tier(multipart_threshold=6 * MiB, part_size=5 * MiB)
    requests = Requests(tier)
    data = payload("big", 11 * MiB + 3)
    assert tier.put_object(key("big"), data) is True
    assert requests.count("CreateMultipartUpload") == 1 and requests.count("UploadPart") == 3
    assert requests.count("CompleteMultipartUpload") == 1 and requests.count("PutObject") == 0
    assert tier.get_object(key("big")) == data  # verified against tq-sha256, not the multipart ETag
    assert tier.put_object(key("big"), data) is False  # If-None-Match on CompleteMultipartUpload
    assert requests.count("AbortMultipartUpload") == 1
    assert s3.client.list_multipart_uploads(Bucket=s3.bucket).get("Uploads", []) == []


def test_part_sizes_respect_the_limits(s3):
    tier = s3.tier(part_size=5 * MiB)
    assert tier._part_size(100 * MiB) == 5 * MiB
    big = 100 * 1024 * MiB
    assert tier._part_size(big) == 11 * MiB and -(-big // tier._part_size(big)) <= 10_000


def test_corrupt_object_is_detected(s3):
    tier = s3.tier()
    good = payload(1, 5000)
    tier.put_object(key(1), good)
    name = tier.object_name(key(1))
    damaged = bytearray(good)
    damaged[100] ^= 1
    s3.client.put_object(  # overwritten behind tqstore's back, keeping the original metadata
        Bucket=s3.bucket, Key=name, Body=bytes(damaged),
        Metadata={"tq-sha256": hashlib.sha256(good).hexdigest(), "tq-size": "5000"},
    )
    with pytest.raises(CorruptBlock, match=f"{name} failed verification"):
        tier.get_object(key(1))
    with pytest.raises(CorruptBlock):  # the caller's digest (from a manifest) is checked too
        tier.get_object(key(1), sha256=hashlib.sha256(good).hexdigest())
    s3.client.put_object(Bucket=s3.bucket, Key=name, Body=good)  # no tqstore metadata
    with pytest.raises(CorruptBlock, match="not written by tqstore"):
        tier.get_object(key(1))
    assert tier.get_object(key(1), sha256=hashlib.sha256(good).hexdigest()) == good


def test_list_and_delete_objects(s3):
    tier = s3.tier()
    for i in range(5):
        tier.put_object(key(i), b"x")
    s3.client.put_object(Bucket=s3.bucket, Key="kv/objects/zz/not-a-key", Body=b"")
    s3.client.put_object(Bucket=s3.bucket, Key="other/objects/aa/" + "aa" * 32, Body=b"")
    assert sorted(tier.list_object_keys()) == sorted(key(i) for i in range(5))
    assert tier.delete_objects([key(0), key(1)]) == 2
    assert sorted(tier.list_object_keys()) == sorted(key(i) for i in range(2, 5))


# --- manifests --------------------------------------------------------------------------------


def test_manifest_create_replace_and_conflict(s3):
    alice, bob = s3.tier(), s3.tier()  # two machines
    assert alice.get_manifest("proj") is None
    etag = alice.put_manifest("proj", b'{"v": 1}')
    data, read_etag = bob.get_manifest("proj")
    assert data == b'{"v": 1}' and read_etag == etag
    with pytest.raises(ConflictError, match="another machine pushed proj first.*pull it, or push under another name"):
        bob.put_manifest("proj", b'{"v": "bob"}')  # create, but it exists
    etag2 = alice.put_manifest("proj", b'{"v": 2}', etag=etag)
    with pytest.raises(ConflictError, match="another machine pushed proj first"):
        bob.put_manifest("proj", b'{"v": "bob"}', etag=read_etag)  # replace a version that is gone
    assert bob.get_manifest("proj") == (b'{"v": 2}', etag2)
    assert [m.name for m in bob.list_manifests()] == ["proj"]
    assert alice.delete_manifest("proj") is True and alice.delete_manifest("proj") is False
    with pytest.raises(ConflictError):
        bob.put_manifest("proj", b"{}", etag=etag2)  # deleted meanwhile
    assert bob.list_manifests() == []


def test_manifest_listing_and_prefixes(s3):
    tier, other = s3.tier("team/a"), s3.tier("team/b")
    for name in ("b", "a", "c.d"):
        tier.put_manifest(name, b"{}")
    s3.client.put_object(Bucket=s3.bucket, Key="team/a/manifests/..bad.json", Body=b"")
    s3.client.put_object(Bucket=s3.bucket, Key="team/a/manifests/notes.txt", Body=b"")
    assert [(m.name, m.size) for m in tier.list_manifests()] == [("a", 2), ("b", 2), ("c.d", 2)]
    assert other.list_manifests() == [] and other.get_manifest("a") is None
    assert tier.manifest_name("a") == "team/a/manifests/a.json"


def test_damaged_manifest_is_detected(s3):
    tier = s3.tier()
    tier.put_manifest("m", b'{"v": 1}')
    head = s3.client.head_object(Bucket=s3.bucket, Key="kv/manifests/m.json")
    s3.client.put_object(Bucket=s3.bucket, Key="kv/manifests/m.json", Body=b'{"v": 9}', Metadata=head["Metadata"])
    with pytest.raises(CorruptBlock):
        tier.get_manifest("m")


# --- failures ---------------------------------------------------------------------------------


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_unreachable_server_fails_fast_and_names_the_endpoint(s3):
    endpoint = f"http://127.0.0.1:{closed_port()}"
    tier = S3Tier("bucket", endpoint_url=endpoint, region="us-east-1", max_attempts=1, connect_timeout=1)
    start = time.monotonic()
    for call in (lambda: tier.put_object(key(1), b"x"), lambda: tier.get_manifest("m"),
                 lambda: list(tier.list_object_keys()), lambda: tier.get_object(key(1))):
        with pytest.raises(RemoteUnreachable) as info:
            call()
        assert endpoint in str(info.value) and "TQSTORE_S3_ENDPOINT" in str(info.value)
    assert time.monotonic() - start < 5


def test_missing_bucket_is_named(s3):
    tier = S3Tier("no-such-bucket", endpoint_url=s3.endpoint, region="us-east-1", max_attempts=1)
    for call in (lambda: tier.put_object(key(1), b"x"), lambda: tier.get_manifest("m"), tier.list_manifests):
        with pytest.raises(RemoteError, match="bucket 'no-such-bucket' does not exist") as info:
            call()
        assert not isinstance(info.value, RemoteUnreachable)


def test_missing_credentials_are_an_auth_error(s3, monkeypatch):
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    with pytest.raises(RemoteAuthError, match="AWS_ACCESS_KEY_ID"):
        s3.tier().get_manifest("m")


def test_from_config(s3, tmp_path, monkeypatch):
    for name in ("TQSTORE_S3_URL", "TQSTORE_S3_ENDPOINT", "TQSTORE_S3_REGION"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(RemoteNotConfigured, match="TQSTORE_S3_URL"):
        S3Tier.from_config(load_config(tmp_path))
    monkeypatch.setenv("TQSTORE_S3_URL", f"s3://{s3.bucket}/team/kv")
    monkeypatch.setenv("TQSTORE_S3_ENDPOINT", s3.endpoint)
    tier = S3Tier.from_config(load_config(tmp_path))
    assert (tier.bucket, tier.prefix, tier.endpoint_url) == (s3.bucket, "team/kv/", s3.endpoint)
    tier.put_manifest("m", b"{}")
    assert s3.client.get_object(Bucket=s3.bucket, Key="team/kv/manifests/m.json")["Body"].read() == b"{}"


# --- Stubber unit tests: conditional-write and digest paths moto does not emulate faithfully ---


@pytest.fixture
def stubbed(monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    tier = S3Tier(
        "bucket", "kv", endpoint_url="http://127.0.0.1:9", region="us-east-1", max_attempts=3, retry_delay=0.0
    )
    with Stubber(tier.client) as stubber:
        yield tier, stubber
        stubber.assert_no_pending_responses()


def head_response(body: bytes) -> dict:
    return {
        "ContentLength": len(body), "LastModified": datetime.datetime.now(datetime.timezone.utc),
        "Metadata": {"tq-sha256": hashlib.sha256(body).hexdigest(), "tq-size": str(len(body))},
    }


def test_stubbed_412_on_put_means_already_there(stubbed):
    tier, stubber = stubbed
    stubber.add_client_error("put_object", "PreconditionFailed", http_status_code=412)
    stubber.add_response("head_object", head_response(b"other bytes"))
    assert tier.put_object(key(1), b"x") is False


def test_stubbed_412_on_a_damaged_existing_object_is_reported(stubbed):
    tier, stubber = stubbed
    stubber.add_client_error("put_object", "PreconditionFailed", http_status_code=412)
    stubber.add_response("head_object", head_response(b"abc") | {"ContentLength": 1})  # truncated copy
    with pytest.raises(CorruptBlock, match="damaged"):
        tier.put_object(key(1), b"abc")


def test_stubbed_409_conflict_is_retried(stubbed):
    tier, stubber = stubbed
    stubber.add_client_error("put_object", "ConditionalRequestConflict", http_status_code=409)
    stubber.add_response("put_object", {"ETag": '"e"'})
    assert tier.put_object(key(1), b"x") is True


def test_stubbed_409_that_persists_is_a_conflict(stubbed):
    tier, stubber = stubbed
    for _ in range(3):
        stubber.add_client_error("put_object", "ConditionalRequestConflict", http_status_code=409)
    with pytest.raises(ConflictError, match="409"):
        tier.put_object(key(1), b"x")


def test_stubbed_bad_digest_is_retried_then_reported(stubbed):
    tier, stubber = stubbed
    stubber.add_client_error("put_object", "BadDigest", http_status_code=400)
    stubber.add_response("put_object", {"ETag": '"e"'})
    assert tier.put_object(key(1), b"x") is True
    for _ in range(3):
        stubber.add_client_error("put_object", "BadDigest", http_status_code=400)
    with pytest.raises(RemoteError, match="arrived damaged 3 times"):
        tier.put_object(key(2), b"x")


def test_stubbed_manifest_conflicts(stubbed):
    tier, stubber = stubbed
    stubber.add_client_error("put_object", "ConditionalRequestConflict", http_status_code=409)
    stubber.add_client_error("put_object", "PreconditionFailed", http_status_code=412)
    with pytest.raises(ConflictError, match="another machine pushed m first"):
        tier.put_manifest("m", b"{}", etag='"old"')


def test_stubbed_multipart_complete_412_aborts_the_upload(stubbed):
    tier, stubber = stubbed
    tier.multipart_threshold = 10
    body = b"y" * 20
    stubber.add_response("create_multipart_upload", {"UploadId": "u1"})
    stubber.add_response("upload_part", {"ETag": '"p1"'})
    stubber.add_client_error("complete_multipart_upload", "PreconditionFailed", http_status_code=412)
    expected = {"Bucket": "bucket", "Key": tier.object_name(key(1)), "UploadId": "u1"}
    stubber.add_response("abort_multipart_upload", {}, expected)
    stubber.add_response("head_object", head_response(body))
    assert tier.put_object(key(1), body) is False


@pytest.mark.parametrize("code", ["InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied"])
def test_stubbed_auth_refusals(stubbed, code):
    tier, stubber = stubbed
    stubber.add_client_error("get_object", code, http_status_code=403)
    with pytest.raises(RemoteAuthError, match="AWS_ACCESS_KEY_ID"):
        tier.get_manifest("m")


def test_stubbed_truncated_body_is_retried(stubbed):
    tier, stubber = stubbed
    body = b'{"v": 1}'
    meta = head_response(body)["Metadata"]
    short = StreamingBody(io.BytesIO(body[:3]), len(body))  # the connection dropped mid-body
    stubber.add_response("get_object", {"Body": short, "ETag": '"e"', "Metadata": meta})
    whole = StreamingBody(io.BytesIO(body), len(body))
    stubber.add_response("get_object", {"Body": whole, "ETag": '"e"', "Metadata": meta})
    assert tier.get_manifest("m") == (body, '"e"')


def test_put_object_reuses_a_verified_digest_and_checksums_the_body_sent(s3):
    """A digest the caller passes becomes tq-sha256 without hashing again; ChecksumSHA256 always
    describes the body on the wire: the payload, or its envelope when sealed (moto would accept
    a wrong one silently)."""
    import base64 as b64

    from tqstore.store import crypto

    for cipher in (None, crypto.ObjectCipher(bytes(range(32)), "a test key")):
        tier = s3.tier(cipher=cipher)
        sent = []
        tier.client.meta.events.register("before-send.s3.PutObject", lambda request, **_: sent.append(request))
        data = payload("digest", 70_000)
        digest = hashlib.sha256(data).hexdigest()
        assert tier.put_object(key(f"digest-{cipher is None}"), data, digest)
        body = sent[0].body
        if not isinstance(body, bytes):  # a stream botocore has read: read it again
            body.seek(0)
            body = body.read()
        headers = {k.lower(): v.decode() if isinstance(v, bytes) else v for k, v in sent[0].headers.items()}
        assert headers["x-amz-checksum-sha256"] == b64.b64encode(hashlib.sha256(body).digest()).decode()
        assert headers["x-amz-meta-tq-sha256"] == digest
        assert (body == data) == (cipher is None)
        assert tier.get_object(key(f"digest-{cipher is None}")) == data


def test_read_range_streams_pieces_of_one_get(s3):
    """A pull reads a pack's span as a stream (bucket.py): each piece is yielded as soon as it
    has arrived, all from one ranged GET; a missing pack is a single None, and a pack shorter
    than the pieces asked for is CorruptBlock."""
    tier = s3.tier(part_size=5 * 1024 * 1024)
    sizes = [3, 1_500_000, 1, 2_100_000, 700_000]  # pieces across and inside the 1 MiB reads
    body = random.Random(5).randbytes(sum(sizes) + 10)
    name = hashlib.sha256(b"pack").hexdigest()
    tier.put_pack(name, body)
    calls = Requests(tier)
    cuts = [10 + sum(sizes[:i + 1]) for i in range(len(sizes))]
    pieces = list(tier.read_range(name, 10, cuts))
    assert pieces == [body[a:b] for a, b in zip([10] + cuts, cuts)]
    assert calls.count("GetObject") == 1
    assert list(tier.read_range(hashlib.sha256(b"none").hexdigest(), 0, [5])) == [None]
    with pytest.raises(CorruptBlock, match="shorter than its map says"):
        list(tier.read_range(name, len(body) - 4, [len(body) - 2, len(body) + 6]))
