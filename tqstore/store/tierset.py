"""The tiers of one open Store and what its operations share: the home lock, the parsed
manifests, the counters.

The home lock (`HOME/store.lock`, home_lock.HomeLock) orders writers against deleters across
processes and threads: an operation that publishes a manifest (put, pull, import: publish.py)
holds it shared from its first object write to the manifest, and one that deletes objects no
manifest references (eviction, rm, gc) holds it exclusively. Otherwise a gc in another process
could delete an object that a put has just written (or decided to reuse) but not yet
referenced. Readers take no lock: an object deleted under a restore is a miss, never wrong data.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tqstore.format.blocks import BLOCK_SIZE, Block
from tqstore.config import Config
from tqstore.errors import ConfigError, CorruptBlock, FormatError, MalformedHeader, NotFound, RemoteNotConfigured
from tqstore.format.manifest import Manifest
from tqstore.names import is_valid_name
from tqstore.store.crypto import EncryptionKeyError
from tqstore.store.home_lock import HomeLock
from tqstore.store.remote_index import RemoteIndex
from tqstore.store.tiers.lmdb import LmdbTier
from tqstore.store.tiers.memory import HotObject, MemoryTier, holdings

if TYPE_CHECKING:  # the S3 tier (boto3, urllib3) loads only where a bucket is configured
    from tqstore.store.tiers.s3 import S3Tier

TIERS = ("memory", "lmdb", "s3")  # fastest first
PINS_MAX_AGE = 1.0  # seconds a process trusts the pins it read (others may pin and unpin)


@dataclass
class Counters:
    """Events since the Store was opened (stats())."""

    hits: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    misses: int = 0
    evicted_entries: int = 0
    evicted_objects: int = 0
    evicted_bytes: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def hit(self, tier: str, n: int = 1) -> None:
        with self.lock:
            self.hits[tier] += n

    def miss(self, n: int = 1) -> None:
        with self.lock:
            self.misses += n

    def evicted(self, entries: int, objects: int, nbytes: int) -> None:
        with self.lock:
            self.evicted_entries += entries
            self.evicted_objects += objects
            self.evicted_bytes += nbytes


@dataclass(frozen=True)
class RemoteManifest:
    """A manifest read from the bucket, with the object's etag and Last-Modified time."""

    manifest: Manifest
    etag: str
    modified: float


