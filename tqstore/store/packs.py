"""The bucket's layout 2: pack objects and the map of each pushed manifest (docs/format.md,
"The bucket").

A push sends the objects the bucket lacks as a few packs instead of one object each. A pack is
its members' bodies back to back (each one exactly what a layout-1 object would hold: the
payload, or its envelope when the bucket is encrypted), then its index, then a footer:

    member bodies | index | index length u32 LE | b"TQPACK01"

The index is canonical JSON, sealed like the members (an envelope of kind "pack" bound to the
pack's name) when the bucket is encrypted, so nothing readable is in an encrypted pack.
The index names every member by its object key, the sha256 of its plaintext payload, and its
byte range; a pack's name is the sha256 of its index, known before the bodies are read (the
members' digests and sizes are in the entry's manifest), so a push cut off and run again
finds the packs it had finished by name, whether or not the bucket is encrypted.

A map says where each object of one bucket manifest lives: in a pack (name, offset, length) or
loose (layout 1, `objects/`). It is named by the sha256 of the manifest's canonical bytes and
written before the manifest, so a manifest without a map is a layout-1 entry. Objects are
still content-addressed by key and verified against the manifest's sha256 wherever they live:
two entries that share a prefix share its members, whichever pack holds them.
"""

from __future__ import annotations

import functools
import hashlib
import json
import struct
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from tqstore.canonical import canonical_json
from tqstore.errors import MalformedHeader
from tqstore.format.manifest import Manifest

PACK_FORMAT = "tqstore-pack"
MAP_FORMAT = "tqstore-bucket-map"
LAYOUT = 2  # the bucket layout packs and maps make (1: one object per block)
PACK_MAGIC = b"TQPACK01"
_FOOTER = struct.Struct("<I8s")
FOOTER_SIZE = _FOOTER.size
PACK_TAIL = 1024 * 1024  # bytes read from a pack's end to find its index (enough for ~8,000 members)
PACK_BYTES: int | None = None  # a push's packs hold about this many bytes; None: one part (s3.part_size)
_HEX = frozenset("0123456789abcdef")


@dataclass(frozen=True)
class Location:
    """Where one object's body lies in the bucket: bytes [offset, offset + length) of pack
    `pack` (hex name), or a loose layout-1 object when `pack` is None."""

    pack: str | None
    offset: int = 0
    length: int = 0


@dataclass(frozen=True)
class Member:
    """One object in a pack: its key, the sha256 (hex) and size of its plaintext payload, and
    the length of its body in the pack (the payload, or its envelope)."""

    key: bytes
    sha256: str
    size: int
    length: int


@dataclass(frozen=True)
class PackPlan:
    """A pack before its bodies are read: members in order, their offsets, the index."""

    members: tuple[Member, ...]
    sealed: str | None  # the key id (hex) of the envelopes, None when unencrypted

    @functools.cached_property
    def offsets(self) -> list[int]:
        out, at = [], 0
        for m in self.members:
            out.append(at)
            at += m.length
        return out

    @functools.cached_property
    def index(self) -> bytes:
        """The pack's index: canonical JSON of its members and ranges."""
        return canonical_json({
            "format": PACK_FORMAT, "version": 1, "sealed": self.sealed,
            "members": [[m.key.hex(), m.sha256, off, m.length] for m, off in zip(self.members, self.offsets)],
        })

    @functools.cached_property
    def name(self) -> str:
        """The pack's name: the sha256 of its index."""
        return hashlib.sha256(self.index).hexdigest()

    def trailer(self, index: bytes) -> bytes:
        """The pack's last bytes: `index` (as stored: sealed when encrypted), then the footer."""
        return index + _FOOTER.pack(len(index), PACK_MAGIC)

    def size(self, overhead: int) -> int:
        """The pack's size in bytes (bodies, index, footer); `overhead`: what sealing adds."""
        return sum(m.length for m in self.members) + len(self.index) + overhead + FOOTER_SIZE

    def locations(self) -> dict[bytes, Location]:
        name = self.name
        return {m.key: Location(name, off, m.length) for m, off in zip(self.members, self.offsets)}


def plan_packs(members: Sequence[Member], sealed: str | None, limit: int) -> list[PackPlan]:
    """`members` in order, cut into packs of about `limit` bytes (a larger member alone)."""
    packs: list[PackPlan] = []
    current: list[Member] = []
    size = 0
    for m in members:
        if current and size + m.length > limit:
            packs.append(PackPlan(tuple(current), sealed))
            current, size = [], 0
        current.append(m)
        size += m.length
    if current:
        packs.append(PackPlan(tuple(current), sealed))
    return packs


