"""The S3-compatible tier (cold storage): immutable objects and compare-and-swap manifests.

Bucket layout under the configured prefix (docs/format.md, "The bucket"):

    <prefix>objects/<hex[:2]>/<hex>     layout 1: an object payload; hex = its 32-byte key in hex
    <prefix>packs/<sha256>              layout 2: a pack of objects (tqstore/store/packs.py)
    <prefix>maps/<sha256>               layout 2: where a manifest's objects live
    <prefix>manifests/<name>.json       a manifest

Pushes write layout 2; both layouts are read and collected.

Every PUT sends an explicit ChecksumSHA256 and stores tqstore's own sha256 as the metadata
`tq-sha256` (and the size as `tq-size`); every GET is verified against that sha256 or the one the
caller passes, because multipart objects cannot carry a full-object SHA-256 and some servers
(moto) accept a wrong ChecksumSHA256 silently. Objects are create-only (If-None-Match: *);
manifests are created with If-None-Match: * and replaced with If-Match: <etag>. No boto
exception leaves this module: failures become tqstore.errors types.

With a `cipher` (encryption at rest, tqstore/store/crypto.py) every body is sealed before it is sent
and opened after it is read; tq-sha256 and tq-size still describe the plaintext, and `tq-enc`
marks the envelope.
"""

from __future__ import annotations

import base64
import hashlib
import random
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from contextlib import AbstractContextManager, suppress
from typing import TypeVar

import botocore.exceptions as bx

from tqstore.config import Config
from tqstore.units import MiB, format_size
from tqstore.store.crypto import (OVERHEAD, SCHEME, ObjectCipher, UnboundManifest, cipher_from_config,
                                  open_payload)
from tqstore.errors import ConflictError, CorruptBlock, RemoteError, RemoteNotConfigured, TqstoreError
from tqstore.names import is_valid_name, validate_name
from tqstore.store.tiers.base import ManifestInfo, ObjectInfo, check_key
from tqstore.store.tiers.s3_errors import (
    TRANSPORT, BadDigest, ConditionalConflict, Missing, PreconditionFailed, boto_errors, unreachable,
)

T = TypeVar("T")
K = TypeVar("K")

_META_SHA = "tq-sha256"
_META_SIZE = "tq-size"
_META_ENC = "tq-enc"
_META_PACK = "tq-pack"
_HEX = frozenset("0123456789abcdef")
_MIN_PART = 5 * MiB  # S3's minimum for every part but the last
_MAX_PARTS = 10_000
_STREAM_CHUNK = 1024 * 1024  # bytes a streamed GET reads at a time


