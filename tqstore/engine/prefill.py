"""A prompt into caches: its longest stored prefix restored (`Prefiller.start`), the rest run
through the model in chunks (`Prefiller.prefill_steps`), or handed out as a `PrefillRow` for
a caller that runs several prompts' prefills in one pass (the server: shared_prefill.py).

Every path that computes a context starts here, so a re-save shares the stored blocks (and
their calibration) and a question costs only its own tokens. All MLX work runs on the calling
thread.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Generator, Sequence

import mlx.core as mx

from turboquant import Context, StateCheckpoints

from tqstore.engine.models import LoadedModels, window_mode
from tqstore.engine.receipts import Receipt
from tqstore.errors import CorruptBlock
from tqstore.format.blocks import BLOCK_SIZE
from tqstore.models.loading import LoadedModel
from tqstore.store.store import Store

Progress = Callable[[int, int], None]


@dataclass
class Started:
    """Caches holding the first `matched` tokens of a prompt: the longest stored prefix that was
    actually restored (or composed), or none in fresh caches.

    `matched` is what the caches hold, never what a lookup promised: a restore may fall back to
    a shorter prefix when a later block is damaged in every tier, and the prompt's rest is then
    prefilled from there. Built with a count the caches contradict, it raises.
    """

    caches: list[Any]
    matched: int
    tier: str
    restore_seconds: float
    recorded: float = 0.0  # prefill seconds the matched entry recorded, scaled to the matched tokens
    checkpoints: StateCheckpoints | None = None  # recurrent states at block ends, window rows
    windows: str = "whole"  # how an entry saved from these caches keeps its window layers
    # The matched entry's quality receipt when it was restored whole: the same stored bytes.
    receipt: Receipt | None = None

    def __post_init__(self) -> None:
        # Purely recurrent caches count no tokens: their count is the restore's alone.
        context = self.context
        held = context.tokens
        if held != self.matched and context.counts_tokens:
            raise CorruptBlock(f"the restored caches hold {held} tokens, not the {self.matched} the "
                               "restore returned: run `tqstore verify`, and save the entry again if it names a problem")

    @property
    def context(self) -> Context:
        """The caches with their checkpoints, as turboquant runs and snapshots them."""
        return Context(self.caches, self.windows, BLOCK_SIZE, self.checkpoints)


@dataclass(eq=False)
class PrefillRow:
    """A short prefill handed to the caller, to run with other generations' in one forward pass
    (`tqstore.engine.shared_prefill.prefill_rows`): `tokens` into `caches`; the caller sets
    `seconds`, the pass's time."""

    caches: list[Any]
    tokens: list[int]
    seconds: float = 0.0


def opened(context: Context, matched: int = 0, tier: str = "none", seconds: float = 0.0,
           recorded: float = 0.0, receipt: Receipt | None = None) -> Started:
    """`Started` for an opened `Context`."""
    return Started(context.caches, matched, tier, seconds, recorded, context.checkpoints, context.windows, receipt)


