"""A portable single-file bundle of one entry: its manifest and every object it needs.

Layout (all integers little-endian; docs/format.md has the full specification):

    frame  64 bytes   magic "\\x89TQB\\r\\n\\x1a\\n", u32 version, u32 reserved (0),
                      u64 TOC length, u64 body length, sha256 of the body
    body   TOC (canonical JSON) then the data: the manifest bytes, then each object's bytes
           in TOC order

The TOC gives each piece's offset and length inside the data and its sha256. `read_bundle`
verifies the frame, the body digest, the TOC and every piece's digest before it returns
anything. Files are published atomically (`write_file_atomic`).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct

from tqstore.durable import write_file_atomic
from tqstore.errors import BadMagic, ChecksumMismatch, MalformedHeader, TruncatedData
from tqstore.format.versions import check_version

BUNDLE_MAGIC = b"\x89TQB\r\n\x1a\n"
BUNDLE_VERSION = 1
READABLE_BUNDLE_VERSIONS = frozenset({1})
_FRAME = struct.Struct("<8sIIQQ32s")
FRAME_SIZE = _FRAME.size  # 64
MAX_KEY_BYTES = 255


def write_bundle(path: str | os.PathLike, manifest_bytes: bytes, objects: dict[bytes, bytes]) -> None:
    """Write an entry's manifest and objects (key -> bytes) as one bundle file, atomically."""
    for key in objects:
        if not isinstance(key, bytes) or not 0 < len(key) <= MAX_KEY_BYTES:
            raise ValueError(f"object keys are 1..{MAX_KEY_BYTES} raw bytes, got {key!r:.80}")
    pieces = [manifest_bytes] + [objects[k] for k in sorted(objects)]
    offsets = [0]
    for p in pieces:
        offsets.append(offsets[-1] + len(p))

    def entry(i: int) -> dict:
        return {"offset": offsets[i], "length": len(pieces[i]), "sha256": hashlib.sha256(pieces[i]).hexdigest()}

    toc = {"manifest": entry(0),
           "objects": [{"key": k.hex(), **entry(i + 1)} for i, k in enumerate(sorted(objects))]}
    toc_bytes = json.dumps(toc, sort_keys=True, separators=(",", ":")).encode()
    body = hashlib.sha256(toc_bytes)
    for p in pieces:
        body.update(p)
    frame = _FRAME.pack(BUNDLE_MAGIC, BUNDLE_VERSION, 0, len(toc_bytes), len(toc_bytes) + offsets[-1], body.digest())
    write_file_atomic(path, [frame, toc_bytes, *pieces])


def read_bundle(path: str | os.PathLike) -> tuple[bytes, dict[bytes, bytes]]:
    """(manifest bytes, {key: object bytes}) of a bundle, after verifying every digest."""
    with open(path, "rb") as f:
        data = f.read()
    return parse_bundle(data, str(path))


def parse_bundle(data: bytes, name: str = "bundle") -> tuple[bytes, dict[bytes, bytes]]:
    """`read_bundle` on bytes already in memory."""
    if len(data) < FRAME_SIZE:
        if not BUNDLE_MAGIC.startswith(data[:len(BUNDLE_MAGIC)]):
            raise BadMagic(f"{name} is not a tqstore bundle (wrong magic bytes)")
        raise TruncatedData(f"{name} is truncated: {len(data)} bytes, shorter than the {FRAME_SIZE}-byte frame; "
                            "copy or export it again")
    magic, version, reserved, toc_len, body_len, digest = _FRAME.unpack_from(data)
    if magic != BUNDLE_MAGIC:
        raise BadMagic(f"{name} is not a tqstore bundle (wrong magic bytes)")
    check_version(version, READABLE_BUNDLE_VERSIONS, f"bundle {name}", "export it again with this tqstore")
    if len(data) - FRAME_SIZE != body_len:
        raise TruncatedData(f"{name} has {len(data) - FRAME_SIZE} bytes after its frame, the frame says {body_len}; "
                            "the file is truncated or has trailing data: copy or export it again")
    body = memoryview(data)[FRAME_SIZE:]
    if hashlib.sha256(body).digest() != digest:
        raise ChecksumMismatch(f"{name} is corrupt (its sha256 does not match its frame): copy or export it again")
    if reserved != 0 or toc_len > body_len:
        raise MalformedHeader(f"{name} has an inconsistent frame (reserved {reserved}, TOC length {toc_len})")
    toc = _parse_toc(bytes(body[:toc_len]), name)
    blob = body[toc_len:]
    pieces = [toc["manifest"]] + toc["objects"]
    expected = 0
    for p in pieces:
        if p["offset"] != expected:
            raise MalformedHeader(f"{name}: TOC pieces are not contiguous at offset {p['offset']}")
        expected += p["length"]
    if expected != len(blob):
        raise MalformedHeader(f"{name}: TOC covers {expected} data bytes, the bundle holds {len(blob)}")
    out = []
    for p in pieces:
        piece = bytes(blob[p["offset"]:p["offset"] + p["length"]])
        if hashlib.sha256(piece).hexdigest() != p["sha256"]:
            raise ChecksumMismatch(f"{name}: object {p.get('key', 'manifest')} is corrupt (sha256 mismatch)")
        out.append(piece)
    objects = {bytes.fromhex(p["key"]): b for p, b in zip(toc["objects"], out[1:])}
    if len(objects) != len(toc["objects"]):
        raise MalformedHeader(f"{name}: the TOC lists an object key twice")
    return out[0], objects


def _parse_toc(raw: bytes, name: str) -> dict:
    try:
        toc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise MalformedHeader(f"{name}: the table of contents is not valid JSON ({e})") from None
    if not isinstance(toc, dict) or set(toc) != {"manifest", "objects"} or not isinstance(toc["objects"], list):
        raise MalformedHeader(f"{name}: the table of contents needs exactly 'manifest' and 'objects'")
    _check_piece(toc["manifest"], {"offset", "length", "sha256"}, name)
    for p in toc["objects"]:
        _check_piece(p, {"key", "offset", "length", "sha256"}, name)
        key = p["key"]
        if not isinstance(key, str) or not 0 < len(key) <= 2 * MAX_KEY_BYTES or len(key) % 2 \
                or any(c not in "0123456789abcdef" for c in key):
            raise MalformedHeader(f"{name}: object key {key!r:.80} is not lowercase hex")
    return toc


def _check_piece(p, keys: set[str], name: str) -> None:
    if not isinstance(p, dict) or set(p) != keys:
        raise MalformedHeader(f"{name}: a TOC entry needs exactly {sorted(keys)}")
    for k in ("offset", "length"):
        if type(p[k]) is not int or p[k] < 0:
            raise MalformedHeader(f"{name}: TOC {k} {p[k]!r} is not a non-negative integer")
    if not isinstance(p["sha256"], str) or len(p["sha256"]) != 64:
        raise MalformedHeader(f"{name}: TOC sha256 {p['sha256']!r:.80} is not 64 hex digits")
