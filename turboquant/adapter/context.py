"""One context's caches: what mlx-lm runs, and what a prefill logs so that a prefix of the context
can be stored and restored (recurrent states at block ends, every token's window rows).

A store hands a `Context` a restored snapshot (or nothing) and gets a snapshot back: between
the two, the model runs over `caches`, and nothing outside turboquant needs to know which
layers are compressed, recurrent or windowed.
"""

from __future__ import annotations

from collections.abc import Generator, Iterable
from typing import Any

from mlx_lm.models.cache import CacheList, KVCache

from turboquant.adapter.checkpoints import StateCheckpoints, chunk_ends
from turboquant.adapter.making import make_prompt_cache, start_decoding, starting
from turboquant.adapter.snapshots import held_tokens, restore, snapshot
from turboquant.adapter.verdicts import VerdictBook
from turboquant.adapter.windows import WINDOW_MODES, settle_all
from turboquant.cache.at_rest import AtRestKVCache
from turboquant.cache.compressed import TurboQuantKVCache
from turboquant.codec.schemes import SchemeSpec
from turboquant.codec.stages import run_all
from turboquant.records import Snapshot


class Context:
    """A model's caches holding one context, with the checkpoints its prefill keeps.

    `windows` ("whole" or "token") says how the context's window layers will be stored (by
    token, their every row is logged), `block` the token count a stored prefix is cut at.
    """

    def __init__(self, caches: list[Any], windows: str, block: int, checkpoints: StateCheckpoints | None):
        if windows not in WINDOW_MODES:
            raise ValueError(f"windows must be one of {WINDOW_MODES}, got {windows!r}")
        self.caches = caches
        self.windows = windows
        self.block = block
        self.checkpoints = checkpoints

    @classmethod
    def open(cls, model, scheme: str | SchemeSpec, *, windows: str = "whole", block: int = 256,
             restored: Snapshot | None = None, verdicts: VerdictBook | None = None) -> "Context":
        """Fresh caches of `scheme` for `model`, or caches holding `restored` (a snapshot of this
        model and scheme, as a store returns it) with the checkpoints it carries. `verdicts` as
        `make_prompt_cache` takes it (fresh caches are the ones a plan check decides)."""
        rows = windows == "token"
        if restored is None:
            caches = make_prompt_cache(model, scheme, verdicts=verdicts)
            return cls(caches, windows, block, StateCheckpoints.for_caches(caches, block, rows=rows))
        caches = restore(restored)
        return cls(caches, windows, block, StateCheckpoints.from_snapshot(restored, block, caches, rows=rows))

    @property
    def tokens(self) -> int:
        """The tokens the caches hold (0 for purely recurrent models, whose states count none)."""
        return held_tokens(self.caches)

    @property
    def counts_tokens(self) -> bool:
        """Whether any layer counts the tokens it holds (attention layers do, recurrent states do not)."""
        return _counts(self.caches)

    def chunk_end(self, start: int, stop: int, size: int) -> int:
        """Where a prefill chunk from position `start` ends: `size` tokens on, never past `stop`,
        and at the next block end when recurrent states are kept there."""
        return next(chunk_ends(start, stop, max(1, size), self.checkpoints and self.checkpoints.boundary))

    def prefilled(self, end: int) -> None:
        """Log what a prefill chunk ending at position `end` leaves to keep (window rows, and
        recurrent states at a block end)."""
        if self.checkpoints is not None:
            self.checkpoints.record(self.caches, end)

    def stepped(self) -> None:
        """Log what one decode step added (`StateCheckpoints.follow`)."""
        if self.checkpoints is not None:
            self.checkpoints.follow(self.caches)

    def settle(self) -> None:
        """End the window layers settled, so that a prefill of a prefix and a restore of it hold
        the same arrays."""
        settle_all(self.caches)

    def compress(self) -> None:
        """Encode what the compressed layers hold raw (what a snapshot stores, and what their
        first decode step would), every layer in lockstep: one evaluation per decision for all
        of them (a calibration's checks, the guard's verdict, the encoded rows) instead of about
        five per layer, each of which waits for whatever the device is running (on a server,
        the other requests' steps)."""
        run_all([c.compressing() for c in self.caches if isinstance(c, TurboQuantKVCache)])

    def start_decoding(self) -> None:
        """Compress the layers a prefill left raw that hold a block or more, every layer in
        lockstep (`making.start_decoding`), as each one's first decode step would do on its own;
        a shorter context decodes raw until a block fills. Layers already compressed (restored
        ones) are left as they are: their newest rows (a question's) wait raw in the tail until
        their block fills, as a decode step's rows do. Encoding them here cost the first token
        of a restored turbo4 entry 12-26 ms on an H100 (raw's whole rest is 1-2 ms) and encoded
        rows that decoding itself never encodes early."""
        start_decoding(self.caches)

    def starting(self, rows: int | None = None) -> Generator[None, None, None]:
        """`start_decoding` as steps, yielding after each evaluation; with `rows`, about that
        many rows encoded per evaluation over all layers (`making.starting`)."""
        yield from starting(self.caches, rows)

    def copy(self) -> list[Any]:
        """Caches holding what these hold now, sharing their arrays (later updates of either
        leave the other as it was): a probe can run tokens through them and drop them. A layer
        compressed at rest is copied as the rows it holds, not as its record: that record is
        its codes, and a quality probe's reference copied so measured the codes against
        themselves (KL 0 for every at-rest entry)."""
        tokens = self.tokens  # a recurrent state alone counts none: it takes the context's, as in one snapshot
        return [_rows_copy(c) if isinstance(c, AtRestKVCache) else restore(snapshot([c], tokens=tokens))[0]
                for c in self.caches]

    def snapshot(self, tokens: int, *, compress: bool = True) -> Snapshot:
        """The context's first `tokens` tokens as plain records (compressed first unless told
        not to), with the recurrent states and window rows logged before them."""
        if compress:
            self.compress()
        boundaries, rows = (None, None) if self.checkpoints is None else (
            self.checkpoints.before(tokens), self.checkpoints.rows(tokens))
        return snapshot(self.caches, tokens=tokens, checkpoints=boundaries, rows=rows, windows=self.windows)


def _rows_copy(cache: AtRestKVCache) -> KVCache:
    copy = KVCache()
    if cache.offset:
        copy.update_and_fetch(cache.keys[:, :, :cache.offset], cache.values[:, :, :cache.offset])
    return copy


def _counts(caches: Iterable[Any]) -> bool:
    return any(_counts(c.caches) if isinstance(c, CacheList) else isinstance(getattr(c, "offset", None), int)
               for c in caches)