def trailer_length(tail: bytes) -> int | None:
    """The length of a pack's index and footer from its last bytes, or None without a footer."""
    if len(tail) < FOOTER_SIZE:
        return None
    length, magic = _FOOTER.unpack(tail[-FOOTER_SIZE:])
    return length + FOOTER_SIZE if magic == PACK_MAGIC else None


def parse_trailer(tail: bytes, name: str, open_index: Callable[[bytes], bytes]) -> list[tuple[bytes, str, int, int]]:
    """The members (key, sha256, offset, length) of pack `name` from the last bytes of it
    (at least its index and footer); `open_index` opens a sealed index. MalformedHeader (or
    CorruptBlock from `open_index`) if they are not its index."""
    if len(tail) < FOOTER_SIZE:
        raise MalformedHeader(f"pack {name[:12]} is shorter than its footer")
    length, magic = _FOOTER.unpack(tail[-FOOTER_SIZE:])
    if magic != PACK_MAGIC or length > len(tail) - FOOTER_SIZE:
        raise MalformedHeader(f"pack {name[:12]} has no tqstore pack footer")
    index = open_index(bytes(tail[-FOOTER_SIZE - length:-FOOTER_SIZE]))
    if hashlib.sha256(index).hexdigest() != name:
        raise MalformedHeader(f"pack {name[:12]}'s index does not hash to its name")
    try:
        doc = json.loads(index)
        return [(bytes.fromhex(k), s, o, n) for k, s, o, n in doc["members"]]
    except (ValueError, TypeError, KeyError) as exc:
        raise MalformedHeader(f"pack {name[:12]}'s index is malformed ({exc})") from None


def manifest_address(manifest: Manifest) -> str:
    """The name of `manifest`'s map: the sha256 of its canonical bytes."""
    return hashlib.sha256(manifest.to_bytes()).hexdigest()


def map_bytes(manifest: Manifest, where: Mapping[bytes, Location]) -> bytes:
    """The map of `manifest` (as written to the bucket): every object's location."""
    return canonical_json({
        "format": MAP_FORMAT, "version": 1, "manifest": manifest_address(manifest),
        "objects": {r.key.hex(): [where[r.key].pack, where[r.key].offset, where[r.key].length]
                    for r in manifest.objects},
    })


def parse_map(data: bytes, manifest: Manifest) -> dict[bytes, Location]:
    """Locations of `manifest`'s objects from its map; MalformedHeader unless it is that map."""
    where = f"bucket map of entry {manifest.name}"
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        raise MalformedHeader(f"{where} is not JSON") from None
    if not isinstance(doc, dict) or doc.get("format") != MAP_FORMAT or doc.get("version") != 1:
        raise MalformedHeader(f"{where} is not a version-1 tqstore bucket map")
    if doc.get("manifest") != manifest_address(manifest):
        raise MalformedHeader(f"{where} belongs to another manifest")
    objects = doc.get("objects")
    keys = {r.key.hex() for r in manifest.objects}
    if not isinstance(objects, dict) or set(objects) != keys:
        raise MalformedHeader(f"{where} does not list the manifest's objects")
    out = {}
    for key, value in objects.items():
        if not (isinstance(value, list) and len(value) == 3):
            raise MalformedHeader(f"{where}: object {key[:12]} has no location")
        pack, offset, length = value
        if pack is None:
            out[bytes.fromhex(key)] = Location(None)
            continue
        if not (isinstance(pack, str) and len(pack) == 64 and set(pack) <= _HEX and type(offset) is int
                and type(length) is int and offset >= 0 and length > 0):
            raise MalformedHeader(f"{where}: object {key[:12]} has a malformed location")
        out[bytes.fromhex(key)] = Location(pack, offset, length)
    return out


@dataclass(frozen=True)
class Span:
    """One GET of a pull: bytes [start, end) of `pack`, holding the objects `keys` whole; or
    the loose object `keys[0]` when `pack` is None."""

    pack: str | None
    start: int
    end: int
    keys: tuple[bytes, ...]


def plan_spans(located: Iterable[tuple[bytes, Location]], part: int) -> list[Span]:
    """Ranged GETs for `located` objects: neighbours in one pack merged up to `part` bytes;
    loose objects one GET each. In the order of `located` (the first object's span first)."""
    spans: list[Span] = []
    run: list[tuple[bytes, Location]] = []

    def close() -> None:
        if run:
            spans.append(Span(run[0][1].pack, run[0][1].offset, run[-1][1].offset + run[-1][1].length,
                              tuple(k for k, _ in run)))
            run.clear()

    for key, loc in located:
        if loc.pack is None:
            close()
            spans.append(Span(None, 0, 0, (key,)))
            continue
        if run and (run[-1][1].pack != loc.pack or run[-1][1].offset + run[-1][1].length != loc.offset
                    or loc.offset + loc.length - run[0][1].offset > part):
            close()
        run.append((key, loc))
    close()
    return spans
