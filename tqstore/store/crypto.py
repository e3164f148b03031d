"""Encryption at rest for the S3 tier: AES-256-GCM over every object and manifest, client-side.

Off by default. It is on when a key is configured: the environment variable TQSTORE_S3_KEY
(base64 of 32 random bytes, e.g. `openssl rand -base64 32`) or the file named by `s3.key_file`
(TQSTORE_S3_KEY_FILE) holding the same text; the variable wins. The key never leaves the
machine: the bucket holds only envelopes, and the config file only the key file's path.

Envelope (what the bucket stores instead of the plaintext):

    magic b"\\x89TQE\\r\\n\\x1a\\n" (8) | version u8 | key id (8) | nonce (12) | ciphertext | tag (16)

- version 1: objects.
- version 3: manifests. The plaintext starts with the manifest's version, a u64 counter that
  each push raises past the highest this machine has seen for the entry, then the manifest's
  address (u16 length, then the UTF-8 of `s3://BUCKET/PREFIXmanifests/NAME.json`). Pulls refuse
  a manifest older than the one seen (ManifestRollback): AES-GCM alone proves who wrote a
  manifest, not that it is the latest, so a bucket writer could otherwise replay an older one;
  and one whose address is not where it was read (ManifestMoved): a manifest copied from another
  prefix, bucket or entry name (issue 27). The highest version seen per bucket and entry is kept
  in home/s3-manifest-versions.json.
- versions 1 and 2 of manifests (sealed by an older tqstore, without their address) are refused
  (UnboundManifest): a copy of one from another prefix could not be told from the real one. A
  push from the machine that pushed or pulled it replaces it; see docs/tiers.md.
- key id: the first 8 bytes of HMAC-SHA256(key, "tqstore-s3-key-id"). It tells a wrong key
  (EncryptionKeyError, naming where the key came from) from a damaged or altered object
  (CorruptBlock: a miss with a reason), and reveals nothing usable about the key.
- associated data: "tqstore-s3", the kind ("object" or "manifest"), for an object its key in
  hex, and the envelope header. An object envelope copied to another key, or served as a
  manifest, fails authentication like a flipped bit does. Objects are not bound to a prefix:
  their keys are content addresses (chained sha256 over the model, codec and tokens) and every
  pull checks a payload's key, identity and tokens, so an object copied under another prefix is
  the very block that prefix would hold under that key.
- nonce: 96 random bits per envelope. NIST SP 800-38D bounds random nonces to 2^32 envelopes
  per key; rotate keys long before that (a new key means pushing into a new prefix).

What stays visible in the bucket: entry names (manifest keys), object keys (chained sha256
digests of the tokens, so whoever has the model and guesses a document can confirm the guess),
sizes, times, and the sha256 of each plaintext (metadata `tq-sha256`, which the pushes and pulls
compare). The content is hidden: the tokens that manifests otherwise carry in clear, and the
cached K/V.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from tqstore.config import Config
from tqstore.durable import write_file_atomic
from tqstore.errors import ConfigError, CorruptBlock, RemoteAuthError, TqstoreError
from tqstore.keys import parse_key
from tqstore.store.home_lock import HomeLock

log = logging.getLogger("tqstore.store.crypto")
KEY_ENV = "TQSTORE_S3_KEY"
MAGIC = b"\x89TQE\r\n\x1a\n"
VERSION = 1
MANIFEST_VERSION = 3  # the envelope version of manifests: a counter and the address, then the manifest
UNBOUND_MANIFEST_VERSIONS = (1, 2)  # manifests sealed by older tqstores: no address, refused
VERSIONS_FILE = "s3-manifest-versions.json"
_COUNTER = struct.Struct("<Q")
_ADDRESS_LENGTH = struct.Struct("<H")
SCHEME = "aes-256-gcm-v1"  # the `tq-enc` metadata of encrypted objects
_HEADER = struct.Struct("<8sB8s")
_NONCE = 12
_TAG = 16
OVERHEAD = _HEADER.size + _NONCE + _TAG  # envelope bytes beyond the plaintext (45)


class EncryptionKeyError(RemoteAuthError):
    """An encrypted object cannot be opened with the configured key (or no key is configured)."""


class ManifestRollback(CorruptBlock):
    """The bucket holds an older version of a manifest than this machine has already seen (a
    failed check like a bad tag: listings leave it out, remote gc then deletes nothing)."""


class ManifestMoved(CorruptBlock):
    """A bucket manifest sealed for another address (bucket, prefix or entry name) than the one
    it was read from: copied or moved there. Refused like a failed tag."""


class UnboundManifest(CorruptBlock):
    """A bucket manifest sealed by an older tqstore, which did not seal its address. `etag` (set
    by the S3 tier) lets a push recognise its own and replace it."""

    etag: str | None = None


@dataclass(frozen=True)
class ManifestVersions:
    """The highest manifest version seen per entry of one bucket location (`scope`), kept in a
    JSON file shared by the processes of one home (read-modify-write under a file lock)."""

    path: Path
    scope: str

    def highest(self, name: str) -> int:
        """The highest version of manifest `name` seen here (0: none)."""
        return self._read().get(self.scope, {}).get(name, 0)

    def check(self, name: str, version: int, where: str) -> None:
        """Record `version` of manifest `name` as seen; ManifestRollback if a higher one was."""
        with self._locked():
            data = self._read()
            seen = data.get(self.scope, {}).get(name, 0)
            if version < seen:
                raise ManifestRollback(
                    f"S3 object {where} is version {version} of entry {name}'s manifest, but this machine has seen "
                    f"version {seen}: the bucket was rolled back to an older manifest (replayed, or restored from a "
                    f"backup). Nothing was changed here. From a machine that has the entry, remove the bucket's copy "
                    f"(tqstore rm --remote {name}) and push it again; if the older version is wanted, remove "
                    f"{name!r} under {self.scope!r} from {self.path} and pull again")
            if version > seen:
                data.setdefault(self.scope, {})[name] = version
                self._write(data)

    def _read(self) -> dict[str, dict[str, int]]:
        try:
            data = json.loads(self.path.read_bytes())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            # A damaged file would otherwise stop every pull: start over (weaker, never wrong).
            log.warning("ignoring %s (%s): manifest rollbacks are checked from now on only", self.path, exc)
            return {}
        return data if isinstance(data, dict) else {}

    def _write(self, data: dict[str, dict[str, int]]) -> None:
        try:
            write_file_atomic(self.path, json.dumps(data, sort_keys=True).encode())
        except (OSError, TqstoreError) as exc:  # a full disk: a read must not fail for this record
            log.warning("cannot record manifest versions in %s: %s", self.path, exc)

    def _locked(self):
        return HomeLock(self.path.with_name("." + self.path.name + ".lock")).exclusive()


@dataclass(frozen=True)
class ObjectCipher:
    """Seals and opens S3 payloads with one key. `source` says where the key came from."""

    key: bytes = field(repr=False)
    source: str
    versions: ManifestVersions | None = None  # None: manifests are sealed without rollback checks

    def __post_init__(self) -> None:
        if len(self.key) != 32:
            raise ConfigError(f"the S3 encryption key from {self.source} is {len(self.key)} bytes; it must be 32")

    @property
    def key_id(self) -> bytes:
        return hmac.new(self.key, b"tqstore-s3-key-id", hashlib.sha256).digest()[:8]

    def seal(self, data: bytes, kind: str, name: str, where: str) -> bytes:
        """The envelope of `data`: an object bound to its key `name`; a manifest (entry `name`)
        to its address `where` (s3://BUCKET/KEY) and the next version after the highest seen
        here (see `written`)."""
        version, bound = VERSION, name
        if kind == "manifest":
            seen = self.versions.highest(name) if self.versions is not None else 0
            address = where.encode()
            version, bound = MANIFEST_VERSION, ""  # the address is inside, so a move is named, not a bad tag
            data = _COUNTER.pack(next_version(seen)) + _ADDRESS_LENGTH.pack(len(address)) + address + bytes(data)
        header = _HEADER.pack(MAGIC, version, self.key_id)
        nonce = os.urandom(_NONCE)
        return header + nonce + AESGCM(self.key).encrypt(nonce, bytes(data), _aad(header, kind, bound))

    def written(self, blob: bytes, kind: str, name: str, where: str) -> None:
        """An envelope from `seal` is in the bucket now: remember its manifest version as seen."""
        if kind == "manifest":
            self.open(blob, kind, name, where)

    def open(self, blob: bytes, kind: str, name: str, where: str) -> bytes:
        """The plaintext of an envelope written by `seal` for `kind` and `name` at `where`.

        CorruptBlock if it is not an envelope or fails authentication; EncryptionKeyError if it
        was sealed with another key. A manifest must also have been sealed for `where` (else
        ManifestMoved), by this tqstore (else UnboundManifest), and be no older than the highest
        version seen here (else ManifestRollback).
        """
        if not is_sealed(blob):
            raise CorruptBlock(f"S3 object {where} is not encrypted although encryption at rest is on (key from "
                               f"{self.source}): it was pushed without encryption or replaced; delete it and push "
                               "it again")
        if len(blob) < OVERHEAD:
            raise CorruptBlock(f"S3 object {where} is a truncated envelope ({len(blob)} bytes): delete it and push "
                               "it again")
        header = bytes(blob[:_HEADER.size])
        _, version, key_id = _HEADER.unpack(header)
        readable = (*UNBOUND_MANIFEST_VERSIONS, MANIFEST_VERSION) if kind == "manifest" else (VERSION,)
        if version not in readable:
            raise CorruptBlock(f"S3 object {where} has envelope version {version}, this tqstore reads "
                               f"{' and '.join(map(str, readable))} for a {kind}: upgrade tqstore, or delete the "
                               "object and push it again")
        if not hmac.compare_digest(key_id, self.key_id):
            raise EncryptionKeyError(f"S3 object {where} was encrypted with another key than the one from "
                                     f"{self.source}: set the key it was pushed with")
        nonce = bytes(blob[_HEADER.size:_HEADER.size + _NONCE])
        legacy = kind == "manifest" and version in UNBOUND_MANIFEST_VERSIONS
        bound = "" if kind == "manifest" and not legacy else name
        try:
            plain = AESGCM(self.key).decrypt(nonce, bytes(blob[_HEADER.size + _NONCE:]), _aad(header, kind, bound))
        except InvalidTag:
            raise CorruptBlock(f"S3 object {where} failed authentication (AES-GCM): it was altered, damaged or "
                               "moved in the bucket; delete it and push it again") from None
        if kind != "manifest":
            return plain
        if legacy:
            raise UnboundManifest(
                f"S3 object {where} is entry {name}'s manifest as an older tqstore sealed it, without the bucket, "
                f"prefix and name it belongs to, so a copy from another prefix cannot be told from it: push the "
                f"entry again (tqstore push {name}) from the machine that pushed it, or from any machine that has "
                f"it after tqstore rm --remote {name}")
        counter, address, plain = _manifest_fields(plain, where)
        if address != where:
            raise ManifestMoved(
                f"S3 object {where} is the manifest sealed for {address}: it was copied or moved there (from "
                f"another prefix, bucket or entry name), so it is not entry {name}'s. Nothing was changed here. "
                f"Push the entry again from a machine that has it (tqstore rm --remote {name} first if the push "
                "reports a conflict)")
        if self.versions is not None:
            self.versions.check(name, counter, where)
        return plain


def is_sealed(blob: bytes) -> bool:
    """Whether `blob` starts like an envelope."""
    return bytes(blob[:len(MAGIC)]) == MAGIC


def open_payload(cipher: ObjectCipher | None, blob: bytes, kind: str, name: str, where: str) -> bytes:
    """What an S3 GET returned, as plaintext: opened with `cipher`, or as is when encryption is
    off (EncryptionKeyError for an envelope then: the key is missing)."""
    if cipher is not None:
        return cipher.open(blob, kind, name, where)
    if is_sealed(blob):
        raise EncryptionKeyError(f"S3 object {where} is encrypted (tqstore encryption at rest): set {KEY_ENV} or "
                                 "s3.key_file to the key it was pushed with")
    return blob


def cipher_from_config(config: Config) -> ObjectCipher | None:
    """The cipher of the configured key ($TQSTORE_S3_KEY, else s3.key_file), or None (off)."""
    versions = ManifestVersions(config.home / VERSIONS_FILE, config.s3_url or "")
    text = os.environ.get(KEY_ENV)
    if text:
        return ObjectCipher(parse_key(text, KEY_ENV), KEY_ENV, versions)
    if config.s3_key_file is None:
        return None
    path = Path(config.s3_key_file).expanduser()
    try:
        text = path.read_text(encoding="ascii")
    except (OSError, UnicodeError) as exc:
        raise ConfigError(f"cannot read the S3 encryption key file {path} (s3.key_file): {exc}") from None
    return ObjectCipher(parse_key(text, str(path)), str(path), versions)


def next_version(seen: int) -> int:
    """The version a manifest is sealed with: after the highest this machine has seen, and no
    lower than the time in milliseconds. A counter alone restarted at 1 on a machine that never
    saw the entry, so a new entry under a name another machine had removed (`rm --remote`, or
    expiry and `gc --remote`) was refused as a rollback on every machine that saw the old one;
    the clock carries the order across machines (a clock behind by more than the time between
    the two entries still gives that refusal, never a replay taken for new)."""
    return max(seen + 1, time.time_ns() // 1_000_000)


def _manifest_fields(plain: bytes, where: str) -> tuple[int, str, bytes]:
    """(version, address, manifest bytes) of an authenticated version-3 manifest plaintext."""
    start = _COUNTER.size + _ADDRESS_LENGTH.size
    if len(plain) < start:
        raise CorruptBlock(f"S3 object {where} is a manifest envelope without its version and address: delete it "
                           "and push it again")
    (counter,), (length,) = _COUNTER.unpack_from(plain), _ADDRESS_LENGTH.unpack_from(plain, _COUNTER.size)
    try:
        address = bytes(plain[start:start + length]).decode()
    except UnicodeDecodeError:
        address = ""
    if len(plain) < start + length or not address:
        raise CorruptBlock(f"S3 object {where} is a manifest envelope with a damaged address: delete it and push it "
                           "again")
    return counter, address, plain[start + length:]


def _aad(header: bytes, kind: str, name: str) -> bytes:
    return b"tqstore-s3\0" + kind.encode() + b"\0" + name.encode() + b"\0" + header