def finish(steps: Generator[None, None, Any]) -> Any:
    """Run a step generator (`prefill_steps`, `saving`, `generation`) to its end; its result."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def body(model):
    """The transformer without its output head: prefill needs no logits (the head over every
    position costs as much as several layers)."""
    inner = getattr(model, "model", None)
    return inner if callable(inner) else model


class Prefiller:
    """Caches for a prompt from the store's longest stored prefix, and prefill of the rest in
    chunks of `chunk` tokens."""

    def __init__(self, store: Store, models: LoadedModels, chunk: int):
        self.store = store
        self.models = models
        self.chunk = chunk

    def start(self, loaded: LoadedModel, scheme: str, tokens: Sequence[int], windows: str | None = None) -> Started:
        """Caches holding the longest stored prefix of `tokens` for this model and scheme (among
        entries keeping their windows as `windows` says, default the engine's)."""
        windows = window_mode(windows or self.models.windows)
        codec = self.models.codec_identity(loaded, scheme, windows)
        match = self.store.lookup(tokens, model=loaded.identity.digest, codec=codec.digest)
        verdicts = self.models.verdicts(loaded)
        if match is None:
            return opened(Context.open(loaded.model, scheme, windows=windows, block=BLOCK_SIZE, verdicts=verdicts))
        # The lookup's length is what the tiers seemed to hold; the restore's is what was joined
        # (shorter when a block turned out damaged in every tier). Only the latter counts.
        try:
            snap, stats = self.store.restore(match)
        except CorruptBlock as exc:
            # Nothing before the damage is restorable (its first block, window or codecs are lost
            # in every tier, and the damaged copies are set aside): the prompt is prefilled from
            # its first token, as after any miss, so the answer is the one a cold run gives.
            warnings.warn(f"{exc}; computing the context again instead", RuntimeWarning, stacklevel=2)
            return opened(Context.open(loaded.model, scheme, windows=windows, block=BLOCK_SIZE, verdicts=verdicts))
        share = stats.tokens / max(len(match.manifest.tokens), 1)
        context = Context.open(loaded.model, scheme, windows=windows, block=BLOCK_SIZE, restored=snap)
        whole = stats.tokens == len(match.manifest.tokens)
        return opened(context, stats.tokens, stats.tier, stats.seconds, match.manifest.prefill_seconds * share,
                      Receipt.from_metadata(match.manifest.metadata) if whole else None)

    def prefill(self, loaded: LoadedModel, caches: list[Any], tokens: Sequence[int],
                progress: Progress | None = None, cancelled: Callable[[], bool] | None = None, *,
                at: int = 0, checkpoints: StateCheckpoints | None = None) -> float:
        """Run `tokens` through the model into `caches` in chunks; returns the seconds spent.
        Stops between chunks once `cancelled()` is true. With `checkpoints` (a model with
        recurrent layers), chunks also end at every block boundary (`at` is the position of the
        first token) and the recurrent states there are kept; window layers' rows are logged
        into it. Window caches end settled (`turboquant.adapter.windows`): a prefill of a prefix and a
        restore of it hold the same arrays."""
        return finish(self.prefill_steps(loaded, caches, tokens, progress, cancelled, at=at, checkpoints=checkpoints))

    def prefill_steps(self, loaded: LoadedModel, caches: list[Any], tokens: Sequence[int],
                      progress: Progress | None = None, cancelled: Callable[[], bool] | None = None, *,
                      at: int = 0, checkpoints: StateCheckpoints | None = None,
                      chunk: Callable[[int], int] | None = None,
                      queue_last: bool = False) -> Generator[None, None, float]:
        """`prefill`, yielding after each chunk so that the caller can take turns with other
        work; returns the seconds of its own steps. `chunk(position)`, asked before each chunk
        with the absolute position of its first token, sizes it (default `self.chunk`): the
        server keeps its chunks short in time and ends them at positions that repeat.

        `queue_last`: the last chunk is queued (`mx.async_eval`), not waited for, so a caller
        that runs the next token at once (the prompt's last, which yields the first token)
        builds that step while the device computes the chunk; the chunk's device time then
        counts in the caller's step, not in the seconds returned. Building a step is host work
        that a fast GPU otherwise waits for: on an H100 a 4k turbo4 first token's step took
        about 1 ms to build against 2.3 ms to run (bench/graph_build.py)."""
        forward = body(loaded.model)
        context = Context(caches, "whole", BLOCK_SIZE, checkpoints)
        seconds, done = 0.0, 0
        if progress and tokens:
            progress(0, len(tokens))  # the bar knows its total, and its clock starts, before the first chunk
        size = chunk or (lambda position: self.chunk)
        while done < len(tokens):
            end = context.chunk_end(at + done, at + len(tokens), size(at + done))
            if cancelled is not None and cancelled():
                break
            t0 = time.perf_counter()
            computed = (forward(mx.array(tokens[done:end - at])[None], cache=caches), [c.state for c in caches])
            if queue_last and end - at == len(tokens):
                mx.async_eval(computed)
            else:
                mx.eval(computed)
            done = end - at
            context.prefilled(end)
            seconds += time.perf_counter() - t0
            if progress:
                progress(done, len(tokens))
            yield
        context.settle()
        return seconds