class S3Tier:
    """Objects and manifests in an S3-compatible bucket (AWS, MinIO, R2, Ceph, moto).

    Credentials come from boto3's default chain (environment, ~/.aws, instance roles). `client`
    is the underlying boto3 client, exposed for instrumentation (boto3 events).
    """

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint_url: str | None = None,
        region: str | None = None,
        multipart_threshold: int = Config.s3_multipart_threshold,
        part_size: int = Config.s3_part_size,
        concurrency: int = Config.s3_concurrency,
        max_attempts: int = Config.s3_max_attempts,
        connect_timeout: float = Config.s3_connect_timeout,
        read_timeout: float = Config.s3_read_timeout,
        retry_delay: float = 0.2,
        cipher: ObjectCipher | None = None,
    ) -> None:
        self.bucket = bucket
        self.prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
        self.endpoint_url = endpoint_url
        self.multipart_threshold = multipart_threshold
        self.part_size = max(part_size, _MIN_PART)
        self.concurrency = concurrency
        self.max_attempts = max_attempts
        self.retry_delay = retry_delay
        self.cipher = cipher
        # Imported here, not with the module: boto3's session stack (s3transfer, multiprocessing,
        # botocore's client) costs 0.1-0.25 s that every `ls` and `ask` paid without a bucket.
        import boto3
        import botocore.config

        boto_config = botocore.config.Config(
            # boto3 >= 1.36 adds CRC checksums (aws-chunked trailers) by default, which R2, MinIO
            # and B2 reject; tqstore sends its own ChecksumSHA256 and verifies GETs itself.
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
            retries={"mode": "standard", "max_attempts": max_attempts},
            connect_timeout=connect_timeout,
            read_timeout=read_timeout,
            max_pool_connections=max(10, concurrency),
        )
        try:
            self.client = boto3.session.Session().client(
                "s3", endpoint_url=endpoint_url, region_name=region, config=boto_config
            )
        except (bx.BotoCoreError, ValueError) as exc:
            raise RemoteError(f"cannot set up the S3 client for {self._where()}: {exc}") from exc

    @classmethod
    def from_config(cls, config: Config) -> S3Tier:
        """The tier `config` describes; RemoteNotConfigured if no s3.url is set."""
        if config.s3_bucket is None:
            raise RemoteNotConfigured(
                "no S3 bucket configured: set TQSTORE_S3_URL=s3://BUCKET/PREFIX "
                "(or `s3.url` in config.toml), and TQSTORE_S3_ENDPOINT for non-AWS servers"
            )
        return cls(
            config.s3_bucket, config.s3_prefix, endpoint_url=config.s3_endpoint,
            region=config.s3_region, multipart_threshold=config.s3_multipart_threshold,
            part_size=config.s3_part_size, concurrency=config.s3_concurrency,
            max_attempts=config.s3_max_attempts, connect_timeout=config.s3_connect_timeout,
            read_timeout=config.s3_read_timeout, cipher=cipher_from_config(config),
        )

    def object_name(self, key: bytes) -> str:
        """The bucket key of object `key`."""
        hex_key = check_key(key).hex()
        return f"{self.prefix}objects/{hex_key[:2]}/{hex_key}"

    def pack_name(self, pack: str) -> str:
        """The bucket key of pack `pack` (its hex name)."""
        return f"{self.prefix}packs/{_hex64(pack)}"

    def map_name(self, address: str) -> str:
        """The bucket key of the map of the manifest with sha256 `address`."""
        return f"{self.prefix}maps/{_hex64(address)}"

    def manifest_name(self, name: str) -> str:
        """The bucket key of manifest `name`."""
        return f"{self.prefix}manifests/{validate_name(name)}.json"

    # --- objects -------------------------------------------------------------------------------

    def object_info(self, key: bytes) -> ObjectInfo | None:
        """Size and tqstore sha256 of `key` from a HEAD request, or None if absent.

        CorruptBlock if the object exists but its size contradicts its own metadata.
        """
        name = self.object_name(key)
        try:
            head = self._call("head_object", Key=name)
        except Missing:
            return None
        meta, size = head.get("Metadata", {}), head["ContentLength"]
        if meta.get(_META_ENC) == SCHEME:
            size -= OVERHEAD  # the plaintext's size, as tq-size records it
        if meta.get(_META_SIZE) not in (None, str(size)) or _META_SHA not in meta:
            raise CorruptBlock(
                f"S3 object {name} is damaged or was not written by tqstore ({size} bytes, "
                f"metadata {meta}): delete that object from the bucket and push again"
            )
        modified = head["LastModified"].timestamp()
        return ObjectInfo(check_key(key), size, meta[_META_SHA], modified, modified)

    def has_object(self, key: bytes) -> bool:
        """Whether `key` exists in the bucket (one HEAD request)."""
        return self.object_info(key) is not None

    def put_object(self, key: bytes, payload: bytes, sha256: str | None = None) -> bool:
        """Upload `payload` unless `key` exists (If-None-Match: *); False if it already did.
        `sha256` is the payload's hex digest where the caller has just verified the payload
        against it (it is not hashed again)."""
        name, payload = self.object_name(key), bytes(payload)
        digest = bytes.fromhex(sha256) if sha256 is not None else hashlib.sha256(payload).digest()
        meta = {_META_SHA: digest.hex(), _META_SIZE: str(len(payload))}
        body = self._seal(payload, "object", check_key(key).hex(), name, meta)
        # Unsealed, the body is the payload: its checksum is the digest just taken.
        checksum = _b64(digest if body is payload else hashlib.sha256(body).digest())

        def upload() -> bool:
            try:
                if len(body) > self.multipart_threshold:
                    self._put_multipart(name, body, meta)
                else:
                    self._retrying(
                        "put_object", Key=name, Body=body, IfNoneMatch="*", ChecksumSHA256=checksum,
                        Metadata=meta,
                    )
                return True
            except PreconditionFailed:
                # 412: the key exists, unless it was deleted since (a remote gc) or the 412 came
                # from something in between: then the object is not there and the put goes again.
                if self.object_info(key) is not None:  # raises CorruptBlock if what is there is damaged
                    return False
                raise

        try:
            return self._again(upload, PreconditionFailed)
        except PreconditionFailed:
            raise ConflictError(
                f"s3://{self.bucket}/{name} answered 412 (exists) {self.max_attempts} times but is not there: "
                "check for a proxy rewriting conditional requests, then retry"
            ) from None

    def get_object(self, key: bytes, sha256: str | None = None) -> bytes | None:
        """The payload of `key` verified against `sha256` (hex; default: the object's tq-sha256
        metadata), or None if absent. CorruptBlock if it does not match."""
        found = self._get(self.object_name(key), sha256, ("object", check_key(key).hex()))
        return None if found is None else found[0]

    def delete_objects(self, keys: Iterable[bytes]) -> int:
        """Delete objects in parallel; returns the number of keys (S3 does not say which existed).

        One DeleteObject per key: the batch DeleteObjects call needs a Content-MD5 or checksum
        header that S3-compatible servers handle inconsistently.
        """
        names = [self.object_name(k) for k in keys]
        return len(self.each(lambda n: self._call("delete_object", Key=n), names))

    def list_object_keys(self) -> Iterator[bytes]:
        """Every object key in the bucket (LIST: for remote gc, never for correctness)."""
        for item in self._list("objects/"):
            fanout, _, hex_key = item["Key"][len(self.prefix) + len("objects/"):].partition("/")
            if len(hex_key) == 64 and fanout == hex_key[:2]:
                with suppress(ValueError):
                    yield bytes.fromhex(hex_key)

    # --- packs and maps (layout 2) -------------------------------------------------------------

    def put_pack(self, pack: str, body: bytes) -> bool:
        """Upload pack `pack`, create-only; False if the bucket already held it. A pack of more
        than one part goes up as a multipart upload of parallel parts (as boto3's transfer
        manager sends a file)."""
        name = self.pack_name(pack)
        meta = {_META_PACK: pack, _META_SIZE: str(len(body))}
        if self.cipher is not None:
            meta[_META_ENC] = SCHEME

        def upload() -> bool:
            try:
                if len(body) > min(self.multipart_threshold, self.part_size):
                    self._put_multipart(name, body, meta)
                else:
                    self._retrying("put_object", Key=name, Body=body, IfNoneMatch="*", Metadata=meta,
                                   ChecksumSHA256=_b64(hashlib.sha256(body).digest()))
                return True
            except PreconditionFailed:
                # 412: the pack exists, unless the 412 came from something in between: then again.
                if self.pack_size(pack) is not None:
                    return False
                raise

        try:
            return self._again(upload, PreconditionFailed)
        except PreconditionFailed:
            raise ConflictError(f"s3://{self.bucket}/{name} answered 412 (exists) {self.max_attempts} times but is "
                                "not there: check for a proxy rewriting conditional requests, then retry") from None

    def pack_size(self, pack: str) -> int | None:
        """The size of pack `pack` (one HEAD), or None if absent."""
        try:
            return self._call("head_object", Key=self.pack_name(pack))["ContentLength"]
        except Missing:
            return None

    def pack_head(self, pack: str) -> tuple[int, str] | None:
        """Pack `pack`'s size and ETag (one HEAD), or None if absent."""
        try:
            head = self._call("head_object", Key=self.pack_name(pack))
        except Missing:
            return None
        return head["ContentLength"], str(head.get("ETag", "")).strip('"')

    def upload_etag(self, body: bytes) -> str:
        """The ETag S3 gives `body` as `put_pack` uploads it: the MD5 of the bytes for one PUT,
        the MD5 of the parts' MD5s and their count for a multipart upload."""
        if len(body) <= min(self.multipart_threshold, self.part_size):
            return hashlib.md5(body, usedforsecurity=False).hexdigest()
        part, view = self._part_size(len(body)), memoryview(body)
        digests = b"".join(hashlib.md5(view[at:at + part], usedforsecurity=False).digest()
                           for at in range(0, len(body), part))
        return f"{hashlib.md5(digests, usedforsecurity=False).hexdigest()}-{-(-len(body) // part)}"

    def read_range(self, pack: str, start: int, cuts: Sequence[int]) -> Iterator[bytes | None]:
        """Bytes [start, cuts[0]), [cuts[0], cuts[1]), ... of pack `pack`, each yielded as soon as
        it has arrived, from one ranged GET read as a stream (so the caller can verify and store
        the first pieces while the rest downloads); a single None if the pack is absent. A body
        cut off mid-read is read on from where it stopped (another ranged GET), up to
        max_attempts times. CorruptBlock if the pack is shorter."""
        name = self.pack_name(pack)
        end = cuts[-1] if cuts else start
        at, attempt = start, 0
        chunks: list[bytes] = []  # what has arrived of the piece being read
        pieces = iter(cuts)
        cut = next(pieces, None)
        while cut is not None:
            try:
                try:
                    response = self._call("get_object", Key=name, Range=f"bytes={at}-{end - 1}")
                except Missing:
                    if at == start:
                        yield None
                        return
                    raise
                stream = response["Body"]
                while cut is not None:
                    chunk = stream.read(min(_STREAM_CHUNK, end - at))
                    if not chunk:
                        break
                    chunks.append(chunk)
                    at += len(chunk)
                    while cut is not None and at >= cut:
                        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
                        split = len(data) - (at - cut)
                        chunks = [data[split:]] if split < len(data) else []
                        yield data[:split] if split < len(data) else data
                        cut = next(pieces, None)
                if cut is not None:  # the server ended the body early: the pack is shorter than its map
                    raise CorruptBlock(f"S3 pack {name} is shorter than its map says ({at - start} of {end - start} "
                                       f"bytes at {start}): it was truncated or replaced; push the entries using it "
                                       "again")
            except TRANSPORT as exc:
                attempt += 1
                if attempt >= self.max_attempts:
                    raise unreachable(exc, self._where(), self.max_attempts) from exc
                self._sleep(attempt - 1)

    def get_tail(self, pack: str, length: int) -> bytes | None:
        """The last `length` bytes of pack `pack` (its index and footer), or None if absent."""
        try:
            response = self._call("get_object", Key=self.pack_name(pack), Range=f"bytes=-{length}")
        except Missing:
            return None
        return response["Body"].read()

    def open_member(self, pack: str, offset: int, body: bytes, key: bytes, sha256: str) -> bytes:
        """The plaintext payload of object `key` from its `body` read at `offset` of `pack`,
        verified against `sha256`. CorruptBlock if it is not that object."""
        where = f"object {check_key(key).hex()} in s3://{self.bucket}/{self.pack_name(pack)} " \
                f"(bytes {offset}-{offset + len(body) - 1})"
        payload = open_payload(self.cipher, body, "object", key.hex(), where)
        actual = hashlib.sha256(payload).hexdigest()
        if actual != sha256:
            raise CorruptBlock(
                f"S3 {where} failed verification: sha256 {actual} of {format_size(len(payload))} does not match "
                f"{sha256}; it was changed or damaged in the bucket: remove the entries using it from the bucket "
                "(tqstore rm --remote) and push them again from a machine that has them"
            )
        return payload

    def seal_index(self, pack: str, index: bytes) -> bytes:
        """Pack `pack`'s index as stored: as is, or its envelope (kind "pack", bound to the name)."""
        return self._seal(index, "pack", _hex64(pack), self.pack_name(pack), {})

    def open_index(self, pack: str, blob: bytes) -> bytes:
        """The plaintext of pack `pack`'s stored index (CorruptBlock if it does not open)."""
        return open_payload(self.cipher, blob, "pack", pack, f"s3://{self.bucket}/{self.pack_name(pack)} (its index)")

    def seal_object(self, key: bytes, payload: bytes) -> bytes:
        """The body of object `key` as stored (in a pack, or loose): the payload, or its envelope."""
        return self._seal(payload, "object", check_key(key).hex(), self.object_name(key), {})

    @property
    def sealed_by(self) -> str | None:
        """The key id (hex) of this tier's envelopes, or None when encryption is off."""
        return None if self.cipher is None else self.cipher.key_id.hex()

    @property
    def overhead(self) -> int:
        """Bytes an envelope adds to a payload (0 unencrypted)."""
        return 0 if self.cipher is None else OVERHEAD

    def list_packs(self) -> dict[str, tuple[int, float]]:
        """{pack name: (size, last modified)} of every pack (LIST)."""
        return {hex_name: (item["Size"], item["LastModified"].timestamp())
                for item, hex_name in self._list_hex("packs/")}

    def delete_packs(self, packs: Iterable[str]) -> int:
        """Delete packs in parallel; returns how many were asked for."""
        names = [self.pack_name(p) for p in packs]
        return len(self.each(lambda n: self._call("delete_object", Key=n), names))

    def put_map(self, address: str, data: bytes) -> None:
        """Write the map of the manifest with sha256 `address` (replacing one that placed its
        objects elsewhere: a push that had to send lost objects again)."""
        name = self.map_name(address)
        meta = {_META_SHA: hashlib.sha256(data).hexdigest(), _META_SIZE: str(len(data))}
        body = self._seal(bytes(data), "map", address, name, meta)
        self._retrying("put_object", Key=name, Body=body, Metadata=meta,
                       ChecksumSHA256=_b64(hashlib.sha256(body).digest()))

    def get_map(self, address: str) -> bytes | None:
        """The map of the manifest with sha256 `address`, verified, or None (a layout-1 entry)."""
        found = self._get(self.map_name(address), None, ("map", address))
        return None if found is None else found[0]

    def list_maps(self) -> dict[str, tuple[int, float]]:
        """{manifest address: (size, last modified)} of every map (LIST)."""
        return {hex_name: (item["Size"], item["LastModified"].timestamp()) for item, hex_name in self._list_hex("maps/")}

    def delete_maps(self, addresses: Iterable[str]) -> int:
        """Delete maps in parallel; returns how many were asked for."""
        names = [self.map_name(a) for a in addresses]
        return len(self.each(lambda n: self._call("delete_object", Key=n), names))

    def _list_hex(self, folder: str) -> Iterator[tuple[dict, str]]:
        for item in self._list(folder):
            hex_name = item["Key"][len(self.prefix) + len(folder):]
            if len(hex_name) == 64 and set(hex_name) <= _HEX:
                yield item, hex_name

    # --- locks (bucket_locks.py) ---------------------------------------------------------------

    def lock_name(self, name: str) -> str:
        """The bucket key of lock object `name`."""
        return f"{self.prefix}locks/{name}"

    def put_lock(self, name: str, body: bytes) -> None:
        """Write lock object `name`: plain JSON, never sealed (it holds no data)."""
        self._call("put_object", Key=self.lock_name(name), Body=body, ContentType="application/json")

    def get_lock(self, name: str) -> bytes:
        """The body of lock object `name` (RemoteError, or NotFound's like, if it is gone)."""
        return self._call("get_object", Key=self.lock_name(name))["Body"].read()

    def delete_lock(self, name: str) -> None:
        self._call("delete_object", Key=self.lock_name(name))

    def list_locks(self) -> dict[str, float]:
        """{lock name: last modified, the server's time} of every lock object (LIST)."""
        start = len(self.lock_name(""))
        return {item["Key"][start:]: item["LastModified"].timestamp() for item in self._list("locks/")}

    # --- manifests -----------------------------------------------------------------------------

    def get_manifest(self, name: str) -> tuple[bytes, str] | None:
        """(manifest bytes, etag) of `name`, verified like objects, or None if absent."""
        return self._get(self.manifest_name(name), None, ("manifest", name))

    def put_manifest(self, name: str, data: bytes, etag: str | None = None) -> str:
        """Create `name` (etag None: If-None-Match: *) or replace the version read with `etag`
        (If-Match). ConflictError if another machine wrote it first. Returns the new etag."""
        data = bytes(data)
        meta = {_META_SHA: hashlib.sha256(data).hexdigest(), _META_SIZE: str(len(data))}
        body = self._seal(data, "manifest", name, self.manifest_name(name), meta)
        condition = {"IfNoneMatch": "*"} if etag is None else {"IfMatch": etag}
        try:
            response = self._retrying(
                "put_object", Key=self.manifest_name(name), Body=body, ContentType="application/json",
                ChecksumSHA256=_b64(hashlib.sha256(body).digest()), Metadata=meta, **condition,
            )
        except (PreconditionFailed, Missing):  # If-Match on a deleted manifest is a 404
            raise ConflictError(
                f"another machine pushed {name} first ({'it exists' if etag is None else 'it changed'} "
                f"in s3://{self.bucket}/{self.prefix}): pull it, or push under another name"
            ) from None
        if self.cipher is not None:  # its version is the highest seen now (rollback checks)
            self.cipher.written(body, "manifest", name, f"s3://{self.bucket}/{self.manifest_name(name)}")
        return response["ETag"]

    def delete_manifest(self, name: str) -> bool:
        """Delete manifest `name`; False if there was none."""
        key = self.manifest_name(name)
        try:
            self._call("head_object", Key=key)
        except Missing:
            return False
        self._call("delete_object", Key=key)
        return True

    def list_manifests(self) -> list[ManifestInfo]:
        """Manifests in the bucket, by name (LIST: for `ls --remote`, never for correctness)."""
        infos = []
        start = len(self.prefix) + len("manifests/")
        for item in self._list("manifests/"):
            name = item["Key"][start:].removesuffix(".json")
            if item["Key"].endswith(".json") and is_valid_name(name):
                infos.append(ManifestInfo(name, item["Size"], item["LastModified"].timestamp()))
        return sorted(infos, key=lambda info: info.name)

    # --- requests ------------------------------------------------------------------------------

    def _get(self, name: str, sha256: str | None, what: tuple[str, str]) -> tuple[bytes, str] | None:
        """(plaintext, etag) of bucket key `name`, verified; `what` is (kind, name) as sealed."""
        def read() -> tuple[dict, bytes]:
            response = self._call("get_object", Key=name)
            return response, response["Body"].read()  # a body cut off mid-read: botocore does not retry those

        try:
            response, body = self._again(read, TRANSPORT)
        except Missing:
            return None
        except TRANSPORT as exc:
            raise unreachable(exc, self._where(), self.max_attempts) from exc
        expected = sha256 or response.get("Metadata", {}).get(_META_SHA)
        try:
            body = open_payload(self.cipher, body, *what, f"s3://{self.bucket}/{name}")
        except UnboundManifest as exc:
            exc.etag = response["ETag"]  # a push replaces its own (transfer.py)
            raise
        _verify(name, body, expected)
        return body, response["ETag"]

    def _put_multipart(self, name: str, payload: bytes, meta: dict[str, str]) -> None:
        """A create-only multipart upload of `payload`, its parts sent on up to `concurrency`
        threads."""
        part = self._part_size(len(payload))
        upload = self._call(
            "create_multipart_upload", Key=name, Metadata=meta, ChecksumAlgorithm="SHA256"
        )["UploadId"]
        view = memoryview(payload)

        def send(number: int) -> dict:
            body = bytes(view[(number - 1) * part:number * part])
            checksum = _b64(hashlib.sha256(body).digest())
            response = self._retrying("upload_part", Key=name, UploadId=upload, PartNumber=number, Body=body,
                                      ChecksumSHA256=checksum)
            return {"ETag": response["ETag"], "PartNumber": number, "ChecksumSHA256": checksum}

        try:
            parts = list(self.each(send, list(range(1, -(-len(payload) // part) + 1))).items())
            self._retrying(
                "complete_multipart_upload", Key=name, UploadId=upload, IfNoneMatch="*",
                MultipartUpload={"Parts": [p for _, p in sorted(parts)]},
            )
        except BaseException:
            with suppress(TqstoreError):  # best effort; a lifecycle rule catches the rest
                self._call("abort_multipart_upload", Key=name, UploadId=upload)
            raise

    def _part_size(self, size: int) -> int:
        """Equal parts (R2 needs them equal but the last) of at least part_size, <= 10,000 parts."""
        at_least = -(-size // _MAX_PARTS)
        return max(self.part_size, -(-at_least // MiB) * MiB)

    def _retrying(self, operation: str, **params: object) -> dict:
        """A write that may meet 409 ConditionalRequestConflict (a concurrent conditional write)
        or BadDigest (body damaged in transit), which botocore does not retry."""
        where = f"s3://{self.bucket}/{params['Key']}"
        try:
            return self._again(lambda: self._call(operation, **params), (ConditionalConflict, BadDigest))
        except BadDigest:
            raise RemoteError(
                f"the upload of {where} arrived damaged {self.max_attempts} times (BadDigest): "
                "check proxies and the network, then retry"
            ) from None
        except ConditionalConflict:
            raise ConflictError(
                f"{where} kept conflicting with a concurrent write (409) after {self.max_attempts} "
                "attempts: retry in a moment"
            ) from None

    def _again(self, attempt: Callable[[], T], retry_on: type[Exception] | tuple[type[Exception], ...]) -> T:
        """`attempt()`, again after a backoff when it raises `retry_on`, max_attempts times in all
        (then that error is raised). Only for what botocore's own retries leave alone (409,
        BadDigest, a 412 for an object that is not there, a body cut off mid-read): a loop around
        what botocore retries would multiply its attempts."""
        for n in range(self.max_attempts - 1):
            try:
                return attempt()
            except retry_on:
                self._sleep(n)
        return attempt()

    def _seal(self, data: bytes, kind: str, name: str, key: str, meta: dict[str, str]) -> bytes:
        """The body to upload to bucket key `key`: `data`, or its envelope when encryption is on
        (marked in `meta`)."""
        if self.cipher is None:
            return data
        meta[_META_ENC] = SCHEME
        return self.cipher.seal(data, kind, name, f"s3://{self.bucket}/{key}")

    def _sleep(self, attempt: int) -> None:
        time.sleep(min(5.0, self.retry_delay * 2**attempt) * random.uniform(0.5, 1.5))

    def _call(self, operation: str, **params: object) -> dict:
        with self._errors(operation, str(params.get("Key", ""))):
            return getattr(self.client, operation)(Bucket=self.bucket, **params)

    def _list(self, folder: str) -> Iterator[dict]:
        pages = self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=self.prefix + folder
        )
        with self._errors("list_objects_v2", self.prefix + folder):
            for page in pages:
                yield from page.get("Contents", [])

    def each(
        self, fn: Callable[[K], T], items: list[K], on_done: Callable[[K, T], None] | None = None
    ) -> dict[K, T]:
        """{item: fn(item)}, run on up to `concurrency` threads (the tier's one fan-out for bulk
        GETs and deletes, and push's uploads). `on_done(item, result)` runs on the calling
        thread as each finishes; the first error cancels what has not started and is raised
        (what finished stays done)."""
        results: dict[K, T] = {}
        if not items:
            return results
        with ThreadPoolExecutor(max_workers=min(self.concurrency, len(items))) as pool:
            futures = {pool.submit(fn, item): item for item in items}
            try:
                for future in as_completed(futures):
                    item = futures[future]
                    results[item] = future.result()
                    if on_done is not None:
                        on_done(item, results[item])
            except BaseException:
                pool.shutdown(wait=True, cancel_futures=True)
                raise
        return results

    def _errors(self, operation: str, key: str) -> AbstractContextManager[None]:
        return boto_errors(operation, key, self.bucket, self._where(), self.max_attempts)

    def _where(self) -> str:
        return self.endpoint_url or "the AWS S3 default endpoint"


def _hex64(name: str) -> str:
    if len(name) != 64 or not set(name) <= _HEX:
        raise ValueError(f"{name!r:.80} is not a 64-digit hex name")
    return name


def _b64(digest: bytes) -> str:
    return base64.b64encode(digest).decode()


def _verify(name: str, body: bytes, expected: str | None) -> None:
    if expected is None:
        raise CorruptBlock(
            f"S3 object {name} has no tqstore sha256 (metadata {_META_SHA}), so it was not written "
            "by tqstore and cannot be trusted: delete it and push again"
        )
    actual = hashlib.sha256(body).hexdigest()
    if actual != expected.lower():
        raise CorruptBlock(
            f"S3 object {name} failed verification: sha256 {actual} of {format_size(len(body))} "
            f"does not match {expected}; it was changed or damaged in the bucket: delete it and "
            "push it again from a machine that has it"
        )
