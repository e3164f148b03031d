"""What this process knows the bucket holds, so lookups and pushes do not send a HEAD per block.

Filled from the manifests read from the bucket (a manifest is written after its objects, so its
objects are there) and from the objects this process pushed or found there. Where an object
lives (a pack's byte range, or loose) comes from the map of a manifest that lists it (packs.py),
read once per manifest when first needed and kept: maps never change, but a remote gc may
delete them (and packs, layout-1 objects). One of this process tells the index what it deleted
(`collected`); one on another machine cannot, so a push skips writing a map only when the index
read or wrote it under that push's bucket lock (`map_known(..., since=)`), and otherwise reads
it from the bucket first. A refresh LISTs the manifests and GETs the ones
that changed, at most once per `max_age` seconds. The index only decides where a restore looks
first: a stale entry costs a miss (the restore verifies every object), never wrong data, so LIST
is never trusted for correctness.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

from tqstore.errors import CorruptBlock, FormatError, TqstoreError
from tqstore.format.manifest import Manifest
from tqstore.store.crypto import EncryptionKeyError
from tqstore.store.packs import Location, manifest_address, parse_map

if TYPE_CHECKING:  # the S3 tier (boto3, urllib3) loads only where a bucket is configured
    from tqstore.store.tiers.s3 import S3Tier

Located = tuple[str, int, Location]  # (sha256 of the payload, its size, where its body lies)


class RemoteIndex:
    """Remote manifests (with their etags) and object keys, as last seen."""

    def __init__(self, s3: S3Tier, max_age: float = 60.0) -> None:
        self.s3 = s3
        self.max_age = max_age
        self.last_error: str | None = None  # why the last refresh failed, for stats()
        self._lock = threading.Lock()
        self._manifests: dict[str, tuple[float, int, Manifest, str]] = {}  # name -> (modified, size, m, etag)
        self._pushed: set[bytes] = set()
        self._placed: dict[bytes, Located] = {}  # objects this process pushed, and where
        self._maps: dict[str, dict[bytes, Location] | None] = {}  # manifest address -> its map (None: layout 1)
        self._confirmed: dict[str, float] = {}  # manifest address -> time.monotonic() its map was read or written
        self._gone: set[bytes] = set()  # found missing or damaged in the bucket
        self._sealed: set[str] = set()  # manifests the last refresh could not open for the key (none, or another)
        self._keys: set[bytes] = set()
        self._refreshed = float("-inf")
        self._busy = False  # a refresh is running

    def manifests(self) -> list[tuple[Manifest, str]]:
        """Every known remote manifest and its etag. The first call refreshes and waits (so a
        one-shot lookup sees the bucket); later stale calls refresh in the background, so a slow
        or unreachable bucket delays no lookup but the first."""
        if self._refreshed == float("-inf"):
            self.refresh()
        elif time.monotonic() - self._refreshed > self.max_age:
            with self._lock:
                start, self._refreshed = not self._busy, time.monotonic()
            if start:
                threading.Thread(target=self.refresh, name="tqstore-remote-index", daemon=True).start()
        with self._lock:
            return [(m, etag) for _, _, m, etag in self._manifests.values()]

    def refresh(self) -> None:
        """LIST the bucket's manifests and GET those that changed. A failure is remembered in
        `last_error` and leaves what was known (S3 being down must not break local lookups)."""
        with self._lock:
            if self._busy:
                return
            self._busy, self._refreshed = True, time.monotonic()
        try:
            self._refresh()
        finally:
            with self._lock:
                self._busy = False

    def _refresh(self) -> None:
        try:
            listed = self.s3.list_manifests()
            with self._lock:
                known = dict(self._manifests)
            fresh, key_errors, sealed = {}, [], set()
            for info in listed:
                old = known.get(info.name)
                if old is not None and old[:2] == (info.last_used, info.size):
                    fresh[info.name] = old
                    continue
                try:
                    got = self.s3.get_manifest(info.name)
                    if got is None:
                        continue  # deleted since the listing
                    manifest = Manifest.from_bytes(got[0])
                except (FormatError, CorruptBlock):
                    continue  # a damaged or newer manifest matches nothing; `gc --remote` reports it
                except EncryptionKeyError as exc:  # one entry under another key must not hide the rest
                    key_errors.append(exc)
                    sealed.add(info.name)
                    continue
                if manifest.name != info.name:
                    continue  # copied under another name: not to be trusted
                fresh[info.name] = (info.last_used, info.size, manifest, got[1])
            with self._lock:
                self._sealed = sealed
            if key_errors and not fresh:
                raise key_errors[0]  # nothing opens: this machine's key is the fault
        except TqstoreError as exc:
            self.last_error = str(exc)
            return
        self.last_error = None
        with self._lock:
            self._manifests = fresh
            self._rebuild()

    def sealed(self) -> list[str]:
        """The bucket's manifests the last refresh could not open with this machine's key (or
        without one: encrypted ones), by name."""
        with self._lock:
            return sorted(self._sealed)

    def has(self, key: bytes) -> bool:
        """Whether the bucket is believed to hold object `key`."""
        with self._lock:
            return key in self._keys

    def note_manifest(self, manifest: Manifest, etag: str) -> None:
        """Record a manifest read from or written to the bucket (its objects are there)."""
        with self._lock:
            self._manifests[manifest.name] = (float("nan"), -1, manifest, etag)  # re-read at the next refresh
            self._gone.difference_update(r.key for r in manifest.objects)
            self._rebuild()

    def note_objects(self, keys: Iterable[bytes]) -> None:
        """Record objects uploaded to or found in the bucket."""
        with self._lock:
            keys = set(keys)
            self._pushed |= keys
            self._gone -= keys
            self._rebuild()

    def note_located(self, located: Mapping[bytes, Located]) -> None:
        """Record where objects this process pushed (or found) lie in the bucket."""
        with self._lock:
            self._placed.update(located)
            self._pushed |= set(located)
            self._gone -= set(located)
            self._rebuild()

    def locate(self, keys: Iterable[bytes], sha256s: Mapping[bytes, str] | None = None) -> dict[bytes, Located]:
        """Where the bucket is believed to hold each of `keys` (those it is not believed to hold
        are left out): from this process's pushes, else from the map of a known manifest that
        lists the key (with the digest in `sha256s` where one is given). Reads the maps it
        needs (one GET per manifest, once); a map that cannot be read hides only its manifest."""
        wanted = set(keys)
        digests = sha256s or {}
        out: dict[bytes, Located] = {}
        self.manifests()  # the first use reads the bucket's manifests
        with self._lock:
            for key in wanted:
                found = self._placed.get(key)
                if found is not None and key not in self._gone and digests.get(key, found[0]) == found[0]:
                    out[key] = found
            manifests = [m for _, _, m, _ in self._manifests.values()]
        for manifest in manifests:
            refs = [r for r in manifest.objects if r.key in wanted and r.key not in out
                    and digests.get(r.key, r.sha256) == r.sha256]
            if not refs:
                continue
            where = self._map(manifest)
            if where is False:
                continue
            with self._lock:
                gone = set(self._gone)
            for ref in refs:
                if ref.key not in gone:
                    out[ref.key] = (ref.sha256, ref.size, Location(None) if where is None else where[ref.key])
        return out

    def map_known(self, manifest: Manifest, where: Mapping[bytes, Location], since: float) -> bool:
        """Whether the bucket is known to hold `manifest`'s map placing its objects at `where`,
        as read or written at `since` (time.monotonic()) or later. What an earlier push of this
        process wrote may have been deleted since by another machine's remote gc (after its
        entry was removed): a push trusts only what it has seen under its own bucket lock."""
        address = manifest_address(manifest)
        with self._lock:
            return self._maps.get(address) == dict(where) and self._confirmed.get(address, float("-inf")) >= since

    def note_map(self, manifest: Manifest, where: Mapping[bytes, Location]) -> None:
        """Record the map just written (or read and found placing the objects at `where`) for `manifest`."""
        with self._lock:
            self._maps[manifest_address(manifest)] = dict(where)
            self._confirmed[manifest_address(manifest)] = time.monotonic()

    def _map(self, manifest: Manifest) -> dict[bytes, Location] | None | bool:
        """The locations of `manifest`'s objects: its map, None for a layout-1 manifest (no map),
        False when the map cannot be read now."""
        address = manifest_address(manifest)
        with self._lock:
            if address in self._maps:
                return self._maps[address]
        try:
            read = time.monotonic()
            data = self.s3.get_map(address)
            where = None if data is None else parse_map(data, manifest)
        except (TqstoreError, FormatError):
            return False
        with self._lock:
            self._maps[address] = where
            if where is not None:
                self._confirmed[address] = read
        return where

    def forget(self, name: str) -> None:
        """Drop a manifest deleted from the bucket."""
        with self._lock:
            self._manifests.pop(name, None)
            self._rebuild()

    def collected(self, objects: Iterable[bytes] = (), packs: Iterable[str] = (), maps: Iterable[str] = ()) -> None:
        """Forget what a remote gc of this process deleted from the bucket: layout-1 `objects`
        (by key), `packs` (by name) and `maps` (by manifest address). A map forgotten is read
        again or written again by the next push; an object this process placed in a deleted pack
        or as a deleted loose object is no longer believed held (unless a known manifest lists
        it: its map says where). Forgetting more than was deleted costs a request, never data."""
        objects, packs, maps = set(objects), set(packs), set(maps)
        with self._lock:
            for address in maps:
                self._maps.pop(address, None)
                self._confirmed.pop(address, None)
            lost = {key for key, (_, _, loc) in self._placed.items()
                    if (loc.pack in packs if loc.pack is not None else key in objects)}
            for key in lost:
                del self._placed[key]
            self._pushed -= {key for key in lost | objects if key not in self._placed}
            self._rebuild()

    def gone(self, key: bytes) -> None:
        """Record that the bucket does not hold a good copy of `key` (missing or damaged)."""
        with self._lock:
            self._gone.add(key)
            self._rebuild()

    def counts(self) -> tuple[int, int, int]:
        """(known manifests, known objects, bytes of the known manifests' objects)."""
        with self._lock:
            sizes = {r.key: r.size for _, _, m, _ in self._manifests.values() for r in m.objects}
            return len(self._manifests), len(self._keys), sum(sizes.values())

    def _rebuild(self) -> None:
        listed = {r.key for _, _, m, _ in self._manifests.values() for r in m.objects}
        self._keys = (listed | self._pushed) - self._gone
