"""A real S3 HTTP server for tests: moto's ThreadedMotoServer on loopback, one per session.

tests/conftest.py imports the fixtures (`from s3_server import moto_server, s3  # noqa: F401`).
`s3` resets the server before each test, sets fake credentials (and hides ~/.aws and AWS_PROFILE
so a developer's real account is never used) and creates an empty bucket.
"""

from __future__ import annotations

import functools
import logging
import urllib.request
from dataclasses import dataclass

import boto3
import botocore.config
import botocore.loaders
import botocore.session
import pytest

from tqstore.format.manifest import Manifest
from tqstore.store.packs import Location, manifest_address, parse_map
from tqstore.store.tiers.s3 import S3Tier

BUCKET = "tqstore-test"


@dataclass
class S3Server:
    """The server of one test: its endpoint, its (empty) bucket and a plain boto3 client that
    bypasses tqstore (to damage objects, or to look at what tqstore wrote)."""

    endpoint: str
    bucket: str
    client: object

    def tier(self, prefix: str = "kv", **kw: object) -> S3Tier:
        """An S3Tier on this server with fast retries (tests must not wait on backoff)."""
        settings = {"endpoint_url": self.endpoint, "region": "us-east-1", "max_attempts": 2,
                    "retry_delay": 0.0, "connect_timeout": 2.0, "read_timeout": 10.0} | kw
        return S3Tier(self.bucket, prefix, **settings)

    def where(self, tier: S3Tier, entry: str, key: bytes) -> tuple[str, int, int]:
        """(bucket key, start, end) of object `key`'s body as bucket entry `entry` places it:
        a range of a pack (layout 2), or a whole loose object (layout 1)."""
        manifest = Manifest.from_bytes(tier.get_manifest(entry)[0])
        data = tier.get_map(manifest_address(manifest))
        loc = parse_map(data, manifest)[key] if data is not None else Location(None)
        if loc.pack is None:
            name = tier.object_name(key)
            return name, 0, self.client.head_object(Bucket=self.bucket, Key=name)["ContentLength"]
        return tier.pack_name(loc.pack), loc.offset, loc.offset + loc.length

    def referenced(self, tier: S3Tier, manifests: list[Manifest]) -> set[str]:
        """The bucket keys (other than manifests) that `manifests` use: their maps and the packs
        these place objects in, or their loose objects (layout 1)."""
        keys = set()
        for manifest in manifests:
            data = tier.get_map(manifest_address(manifest))
            if data is None:
                keys |= {tier.object_name(r.key) for r in manifest.objects}
                continue
            keys.add(tier.map_name(manifest_address(manifest)))
            keys |= {tier.pack_name(loc.pack) if loc.pack else tier.object_name(key)
                     for key, loc in parse_map(data, manifest).items()}
        return keys

    def stored(self, tier: S3Tier) -> set[str]:
        """Every bucket key under `tier`'s prefix but the manifests."""
        pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=tier.prefix)
        return {item["Key"] for page in pages for item in page.get("Contents", [])
                if not item["Key"].startswith(tier.prefix + "manifests/")}

    def damage(self, tier: S3Tier, entry: str, key: bytes) -> bytes:
        """Flip a byte in the middle of object `key` of bucket entry `entry`, wherever it lies
        (its metadata kept); returns the bucket object's former body."""
        name, start, end = self.where(tier, entry, key)
        head = self.client.head_object(Bucket=self.bucket, Key=name)
        original = self.client.get_object(Bucket=self.bucket, Key=name)["Body"].read()
        body = bytearray(original)
        body[(start + end) // 2] ^= 0xFF
        self.client.put_object(Bucket=self.bucket, Key=name, Body=bytes(body), Metadata=head["Metadata"])
        return original


@pytest.fixture(scope="session")
def moto_server():
    """Endpoint URL of a moto S3 server on 127.0.0.1 (an ephemeral port)."""
    # moto is a test-only package: imported here, not at module level, so that the conftest (which
    # imports this module) loads where moto is not installed (`pytest -m gpu` on the GPU machine).
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one log line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    # Every S3Tier opens its own boto3 session, and a session's first client parses botocore's S3
    # model and endpoint rules (JSON files of megabytes): 0.1-0.3 s of CPU for each tier or store
    # with a bucket, which the tests open by the dozen. Here the sessions share one loader, so
    # those files are parsed once; every call still goes through a real botocore client.
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(botocore.session, "create_loader", functools.cache(botocore.loaders.create_loader))
        yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def s3(moto_server, monkeypatch, tmp_path) -> S3Server:
    """The session's moto server, reset, with fake credentials and an empty bucket."""
    return fresh_s3(moto_server, monkeypatch, tmp_path)


def fresh_s3(moto_server: str, monkeypatch: pytest.MonkeyPatch, tmp_path) -> S3Server:
    """What the `s3` fixture gives, for a fixture of a wider scope (its own MonkeyPatch)."""
    for name in ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    urllib.request.urlopen(urllib.request.Request(f"{moto_server}/moto-api/reset", method="POST")).close()
    client = boto3.client(
        "s3", endpoint_url=moto_server, region_name="us-east-1",
        config=botocore.config.Config(request_checksum_calculation="when_required"),
    )
    client.create_bucket(Bucket=BUCKET)
    return S3Server(moto_server, BUCKET, client)
