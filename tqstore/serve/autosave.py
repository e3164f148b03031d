"""The save policy of `tqstore serve`: which prompts are stored after their response, under which
name, and storing them on the background writer while the worker takes the next request.
"""

from __future__ import annotations

import hashlib
import logging
import struct
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from turboquant import StateCheckpoints, held_tokens

from tqstore.engine.background import BackgroundWriter
from tqstore.engine.engine import Engine
from tqstore.engine.generation import AskResult
from tqstore.errors import BadInput, ConflictError
from tqstore.models.loading import LoadedModel
from tqstore.serve.metrics import Metrics

log = logging.getLogger("tqstore.serve")
AUTO_PREFIX = "auto-"


@dataclass(frozen=True)
class SavePolicy:
    """Which prompts are stored after their response: at least `min_tokens` long, not already
    covered by a stored prefix; as `auto-<hash>` entries that expire after `ttl` seconds."""

    enabled: bool = True
    min_tokens: int = 256
    ttl: float | None = 24 * 3600.0

    @staticmethod
    def name_for(model_digest: bytes, scheme: str, tokens: Sequence[int]) -> str:
        """A deterministic entry name: the same prefix on the same model and scheme, the same name."""
        h = hashlib.sha256(model_digest + scheme.encode() + b"\0")
        h.update(struct.pack(f"<{len(tokens)}I", *tokens))
        return AUTO_PREFIX + h.hexdigest()[:16]


def autosave(engine: Engine, policy: SavePolicy, metrics: Metrics, writer: BackgroundWriter, loaded: LoadedModel,
             scheme: str, prompt: list[int], result: AskResult, caches: list[Any],
             checkpoints: StateCheckpoints | None = None, prefix_seconds: float = 0.0) -> None:
    """Store prompt[:-1] (a later identical prompt restores all but its last token) when the
    policy says so; errors are logged, never sent: the response is already complete.
    `prefix_seconds`: what the restored prefix cost to compute (its entry's record)."""
    stored = prompt[:-1]
    held = held_tokens(caches)
    if 0 < held < len(stored):  # a prefill cut short (its client left): what its chunks computed
        stored = stored[:held]
    if not policy.enabled:
        return
    if len(stored) + 1 < max(policy.min_tokens, 2):
        metrics.saved("short")
        return
    # A model with recurrent states keeps the prompt up to the last block end its prefill kept
    # them at (the states hold the answer now); 0 leaves the refusal to store_caches below.
    storable = engine.storable_tokens(caches, len(stored), checkpoints) or len(stored)
    stored = stored[:storable]
    if result.cached_tokens >= len(stored):
        metrics.saved("covered")
        return
    name = policy.name_for(loaded.identity.digest, scheme, stored)
    # What the computed tokens cost: their prefill and the step of the last one, which also waits
    # for the prefill's last chunk (queued, not waited for: `Prefiller.prefill_steps`); with the
    # restored prefix's own cost, the whole stored prompt's. (Scaling the computed tokens' seconds
    # up to every token recorded a few new tokens after a long prefix as a long prefill.)
    spent = result.first_token_seconds - result.restore_seconds if result.tokens else result.prefill_seconds
    recorded = prefix_seconds + spent
    try:
        future = engine.store_caches(name, loaded, scheme, caches, stored, prefill_seconds=recorded, ttl=policy.ttl,
                                     metadata={"tqstore.saved_by": "serve"}, checkpoints=checkpoints, writer=writer)
    except BadInput as e:  # caches that cannot drop the answer (a full sliding window)
        log.info("not saving the prompt as %s: %s", name, e)
        metrics.saved("unsupported")
        return
    except Exception:
        log.exception("saving the prompt as %s failed", name)
        metrics.saved("failed")
        return
    # Timed from the hand-over: compressing ran above, on this thread, before the next job.
    t0 = time.perf_counter()

    def done(f: Future) -> None:
        if f.exception() is None:
            metrics.saved("saved", time.perf_counter() - t0)
        elif isinstance(f.exception(), ConflictError):
            # The prefix came from another save of its first tokens (say, the bucket's) than the
            # store holds here: an expected outcome, not a failure with a traceback per request.
            log.warning("not saving the prompt as %s: %s", name, f.exception())
            metrics.saved("conflict")
        else:
            log.error("saving the prompt as %s failed", name, exc_info=f.exception())
            metrics.saved("failed")

    future.add_done_callback(done)
