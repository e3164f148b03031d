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
        if not tokens:  # an empty entry restores into nothing an answer can start from
            raise BadInput("the document frames to no tokens for this model: is its tokenizer complete "
                           "(tokenizer.json, tokenizer_config.json)?")
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
                                codec=self.models.codec_identity(loaded, scheme, windows), model_ref=loaded.entry_ref,
                                adapter_path=loaded.adapter_path, prefill_seconds=recorded, pin=pin, ttl=ttl,
                                metadata=loaded.entry_metadata(metadata))
        return SaveResult(name, len(tokens), started.matched, seconds, recorded, scheme, result.new_blocks,
                          result.reused_blocks, result.bytes_written, result.evicted, result.warnings)

    def storable_tokens(self, caches: list[Any], tokens: int, checkpoints: StateCheckpoints | None = None,
                        windows: str | None = None) -> int:
        """How many of the first `tokens` tokens `store_caches` stores from `caches`: all of them,
        or, where recurrent states hold tokens after them (an answer), the last block end at
        which the prefill kept every state (0: nothing can be stored)."""
        held = held_tokens(caches) or tokens
        return _storable(caches, tokens, held, checkpoints, window_mode(windows or self.models.windows))[0]

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
        if held < len(tokens):
            raise BadInput(f"the caches hold {held} tokens, fewer than the {len(tokens)} to store")
        n, why, kept = _storable(caches, len(tokens), held, checkpoints, windows)
        if not n:
            raise BadInput(why)
        if kept:  # recurrent states past an answer: those the prefill kept at a block end
            caches, tokens = checkpoints.caches_at(caches, n), tokens[:n]
        extra = held - n
        boundaries, rows = (None, None) if checkpoints is None else (checkpoints.before(n), checkpoints.rows(n))
        rows = rows if windows == "token" else None
        # Windows stored by token are cut from their logged rows, not from the cache.
        for cache in (c for i, c in enumerate(caches) if i not in (rows or {})):
            if extra:
                _trim(cache, extra)
            if isinstance(cache, TurboQuantKVCache):
                cache.compress()
        snap = snapshot(caches, tokens=len(tokens), checkpoints=boundaries, rows=rows, windows=windows)
        mx.eval(snap.arrays())
        codec = self.models.codec_identity(loaded, scheme, windows)

        def put() -> PutResult:
            return self.store.put(name, snap, tokens, model=loaded.identity, codec=codec, model_ref=loaded.entry_ref,
                                  adapter_path=loaded.adapter_path, prefill_seconds=prefill_seconds, ttl=ttl,
                                  metadata=loaded.entry_metadata(metadata))

        if writer is None:
            put()
            return None
        return writer.submit(tokens, put)


def _storable(caches: list[Any], tokens: int, held: int, checkpoints: StateCheckpoints | None,
              windows: str) -> tuple[int, str, bool]:
    """How many of the first `tokens` tokens can be stored from caches holding `held`: all of
    them when every layer can drop the rest; where only recurrent states cannot (an answer was
    decoded into them), the last block end at which the prefill kept every state, which the
    stored entry must then take from the checkpoints (True); else 0, and why."""
    if held == tokens:
        return tokens, "", False
    rows = checkpoints.rows(tokens) if checkpoints is not None and windows == "token" else None
    # Windows stored by token are cut from their logged rows, not from the cache.
    stuck = [c for i, c in enumerate(caches) if i not in (rows or {}) for c in _leaves(c) if not c.is_trimmable()]
    if not stuck:
        return tokens, "", False
    if all(type(c) is ArraysCache for c in stuck) and checkpoints is not None:
        end = checkpoints.last_end(caches, tokens)
        if end:
            return end, "", True
    kinds = sorted({"recurrent states" if type(c) is ArraysCache else "a full sliding window" for c in stuck})
    return (0, f"these caches cannot drop their last {held - tokens} tokens ({' and '.join(kinds)}): store them "
               "whole", False)


def _leaves(cache: Any) -> list[Any]:
    return [c for m in cache.caches for c in _leaves(m)] if type(cache) is CacheList else [cache]


def _trim(cache: Any, n: int) -> None:
    """Drop `n` tokens from every member that holds tokens (a recurrent state holds none: it is
    the one kept at the new end, `StateCheckpoints.caches_at`)."""
    for leaf in _leaves(cache):
        if type(leaf) is not ArraysCache:
            leaf.trim(n)
