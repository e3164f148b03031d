"""The Store: named entries made of content-addressed objects, in memory, LMDB and S3.

    store = Store.open()                                    # $TQSTORE_HOME or ~/.cache/tqstore
    result = store.put("project-x", snap, tokens, model=model_id, codec=codec_id,
                       model_ref="./Qwen3-1.7B", prefill_seconds=12.5)
    match = store.lookup(prompt[:-1], model=model_id.digest, codec=codec_id.digest)
    snap, stats = store.restore(match)                      # or store.load("project-x")
    # stats.tokens were restored: fewer than match.tokens when a block was lost in every tier

The work lives in small modules: put.py (writing), lookup.py (longest prefix), restore.py
(restore across tiers), transfer.py (push, pull), maintenance.py (eviction, rm, gc, verify),
object_checks.py (the checks of an object every one of them applies); format/manifest.py defines the
entry format. docs/tiers.md describes the whole.

One Store per process and home (by real path): `open` returns the open one (the first
configuration wins) and counts opens; the last `close` closes it.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from turboquant.records import Snapshot

from tqstore.config import Config, load_config, resolve_home
from tqstore.units import format_size
from tqstore.errors import ConfigError, DiskFull, InvalidName, NotFound, RemoteError
from tqstore.store.restore import RestoreStats, restore_entry
from tqstore.models.identity import CodecIdentity, ModelIdentity
from tqstore.store.lookup import Match, lookup
from tqstore.store.maintenance import (REMOTE_GRACE, GcStats, Problem, gc, rm_damaged_key, rm_local, rm_remote, verify,
                                      verify_remote)
from tqstore.format.manifest import Manifest
from tqstore.names import validate_name
from tqstore.store.put import PutResult, put_entry
from tqstore.store.tiers.lmdb import LmdbStats, LmdbTier
from tqstore.store.tiers.memory import MemoryTier
from tqstore.store.tierset import TierSet, not_found
from tqstore.store.transfer import Progress, TransferStats, pull, push

__all__ = ["EntryInfo", "GcStats", "Match", "Problem", "PutResult", "RestoreStats", "Store", "StoreStats",
           "TierStats", "TransferStats"]

_STORES: dict[str, Store] = {}  # real path of the home -> this process's open Store
_STORES_LOCK = threading.Lock()


def _s3_tier(config: Config):
    """The configured bucket's tier, imported here: boto3 and urllib3 load only with a bucket."""
    from tqstore.store.tiers.s3 import S3Tier

    return S3Tier.from_config(config)


@dataclass(frozen=True)
class EntryInfo:
    """One entry as `ls` and `info` show it. `location` is "local" or "s3"; `last_used` is the
    last put, restore or touch (local) or the last push (s3)."""

    name: str
    location: str
    tokens: int
    blocks: int
    bytes: int
    scheme: str
    model_ref: str
    model_source: str
    model_digest: str
    codec_digest: str
    created: float
    last_used: float
    prefill_seconds: float
    pinned: bool
    expires: float | None
    expired: bool
    sliding: bool
    metadata: Mapping[str, str]

    @classmethod
    def of(cls, manifest: Manifest, location: str, last_used: float) -> EntryInfo:
        m = manifest
        return cls(m.name, location, len(m.tokens), len(m.blocks), m.nbytes, m.scheme, m.model_ref,
                   m.model_identity.source,
                   m.model_digest.hex(), m.codec_digest.hex(), m.created, last_used, m.prefill_seconds, m.pinned,
                   m.expires, m.expired(time.time()), m.sliding, dict(m.metadata))


@dataclass(frozen=True)
class TierStats:
    """One tier: bytes and objects held (None where unknown), entries, budget, objects served
    by restores since the Store was opened."""

    bytes: int | None
    objects: int | None
    entries: int | None
    budget: int | None
    hits: int


@dataclass(frozen=True)
class StoreStats:
    """Per-tier figures ("memory", "lmdb", and "s3" when configured: what this process knows
    of the bucket, without listing it), misses and evictions since the Store was opened, the
    LMDB file figures, and why the last look at the bucket failed, if it did."""

    tiers: Mapping[str, TierStats]
    misses: int
    evicted_entries: int
    evicted_objects: int
    evicted_bytes: int
    memory_evictions: int
    lmdb: LmdbStats
    remote_error: str | None = None