class TierSet:
    """Memory, LMDB and (when configured) S3 tiers of one home, with shared bookkeeping."""

    def __init__(self, config: Config, lmdb: LmdbTier, memory: MemoryTier, s3: S3Tier | None,
                 s3_error: ConfigError | None = None) -> None:
        self.config = config
        self.lmdb = lmdb
        self.memory = memory
        self.s3 = s3
        self.s3_error = s3_error  # why the configured bucket could not be set up (its key file, say)
        self.remote = RemoteIndex(s3) if s3 is not None else None
        self.lock = HomeLock(config.home / "store.lock")
        self.counters = Counters()
        self.block_size = BLOCK_SIZE
        self._cache: dict[str, tuple[int, float, Manifest]] = {}  # name -> (size, last used, parsed)
        self._cache_lock = threading.Lock()
        self._parsed: dict[str, tuple[bytes, Manifest]] = {}  # name -> (bytes, parsed): local_manifest
        self._pins_at: float | None = None  # when refresh_pins last ran (monotonic)

    def require_s3(self) -> S3Tier:
        """The S3 tier; RemoteNotConfigured when there is none, or the ConfigError that kept the
        configured one from being set up."""
        if self.s3_error is not None:
            raise self.s3_error
        if self.s3 is None:
            raise RemoteNotConfigured(
                "no S3 bucket configured: set TQSTORE_S3_URL=s3://BUCKET/PREFIX (or `s3.url` in "
                f"{self.config.config_path}), and TQSTORE_S3_ENDPOINT for non-AWS servers"
            )
        return self.s3

    def local_manifest(self, name: str) -> Manifest | None:
        """The local manifest `name`, parsed (FormatError if it is damaged), or None. The same
        bytes parse to the same manifest: the last parse of each name is kept with its bytes
        (a restore by name would otherwise re-check every token and recompute every key)."""
        read = self.local_manifest_read(name)
        return None if read is None else read[1]

    def local_manifest_read(self, name: str) -> tuple[bytes, Manifest] | None:
        """(the stored bytes, the parsed manifest) of `name`, or None: the bytes are what a
        compare-and-swap (`LmdbTier.replace_manifest`) must expect."""
        data = self.lmdb.get_manifest(name)
        if data is None:
            return None
        data = bytes(data)
        with self._cache_lock:
            seen = self._parsed.get(name)
        if seen is not None and seen[0] == data:
            return data, seen[1]
        manifest = check_name(Manifest.from_bytes(data), name)
        with self._cache_lock:
            if len(self._parsed) >= 1024:
                self._parsed.clear()
            self._parsed[name] = (data, manifest)
        return data, manifest

    def require_manifest(self, name: str) -> Manifest:
        """The local manifest `name`; NotFound (saying where to look) if there is none."""
        manifest = self.local_manifest(name)
        if manifest is None:
            raise not_found(name, self)
        return manifest

    def remote_manifests(self, names: list[str] | None = None) -> tuple[list[RemoteManifest], list[str]]:
        """(each readable bucket manifest, names that failed to parse or verify); all by listing,
        or only `names`. One damaged manifest, or one sealed with another key, must not hide the
        others; when no manifest opens and some failed for the key, this machine's key is the
        fault, so that EncryptionKeyError is raised."""
        s3 = self.require_s3()
        listed = s3.list_manifests()
        if names is not None:
            listed = [info for info in listed if info.name in names]
        found, unreadable, key_errors = [], [], []
        for info in listed:
            try:
                got = s3.get_manifest(info.name)
                if got is None:
                    continue  # deleted since the listing
                found.append(RemoteManifest(check_name(Manifest.from_bytes(got[0]), info.name), got[1],
                                            info.last_used))
            except (FormatError, CorruptBlock):  # CorruptBlock: its digest or AES-GCM tag failed
                unreadable.append(info.name)
            except EncryptionKeyError as exc:
                unreadable.append(info.name)
                key_errors.append(exc)
        if key_errors and not found:
            raise key_errors[0]
        return found, unreadable

    def local_manifests(self) -> tuple[list[tuple[Manifest, float]], list[str]]:
        """(every readable local manifest with its last-used time, names that failed to parse).

        Parsed manifests are cached by (size, last-used time): a put or touch changes the time,
        so a replaced manifest is parsed again.
        """
        entries, unreadable = [], []
        with self._cache_lock:
            cache = dict(self._cache)
        fresh = {}
        for info in self.lmdb.list_manifests():
            if not is_valid_name(info.name):  # a damaged key (verify lists it, repair drops it)
                unreadable.append(info.name)
                continue
            hit = cache.get(info.name)
            if hit is not None and hit[:2] == (info.size, info.last_used):
                fresh[info.name] = hit
            else:
                try:
                    manifest = self.local_manifest(info.name)
                except FormatError:
                    unreadable.append(info.name)
                    continue
                if manifest is None:
                    continue  # deleted since the listing
                fresh[info.name] = (info.size, info.last_used, manifest)
            entries.append((fresh[info.name][2], info.last_used))
        with self._cache_lock:
            self._cache = fresh
        return entries, unreadable

    def refresh_pins(self) -> None:
        """Pin the objects of pinned local entries in the memory tier."""
        entries, _ = self.local_manifests()
        self.memory.set_pinned(r.key for m, _ in entries if m.pinned for r in m.objects)
        self._pins_at = time.monotonic()

    def ensure_pins(self) -> None:
        """refresh_pins before the memory tier first needs to know the pins, and again once they
        are PINS_MAX_AGE old: another process (`tqstore pin` beside a server) changes them too,
        and a server that read them once kept a CLI pin's objects evictable (and an unpinned
        entry's held over the budget) until it restarted."""
        if self._pins_at is None or time.monotonic() - self._pins_at > PINS_MAX_AGE:
            self.refresh_pins()

    def keep_joined(self, blocks: list[tuple[bytes, HotObject, str]], joined: list[Block],
                    others: list[tuple[bytes, HotObject, str]]) -> None:
        """Keep in memory the blocks of a restore's or put's join (`blocks`: key, object, the
        tier it came from) as `join_resident` left them (`joined`: views of the joined arrays,
        so the next restore of them is a slice), and its other objects. Blocks that view joined
        arrays go in at once, since they share them (counted once), or, when together they do
        not fit in the budget, not at all (views of one array cannot be evicted apart). What
        the memory tier already holds as it is is not put again."""
        self.ensure_pins()
        items = []
        for (key, hot, tier), block in zip(blocks, joined):
            if block is not hot.obj:
                items.append((key, dataclasses.replace(hot, obj=block)))
            elif tier != "memory":
                items.append((key, hot))
        if any(holdings(hot.obj)[1] for _, hot in items):
            self.memory.put_all(items)
        else:  # blocks joined by layer (no joined arrays to share): each kept as it fits
            others = [(key, hot, "") for key, hot in items] + others
        for key, hot, tier in others:
            if tier != "memory":
                self.memory.put(key, hot)

    def where_all(self, keys: Sequence[bytes]) -> list[str | None]:
        """The fastest tier believed to hold each key, or None; LMDB is asked once, for the keys
        memory lacks."""
        found: list[str | None] = ["memory" if self.memory.has(k) else None for k in keys]
        rest = [i for i, tier in enumerate(found) if tier is None]
        for i, held in zip(rest, self.lmdb.has_objects([keys[i] for i in rest]) if rest else ()):
            if held:
                found[i] = "lmdb"
            elif self.remote is not None and self.remote.has(keys[i]):
                found[i] = "s3"
        return found


def not_found(name: str, tiers: "TierSet") -> NotFound:
    """The error for a missing local entry."""
    hint = f" or `tqstore pull {name}` it from the bucket" if tiers.s3 is not None else ""
    return NotFound(f"no entry {name} in the store at {tiers.config.home}: `tqstore ls` lists the entries{hint}")


def check_name(manifest: Manifest, name: str) -> Manifest:
    """`manifest` if it was stored under its own name; a manifest that names another entry was
    copied or damaged and is not to be trusted (MalformedHeader)."""
    if manifest.name != name:
        raise MalformedHeader(f"the manifest stored as {name!r} names itself {manifest.name!r}: remove it "
                              f"(tqstore rm {name}) and save or pull the entry again")
    return manifest


def slowest(tiers: list[str]) -> str:
    """The slowest of `tiers` (what a restore that uses all of them waits for)."""
    return max(tiers, key=TIERS.index) if tiers else "memory"
