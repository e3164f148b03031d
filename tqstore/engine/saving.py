"""Saving a context: what the store lacks of it prefilled, compressed, snapshotted and stored as
a named entry (`Saver.saving`), and storing caches that already hold tokens (`Saver.store_caches`:
chat turns, the server's prompts).
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Generator, Sequence

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, CacheList

from turboquant import Context, StateCheckpoints, TurboQuantKVCache, held_tokens, snapshot

from tqstore.engine import receipts
from tqstore.engine.background import BackgroundWriter
from tqstore.engine.models import LoadedModels, scheme_name, window_mode
from tqstore.engine.prefill import Prefiller, Progress, finish
from tqstore.errors import BadInput
from tqstore.format.blocks import BLOCK_SIZE
from tqstore.models.identity import stored_bytes_at_least
from tqstore.models.loading import LoadedModel
from tqstore.store.store import PutResult, Store


@dataclass(frozen=True)
class SaveResult:
    """What `save` did."""

    name: str
    tokens: int
    reused_tokens: int  # restored from the store instead of prefilled
    prefill_seconds: float  # this save's own prefill
    recorded_prefill_seconds: float  # what computing the whole context costs (recorded in the entry)
    scheme: str
    new_blocks: int
    reused_blocks: int
    bytes_written: int
    evicted: tuple[str, ...] = ()  # entries the LMDB budget evicted to make room
    warnings: tuple[str, ...] = ()  # e.g. the store left over its budget by pinned entries


class Saver:
    """Contexts and caches stored as named entries of `store`."""

    def __init__(self, store: Store, models: LoadedModels, prefiller: Prefiller):
        self.store = store
        self.models = models
        self.prefiller = prefiller

    def save(self, name: str, document: str, *, model: str, scheme: str | None = None, system: str | None = None,
             adapter_path: str | None = None, progress: Progress | None = None, pin: bool = False,
             ttl: float | None = None, metadata: dict[str, str] | None = None,
             windows: str | None = None) -> SaveResult:
        """Prefill `document` (what the store lacks of it), compress and store it as `name`
        (`windows` as in `saving`)."""
        if not document.strip():
            raise BadInput("the document is empty: nothing to save")
        loaded = self.models.model(model, adapter_path)
        tokens = loaded.prompt.context_tokens(loaded.tokenizer, document, system)
        return self.save_tokens(name, loaded, tokens, scheme=scheme, progress=progress, pin=pin, ttl=ttl,
                                metadata=metadata, windows=windows)

    def save_tokens(self, name: str, loaded: LoadedModel, tokens: Sequence[int], **options) -> SaveResult:
        """`save` for tokens already framed (chat turns, the server). Options as `saving`."""
        return finish(self.saving(name, loaded, tokens, **options))

    def saving(self, name: str, loaded: LoadedModel, tokens: Sequence[int], *, scheme: str | None = None,
               progress: Progress | None = None, pin: bool = False, ttl: float | None = None,
               metadata: dict[str, str] | None = None, windows: str | None = None
               ) -> Generator[None, None, SaveResult]:
        """`save_tokens`, yielding between prefill chunks (as `generation`); returns its result.
        `windows` ("token" or "whole", default the engine's) says how the entry keeps its
        sliding-window and chunked layers."""
        scheme = scheme_name(scheme or self.store.config.default_scheme)
        windows = window_mode(windows or self.models.windows)
        started = self.prefiller.start(loaded, scheme, tokens, windows)
        new = len(tokens) - started.matched
        self.store.check_room(stored_bytes_at_least(self.models.codec_identity(loaded, scheme, windows), new), new)
        seconds = yield from self.prefiller.prefill_steps(loaded, started.caches, tokens[started.matched:], progress,
                                                          at=started.matched, checkpoints=started.checkpoints)
        context = started.context
        # The quality receipt's reference: the context's last tokens against the caches as prefilled.
        probe = receipts.probe_length(new, context.caches, bool(context.checkpoints and context.checkpoints.states))
        if probe:
            reference, probe_seconds = receipts.reference(loaded.model, context.copy(), tokens[-probe:])
        # What the whole context costs: the restored prefix's share of what its entry recorded,
        # plus this prefill of the rest (which already attended over that prefix). Scaling the
        # few new tokens' seconds to the whole stood a one-token save on a fixed overhead.
        recorded = started.recorded + seconds
        snap = context.snapshot(len(tokens))
        if probe:
            stored = Context.open(loaded.model, scheme, windows=windows, block=BLOCK_SIZE, restored=snap).caches
            receipt = receipts.measure(loaded.model, stored, tokens[-probe:], reference, probe_seconds)
            metadata = {**(metadata or {}), **receipt.metadata()}
        elif started.receipt is not None and started.matched == len(tokens):
            # Nothing new to probe: the context is an entry restored whole, whose receipt holds
            # for these very bytes (a second save of one document showed "not measured").
            metadata = {**(metadata or {}), **started.receipt.metadata()}
        result = self.store.put(name, snap, tokens, model=loaded.identity,
                                codec=self.models.codec_identity(loaded, scheme, windows), model_ref=str(loaded.path),
                                adapter_path=loaded.adapter_path, prefill_seconds=recorded, pin=pin, ttl=ttl,
                                metadata=metadata)
        return SaveResult(name, len(tokens), started.matched, seconds, recorded, scheme, result.new_blocks,
                          result.reused_blocks, result.bytes_written, result.evicted, result.warnings)

    def store_caches(self, name: str, loaded: LoadedModel, scheme: str, caches: list[Any], tokens: Sequence[int],
                     *, prefill_seconds: float, ttl: float | None = None,
                     metadata: dict[str, str] | None = None, checkpoints: StateCheckpoints | None = None,
                     writer: BackgroundWriter | None = None, windows: str | None = None) -> Future | None:
        """Store caches that hold (at least) `tokens` as entry `name`; extra tokens are trimmed.

        `checkpoints` (recurrent states at block ends and window rows, from the prefill and
        generation that filled the caches) are stored with them; without a state at every block
        end, recurrent states are stored whole and the entry is reused whole, not by prefix
        (generated tokens are not checkpointed); window layers are stored by token when every
        row was logged (generation logs its tokens' rows too), else whole.
        With a `writer`, the caches are compressed and their snapshot evaluated here, the put
        runs on the writer's thread, and its Future is returned. `windows` as in `saving`."""
        windows = window_mode(windows or self.models.windows)
        # Recurrent layers count no tokens: the attention layers say what the caches hold.
        held = held_tokens(caches) or len(tokens)
        extra = held - len(tokens)
        if extra < 0:
            raise BadInput(f"the caches hold {held} tokens, fewer than the {len(tokens)} to store")
        boundaries, rows = (None, None) if checkpoints is None else (checkpoints.before(len(tokens)),
                                                                     checkpoints.rows(len(tokens)))
        rows = rows if windows == "token" else None
        # Windows stored by token are cut from their logged rows, not from the cache.
        cut = [c for i, c in enumerate(caches) if i not in (rows or {})]
        stuck = {_untrimmable_kind(c) for c in cut if not c.is_trimmable()}
        if extra and stuck:
            raise BadInput(f"these caches cannot drop their last {extra} tokens ({' and '.join(sorted(stuck))}): "
                           "store them whole")
        for cache in cut:
            if extra:
                cache.trim(extra)
            if isinstance(cache, TurboQuantKVCache):
                cache.compress()
        snap = snapshot(caches, tokens=len(tokens), checkpoints=boundaries, rows=rows, windows=windows)
        mx.eval(snap.arrays())
        codec = self.models.codec_identity(loaded, scheme, windows)

        def put() -> PutResult:
            return self.store.put(name, snap, tokens, model=loaded.identity, codec=codec, model_ref=str(loaded.path),
                                  adapter_path=loaded.adapter_path, prefill_seconds=prefill_seconds, ttl=ttl,
                                  metadata=metadata)

        if writer is None:
            put()
            return None
        return writer.submit(tokens, put)


def _untrimmable_kind(cache: Any) -> str:
    """What keeps a cache from dropping tokens, for the user: a recurrent state holds no tokens
    to drop; a window has dropped its oldest ones already."""
    leaves = cache.caches if isinstance(cache, CacheList) else [cache]
    if any(type(c) is ArraysCache for c in leaves):
        return "recurrent states"
    return "a full sliding window"