class Store:
    """The tiered KV-cache store of one home folder. Open it with `Store.open`."""

    def __init__(self, tiers: TierSet) -> None:
        self._tiers = tiers
        self._opens = 0
        self.config: Config = tiers.config
        self.home = tiers.config.home

    @classmethod
    def open(cls, home: str | os.PathLike[str] | None = None, config: Config | None = None) -> Store:
        """The Store of `home` (None: the config's home, $TQSTORE_HOME or ~/.cache/tqstore).

        `config` defaults to `load_config(home)`. The S3 tier is used only when an S3 URL is
        configured. Returns the process's open Store for the same real path if there is one.
        """
        if config is None:
            config = load_config(home)
        elif home is not None and resolve_home(home) != config.home:
            raise ValueError(f"home {home} differs from the config's home {config.home}: pass one of them")
        config.home.mkdir(parents=True, exist_ok=True)
        real = os.path.realpath(config.home)
        with _STORES_LOCK:
            store = _STORES.get(real)
            if store is None:
                s3, s3_error = None, None
                try:
                    s3 = _s3_tier(config) if config.s3_url else None
                except ConfigError as exc:
                    # An unreadable key file must not stop local use: the bucket's commands say why.
                    s3_error = exc
                tiers = TierSet(config, LmdbTier.from_config(config), MemoryTier(config.memory_budget_bytes), s3,
                                s3_error)
                store = _STORES[real] = cls(tiers)
            store._opens += 1
            return store

    @property
    def tiers(self) -> TierSet:
        """The tiers this store moves objects between (for tools that move whole entries, such as
        bundles)."""
        return self._tiers

    def close(self) -> None:
        """Close this Store (the LMDB environment closes with the last of its opens)."""
        with _STORES_LOCK:
            if self._opens == 0:
                return  # closed already
            self._opens -= 1
            if self._opens > 0:
                return
            real = os.path.realpath(self.home)
            if _STORES.get(real) is self:
                del _STORES[real]
        self._tiers.lmdb.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- entries ---------------------------------------------------------------------------------

    def put(self, name: str, snapshot: Snapshot, tokens: Sequence[int], *, model: ModelIdentity,
            codec: CodecIdentity, model_ref: str, prefill_seconds: float, adapter_path: str | None = None,
            pin: bool = False, ttl: float | None = None, metadata: Mapping[str, str] | None = None) -> PutResult:
        """Store `snapshot`, prefilled with `tokens`, as entry `name` (replacing one of that name).

        Objects already stored are reused, never rewritten; the result's snapshot is joined from
        the stored objects (continue from it). `model_ref` and `adapter_path` say where the model
        was loaded from (to load it again for the entry). `pin=True` pins the entry (a replaced pinned entry
        stays pinned); `ttl` seconds make it expire; `metadata` is kept as given. Afterwards the
        LMDB budget is enforced (never evicting this entry; `warnings` says when it alone is
        over). ConflictError when stored objects of another save cannot be combined with it.
        """
        return put_entry(self._tiers, name, snapshot, tokens, model=model, codec=codec, model_ref=model_ref,
                         prefill_seconds=prefill_seconds, adapter_path=adapter_path, pin=pin, ttl=ttl,
                         metadata=metadata)

    def check_room(self, nbytes: int, tokens: int) -> None:
        """DiskFull now if storing `nbytes` (for `tokens` new tokens) would be refused by the
        free-disk guard: called before a prefill, so a save that cannot be stored costs nothing."""
        try:
            self._tiers.lmdb.check_room(nbytes)
        except DiskFull as exc:
            raise DiskFull(f"refused before the prefill of {tokens} tokens, which need at least {format_size(nbytes)}: "
                           f"{exc}") from None

    def lookup(self, tokens: Sequence[int], *, model: bytes, codec: bytes) -> Match | None:
        """The longest stored prefix of `tokens` for these model and codec identity digests
        (pass at most all but the last prompt token: a restore must leave one to decode)."""
        return lookup(self._tiers, tokens, model, codec)

    def restore(self, match: Match) -> tuple[Snapshot, RestoreStats]:
        """The snapshot of `match`, every object verified, promoted and evaluated.

        If objects turn out missing or damaged in every tier, a shorter prefix of whole blocks
        is returned where that is valid, else CorruptBlock is raised. The restored length is
        `stats.tokens` (= `snapshot.offset`), never `match.tokens`: prefill the prompt from there.
        """
        n_blocks = len(match.keys)
        snapshot, stats = restore_entry(self._tiers, match.manifest, n_blocks, remote=match.remote,
                                        allow_prefix=True)
        if not match.remote:
            self._touch(match.manifest.name)
        return snapshot, stats

    def load(self, name: str, *, manifest: Manifest | None = None) -> tuple[Snapshot, RestoreStats]:
        """The whole entry `name` (for `ask NAME`); NotFound, or CorruptBlock when any of its
        objects is lost in every tier. `manifest`: the version of the entry the caller checked
        (its tokens, say), restored even if another process replaced the entry since; its
        objects may be gone then (CorruptBlock)."""
        if manifest is not None and manifest.name != name:
            raise ValueError(f"the manifest given is entry {manifest.name}'s, not {name}'s")
        manifest = manifest or self.get(name)
        if manifest.expired(time.time()):
            raise NotFound(f"entry {name} expired at {time.ctime(manifest.expires)}: save it again (tqstore gc removes "
                           "expired entries)")
        snapshot, stats = restore_entry(self._tiers, manifest, len(manifest.blocks), remote=False,
                                        allow_prefix=False)
        self._touch(name)
        return snapshot, stats

    def get(self, name: str) -> Manifest:
        """The manifest of local entry `name`; NotFound if there is none."""
        return self._tiers.require_manifest(validate_name(name))

    def ls(self, remote: bool = False) -> list[EntryInfo]:
        """Local entries (remote=False) or the bucket's (remote=True, by listing it), by name."""
        return self.listing(remote)[0]

    def unreadable(self, remote: bool = False) -> list[str]:
        """Entries whose manifest cannot be read (left out of `ls`; `verify` names the problem,
        locally `repair` drops them), by name or damaged key."""
        return self.listing(remote)[1]

    def listing(self, remote: bool = False) -> tuple[list[EntryInfo], list[str]]:
        """`ls` and `unreadable` from one reading of the manifests, locally or in the bucket."""
        if remote:
            found, unreadable = self._remote_manifests()
            return [EntryInfo.of(m, "s3", modified) for m, modified in found], sorted(unreadable)
        entries, unreadable = self._tiers.local_manifests()
        return (sorted((EntryInfo.of(m, "local", used) for m, used in entries), key=lambda e: e.name),
                sorted(unreadable))

    def info(self, name: str, remote: bool = False) -> EntryInfo:
        """`ls`'s record of one entry, locally or in the bucket; NotFound if there is none."""
        if remote:
            found, unreadable = self._remote_manifests([validate_name(name)])
            s3 = self._tiers.require_s3()
            if unreadable:
                raise RemoteError(f"the manifest of {name} in s3://{s3.bucket}/{s3.prefix} cannot be read (damaged, "
                                  f"sealed with another key or by a newer tqstore): `tqstore verify {name} --remote` "
                                  "says why")
            if not found:
                raise NotFound(f"no entry {name} in s3://{s3.bucket}/{s3.prefix}: `tqstore ls --remote` lists them")
            return EntryInfo.of(found[0][0], "s3", found[0][1])
        manifest = self.get(name)
        used = next((i.last_used for i in self._tiers.lmdb.list_manifests() if i.name == name), manifest.created)
        return EntryInfo.of(manifest, "local", used)

    def rm(self, name: str, remote: bool = False) -> None:
        """Remove entry `name` and the objects no other entry uses (remote=True: the bucket's
        manifest; its objects go at the next `gc(remote=True)`). NotFound if there is none. A
        manifest stored under a damaged key (not a valid name) is removed by the key as `verify`
        shows it."""
        try:
            validate_name(name)
        except InvalidName:
            if remote or not rm_damaged_key(self._tiers, name):
                raise
            return
        if remote:
            rm_remote(self._tiers, name)
        else:
            rm_local(self._tiers, name)

    def pin(self, name: str) -> None:
        """Keep entry `name` through budget eviction and TTL expiry (and its objects in memory)."""
        self._set_pinned(name, True)

    def unpin(self, name: str) -> None:
        """Let entry `name` be evicted again."""
        self._set_pinned(name, False)

    # --- transfers and maintenance ----------------------------------------------------------------

    def push(self, name: str | None = None, progress: Progress | None = None) -> TransferStats:
        """Upload entry `name` (every local entry when None) to the bucket: objects first (create-
        only, never sent twice), the manifest last (compare-and-swap; ConflictError when the bucket
        holds a different entry of that name). `progress(done, total, bytes)` after each object."""
        return push(self._tiers, name, progress)

    def pull(self, name: str, progress: Progress | None = None) -> TransferStats:
        """Download entry `name` from the bucket, verifying every object, then publish it locally
        (replacing a local entry of that name)."""
        return pull(self._tiers, validate_name(name), progress)

    def gc(self, remote: bool = False, compact: bool = False, *, remote_grace: float = REMOTE_GRACE) -> GcStats:
        """Remove expired entries (unless pinned), objects no entry references and quarantine
        records; with `remote`, the same in the bucket (objects younger than `remote_grace`
        seconds are left to pushes in flight); `compact` then rewrites the LMDB file."""
        return gc(self._tiers, remote=remote, compact=compact, remote_grace=remote_grace)

    def verify(self, name: str | None = None, *, remote: bool = False) -> list[Problem]:
        """Problems with entry `name` (every entry when None) and the LMDB store; [] when sound.
        With `remote`, of the bucket's manifests instead (maintenance.verify_remote)."""
        name = None if name is None else validate_name(name)
        return verify_remote(self._tiers, name) if remote else verify(self._tiers, name)

    def stats(self) -> StoreStats:
        """Sizes per tier, hits per tier, misses and evictions since open."""
        t = self._tiers
        memory, lmdb = t.memory.stats(), t.lmdb.stats()
        c = t.counters
        with c.lock:
            hits, misses, evicted = dict(c.hits), c.misses, (c.evicted_entries, c.evicted_objects, c.evicted_bytes)
        tiers = {"memory": TierStats(memory.bytes, memory.objects, None, memory.budget_bytes, hits["memory"]),
                 "lmdb": TierStats(lmdb.payload_bytes, lmdb.object_count, lmdb.manifest_count,
                                   t.config.lmdb_budget_bytes, hits["lmdb"])}
        if t.remote is not None:
            t.remote.manifests()  # the bucket as listed (once, then at most every max_age seconds)
            entries, objects, nbytes = t.remote.counts()
            tiers["s3"] = TierStats(nbytes, objects, entries, None, hits["s3"])
        return StoreStats(tiers, misses, *evicted, memory.evictions, lmdb,
                          t.remote.last_error if t.remote is not None else None)

    # --- internals -------------------------------------------------------------------------------

    def _touch(self, name: str) -> None:
        """Mark an entry used (for LRU eviction) without waiting for the commit: a read neither
        waits for a synced write nor fails on a full disk (the touch is then dropped)."""
        self._tiers.lmdb.touch_soon(name)

    def _set_pinned(self, name: str, pinned: bool) -> None:
        # Compare-and-swap: a save or pull publishing `name` meanwhile must not be overwritten
        # by the version read here (its blocks would then be collected as unreferenced).
        with self._tiers.lock.shared():
            while True:
                read = self._tiers.local_manifest_read(validate_name(name))
                if read is None:
                    raise not_found(name, self._tiers)
                data, manifest = read
                if manifest.pinned == pinned or self._tiers.lmdb.replace_manifest(
                        name, data, manifest.replace(pinned=pinned).to_bytes(), mark_used=True):
                    break
        self._tiers.refresh_pins()

    def _remote_manifests(self, names: list[str] | None = None) -> tuple[list[tuple[Manifest, float]], list[str]]:
        """The bucket's readable manifests (all, by listing, or `names`) with their last-modified
        times, and the names of those that cannot be read. Feeds the remote index."""
        found, unreadable = self._tiers.remote_manifests(names)
        for remote in found:
            self._tiers.remote.note_manifest(remote.manifest, remote.etag)
        return [(remote.manifest, remote.modified) for remote in found], unreadable
