"""The model side of tqstore: prefill and save a context, restore it and answer questions.

Every path that computes a context restores the longest stored prefix first and prefills only
the rest, so a re-save shares the stored blocks (and their calibration) and a question costs
only its own tokens. All MLX work runs on the calling thread.
"""

from __future__ import annotations

import random
import time
import warnings
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Generator, Sequence

import mlx.core as mx
from mlx_lm.models.cache import CacheList

from turboquant import (StateCheckpoints, TurboQuantKVCache, WINDOW_MODES, chunk_ends, codec_snapshot, held_tokens,
                        make_prompt_cache, parse_scheme, register_verdicts, restore, settle_all, snapshot)

from tqstore.engine import receipts
from tqstore.engine.background import BackgroundWriter
from tqstore.engine.decoding import stream_tokens
from tqstore.engine.defaults import PREFILL_CHUNK
from tqstore.format.blocks import BLOCK_SIZE
from tqstore.errors import BadInput, CorruptBlock, IdentityMismatch, NotFound, TqstoreError
from tqstore.models.identity import CodecIdentity, stored_bytes_at_least
from tqstore.models.loading import LoadedModel, ModelRegistry, check_identity, load_model
from tqstore.models.verdicts import FileVerdicts
from tqstore.format.manifest import Manifest
from tqstore.store.store import PutResult, Store

if TYPE_CHECKING:
    from tqstore.engine.chunks import ChunkInfo, Document, DocumentsAnswer

MAX_SEED = (1 << 64) - 1  # MLX seeds are unsigned 64-bit
CHAT_PARENT = "chat.parent"
Progress = Callable[[int, int], None]


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


@dataclass(frozen=True)
class AskResult:
    """One answer and where its prompt came from."""

    text: str
    tokens: list[int]
    prompt_tokens: int
    cached_tokens: int  # prompt tokens restored from the store
    tier: str  # memory, lmdb, s3 or none
    restore_seconds: float
    prefill_seconds: float  # this ask's remainder
    recorded_prefill_seconds: float  # what the stored context cost to compute
    generation_seconds: float
    finish_reason: str | None
    # What the user waits for: restore + question prefill + the step that yields the first token
    # (0 when none was generated).
    first_token_seconds: float = 0.0
    model_seconds: float = 0.0  # loading the model for this call (0 when it was loaded already)
    # The first generated token's log-probabilities over the vocabulary: two answers from the
    # same context agree here bit for bit (random-weight models repeat tokens; logits do not).
    first_logprobs: mx.array | None = field(default=None, compare=False, repr=False)


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

    def __post_init__(self) -> None:
        # Purely recurrent caches count no tokens: their count is the restore's alone.
        held = held_tokens(self.caches)
        if held != self.matched and _counts_tokens(self.caches):
            raise CorruptBlock(f"the restored caches hold {held} tokens, not the {self.matched} the restore "
                               "returned: run `tqstore verify`, and save the entry again if it names a problem")


def _counts_tokens(caches: list[Any]) -> bool:
    """Whether any layer counts the tokens it holds, as `held_tokens` reads them (attention
    layers do, recurrent states do not)."""
    return any(_counts_tokens(c.caches) if isinstance(c, CacheList) else isinstance(getattr(c, "offset", None), int)
               for c in caches)


def _checkpoints(caches: list[Any], windows: str) -> StateCheckpoints | None:
    return StateCheckpoints.for_caches(caches, BLOCK_SIZE, rows=windows == "token")


def _logged(checkpoints: StateCheckpoints | None, tokens: int) -> tuple[dict | None, dict | None]:
    """The recurrent states before `tokens` and the window rows of [0, tokens) a prefill logged."""
    if checkpoints is None:
        return None, None
    return checkpoints.before(tokens), checkpoints.rows(tokens)


def _window_mode(mode: str) -> str:
    if mode not in WINDOW_MODES:
        raise BadInput(f"windows must be one of {', '.join(WINDOW_MODES)}, got {mode!r}")
    return mode


def _finish(steps: Generator[None, None, Any]) -> Any:
    """Run a step generator (`prefill_steps`, `saving`, `generation`) to its end; its result."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def own_randomness(sampler: Callable[[mx.array], mx.array], seed: int | None) -> Callable[[mx.array], mx.array]:
    """`sampler` drawing from this generation's own random sequence (from `seed`, or fresh):
    each draw reseeds MLX's global generator, which generations interleaved on one thread share."""
    draws = random.Random(seed)

    def sample(logprobs: mx.array) -> mx.array:
        mx.random.seed(draws.getrandbits(64))
        return sampler(logprobs)

    return sample


def _body(model):
    """The transformer without its output head: prefill needs no logits (the head over every
    position costs as much as several layers)."""
    inner = getattr(model, "model", None)
    return inner if callable(inner) else model


class Engine:
    """Save contexts and answer questions with mlx-lm models over a Store."""

    def __init__(self, store: Store, *, dtype: str = "auto", prefill_chunk: int = PREFILL_CHUNK,
                 windows: str = "token", light: bool = False):
        """`windows`: how new entries keep sliding-window and chunked layers, "token" (every
        token's row in the blocks: reused by prefix) or "whole" (the window alone, once per entry:
        fewer bytes, reused only whole; docs/models.md). Entries of either are read whatever it is.
        `light`: load models without transformers where they allow it (models/light.py: the
        tokenizer as recorded by an earlier load; no tool-call parsing), as the CLI does."""
        self.store = store
        self.dtype = dtype
        self.light = light
        self.prefill_chunk = prefill_chunk
        self.windows = _window_mode(windows)
        self.registry = ModelRegistry(store.config.home)
        self._models: dict[tuple[str, str | None], LoadedModel] = {}
        self._codecs: dict[tuple[bytes, str, str], CodecIdentity] = {}

    @classmethod
    def open(cls, home: str | Path | None = None, **options) -> "Engine":
        """An engine over the store at `home` ($TQSTORE_HOME or ~/.cache/tqstore)."""
        return cls(Store.open(home), **options)

    # -- models ---------------------------------------------------------------------------

    def model(self, ref: str, adapter_path: str | None = None) -> LoadedModel:
        """Load (once per process) a model folder or repo id, and remember where it lives."""
        key = (ref, adapter_path)
        if key not in self._models:
            cache = Path(self.store.config.home) / "cache"
            loaded = load_model(ref, cache_dir=cache, adapter_path=adapter_path, dtype=self.dtype, light=self.light)
            # What a plan's check learns about this model is kept for the next process.
            register_verdicts(loaded.model, FileVerdicts(cache / "verdicts", loaded.identity.hexdigest))
            self.registry.remember(loaded)
            self._models[key] = loaded
        return self._models[key]

    def use_model(self, loaded: LoadedModel) -> None:
        """Share a model another engine (or the caller) already loaded."""
        self._models[(loaded.ref, loaded.adapter_path)] = loaded

    def model_for(self, name: str, ref: str | None = None) -> LoadedModel:
        """The model an entry was saved with: `ref` if given, else the recorded one, else the
        registry's folder for its identity; refuses a model with another identity."""
        manifest = self.store.get(name)
        expected = manifest.model_identity
        if ref is None:
            ref, adapter = manifest.model_ref, manifest.adapter_path
            if not Path(ref).exists():
                known = self.registry.find(expected.hexdigest)
                if known is not None and Path(known["path"]).exists():
                    ref, adapter = known["path"], known.get("adapter")
                elif ref.count("/") != 1 or ref.startswith("/"):
                    raise NotFound(f"model {expected.source or ref!r} of entry {name!r} not found here: "
                                   "pass --model")
        else:
            adapter = manifest.adapter_path
        loaded = self.model(ref, adapter)
        check_identity(loaded, expected, name)
        return loaded

    def codec_identity(self, loaded: LoadedModel, scheme: str, windows: str | None = None) -> CodecIdentity:
        """The codec identity of `scheme` on this model (data-independent: from the layers' plans,
        `turboquant.codec_snapshot`), its windows kept as `windows` says (default the engine's)."""
        windows = _window_mode(windows or self.windows)
        key = (loaded.identity.digest, scheme, windows)
        if key not in self._codecs:
            described = codec_snapshot(loaded.model, scheme, windows=windows)
            self._codecs[key] = CodecIdentity.from_snapshot(described, scheme)
        return self._codecs[key]

    def entry_scheme(self, manifest: Manifest, loaded: LoadedModel) -> tuple[str, str]:
        """(scheme, windows) of an entry, once its codec digest agrees with them on this model: a
        manifest whose scheme was edited would otherwise miss every block and prefill cold under
        another scheme, silently. `windows` is how the entry keeps its window layers (entries saved
        before they could be kept by token keep them whole)."""
        for windows in (self.windows, *(m for m in WINDOW_MODES if m != self.windows)):
            try:
                codec = self.codec_identity(loaded, manifest.scheme, windows)
            except (ValueError, TqstoreError):
                codec = None
            if codec is not None and codec.digest == manifest.codec_digest:
                return manifest.scheme, windows
        raise IdentityMismatch(
            f"entry {manifest.name!r} says scheme {manifest.scheme!r}, but its codec digest is not that scheme's "
            "on this model: the manifest was edited or damaged (or written by a tqstore with another codec). "
            f"Run `tqstore verify`, then save the entry again")

    # -- the two main jobs ----------------------------------------------------------------

    def start(self, loaded: LoadedModel, scheme: str, tokens: Sequence[int], windows: str | None = None) -> Started:
        """Caches holding the longest stored prefix of `tokens` for this model and scheme (among
        entries keeping their windows as `windows` says, default the engine's)."""
        windows = _window_mode(windows or self.windows)
        codec = self.codec_identity(loaded, scheme, windows)
        match = self.store.lookup(tokens, model=loaded.identity.digest, codec=codec.digest)
        if match is None:
            caches = make_prompt_cache(loaded.model, scheme)
            return Started(caches, 0, "none", 0.0, checkpoints=_checkpoints(caches, windows))
        # The lookup's length is what the tiers seemed to hold; the restore's is what was joined
        # (shorter when a block turned out damaged in every tier). Only the latter counts.
        try:
            snap, stats = self.store.restore(match)
        except CorruptBlock as exc:
            # Nothing before the damage is restorable (its first block, window or codecs are lost
            # in every tier, and the damaged copies are set aside): the prompt is prefilled from
            # its first token, as after any miss, so the answer is the one a cold run gives.
            warnings.warn(f"{exc}; computing the context again instead", RuntimeWarning, stacklevel=2)
            caches = make_prompt_cache(loaded.model, scheme)
            return Started(caches, 0, "none", 0.0, checkpoints=_checkpoints(caches, windows))
        caches = restore(snap)
        share = stats.tokens / max(len(match.manifest.tokens), 1)
        checkpoints = StateCheckpoints.from_snapshot(snap, BLOCK_SIZE, caches, rows=windows == "token")
        return Started(caches, stats.tokens, stats.tier, stats.seconds, match.manifest.prefill_seconds * share,
                       checkpoints)

    def prefill(self, loaded: LoadedModel, caches: list[Any], tokens: Sequence[int],
                progress: Progress | None = None, cancelled: Callable[[], bool] | None = None, *,
                at: int = 0, checkpoints: StateCheckpoints | None = None) -> float:
        """Run `tokens` through the model into `caches` in chunks; returns the seconds spent.
        Stops between chunks once `cancelled()` is true. With `checkpoints` (a model with
        recurrent layers), chunks also end at every block boundary (`at` is the position of the
        first token) and the recurrent states there are kept; window layers' rows are logged
        into it. Window caches end settled (`turboquant.adapter.windows`): a prefill of a prefix and a
        restore of it hold the same arrays."""
        return _finish(self.prefill_steps(loaded, caches, tokens, progress, cancelled, at=at,
                                          checkpoints=checkpoints))

    def prefill_steps(self, loaded: LoadedModel, caches: list[Any], tokens: Sequence[int],
                      progress: Progress | None = None, cancelled: Callable[[], bool] | None = None, *,
                      at: int = 0, checkpoints: StateCheckpoints | None = None,
                      chunk: Callable[[int], int] | None = None) -> Generator[None, None, float]:
        """`prefill`, yielding after each chunk so that the caller can take turns with other
        work; returns the seconds of its own steps. `chunk(position)`, asked before each chunk
        with the absolute position of its first token, sizes it (default `prefill_chunk`): the
        server keeps its chunks short in time and ends them at positions that repeat."""
        body = _body(loaded.model)
        seconds, done = 0.0, 0
        if progress and tokens:
            progress(0, len(tokens))  # the bar knows its total, and its clock starts, before the first chunk
        size = chunk or (lambda position: self.prefill_chunk)
        while done < len(tokens):
            end = next(chunk_ends(at + done, at + len(tokens), max(1, size(at + done)),
                                  checkpoints and checkpoints.boundary))
            if cancelled is not None and cancelled():
                break
            t0 = time.perf_counter()
            chunk = mx.array(tokens[done:end - at])[None]
            mx.eval(body(chunk, cache=caches))
            mx.eval([c.state for c in caches])
            done = end - at
            if checkpoints is not None:
                checkpoints.record(caches, end)
            seconds += time.perf_counter() - t0
            if progress:
                progress(done, len(tokens))
            yield
        settle_all(caches)
        return seconds

    def save(self, name: str, document: str, *, model: str, scheme: str | None = None, system: str | None = None,
             adapter_path: str | None = None, progress: Progress | None = None, pin: bool = False,
             ttl: float | None = None, metadata: dict[str, str] | None = None,
             windows: str | None = None) -> SaveResult:
        """Prefill `document` (what the store lacks of it), compress and store it as `name`
        (`windows` as in `saving`)."""
        if not document.strip():
            raise BadInput("the document is empty: nothing to save")
        loaded = self.model(model, adapter_path)
        tokens = loaded.prompt.context_tokens(loaded.tokenizer, document, system)
        return self.save_tokens(name, loaded, tokens, scheme=scheme, progress=progress, pin=pin, ttl=ttl,
                                metadata=metadata, windows=windows)

    def save_tokens(self, name: str, loaded: LoadedModel, tokens: Sequence[int], **options) -> SaveResult:
        """`save` for tokens already framed (chat turns, the server). Options as `saving`."""
        return _finish(self.saving(name, loaded, tokens, **options))

    def saving(self, name: str, loaded: LoadedModel, tokens: Sequence[int], *, scheme: str | None = None,
               progress: Progress | None = None, pin: bool = False, ttl: float | None = None,
               metadata: dict[str, str] | None = None, windows: str | None = None
               ) -> Generator[None, None, SaveResult]:
        """`save_tokens`, yielding between prefill chunks (as `generation`); returns its result.
        `windows` ("token" or "whole", default the engine's) says how the entry keeps its
        sliding-window and chunked layers."""
        scheme = parse_scheme(scheme or self.store.config.default_scheme).name
        windows = _window_mode(windows or self.windows)
        started = self.start(loaded, scheme, tokens, windows)
        new = len(tokens) - started.matched
        self.store.check_room(stored_bytes_at_least(self.codec_identity(loaded, scheme, windows), new), new)
        seconds = yield from self.prefill_steps(loaded, started.caches, tokens[started.matched:], progress,
                                                at=started.matched, checkpoints=started.checkpoints)
        # The quality receipt's reference: the context's last tokens against the caches as prefilled.
        probe = receipts.probe_length(new, started.caches, bool(started.checkpoints and started.checkpoints.states))
        if probe:
            reference, probe_seconds = receipts.reference(loaded.model, snapshot(started.caches), tokens[-probe:])
        for cache in started.caches:
            if isinstance(cache, TurboQuantKVCache):
                cache.compress()
        # Prefill cost is close to linear at these lengths: scale what was measured to the whole;
        # a context stored in full keeps the time its entry recorded.
        recorded = seconds * len(tokens) / new if new else started.recorded * len(tokens) / max(started.matched, 1)
        boundaries, rows = _logged(started.checkpoints, len(tokens))
        snap = snapshot(started.caches, tokens=len(tokens), checkpoints=boundaries, rows=rows, windows=windows)
        if probe:
            receipt = receipts.measure(loaded.model, restore(snap), tokens[-probe:], reference, probe_seconds)
            metadata = {**(metadata or {}), **receipt.metadata()}
        result = self.store.put(name, snap, tokens, model=loaded.identity,
                                codec=self.codec_identity(loaded, scheme, windows), model_ref=str(loaded.path),
                                adapter_path=loaded.adapter_path, prefill_seconds=recorded, pin=pin, ttl=ttl,
                                metadata=metadata)
        return SaveResult(name, len(tokens), started.matched, seconds, recorded, scheme, result.new_blocks,
                          result.reused_blocks, result.bytes_written)

    def ask(self, name: str, question: str, *, model: str | None = None, max_tokens: int = 256,
            temp: float = 0.0, top_p: float = 1.0, seed: int | None = None,
            on_text: Callable[[str], None] | None = None) -> AskResult:
        """Answer `question` about entry `name`, restoring its context instead of prefilling it."""
        manifest = self.store.get(name)
        start = time.perf_counter()
        loaded = self.model_for(name, model)
        model_seconds = time.perf_counter() - start
        prompt = list(manifest.tokens) + loaded.prompt.question_tokens(loaded.tokenizer, question)
        scheme, windows = self.entry_scheme(manifest, loaded)
        result = self.generate(loaded, scheme, prompt, max_tokens=max_tokens, temp=temp, top_p=top_p, seed=seed,
                               on_text=on_text, recorded=manifest.prefill_seconds, windows=windows)
        return replace(result, model_seconds=model_seconds)

    def generate(self, loaded: LoadedModel, scheme: str, prompt: Sequence[int], **options) -> AskResult:
        """Generate after `prompt`, restoring its longest stored prefix (all but the last token:
        one token must run to produce logits). Options as `generate_with_caches`."""
        return self.generate_with_caches(loaded, scheme, prompt, **options)[0]

    def generate_with_caches(self, loaded: LoadedModel, scheme: str, prompt: Sequence[int], **options
                             ) -> tuple[AskResult, list[Any]]:
        """`generate`, also returning the caches, which then hold prompt + answer (mlx-lm feeds
        every token it yields back into the cache). Options as `generation`."""
        return _finish(self.generation(loaded, scheme, prompt, **options))

    def generation(self, loaded: LoadedModel, scheme: str, prompt: Sequence[int], *, max_tokens: int = 256,
                   temp: float = 0.0, top_p: float = 1.0, seed: int | None = None,
                   on_text: Callable[[str], None] | None = None, recorded: float = 0.0,
                   stop: Callable[[str], bool] | None = None, on_start: Callable[[Started], None] | None = None,
                   started: Started | None = None, windows: str | None = None, log_answer: bool = False
                   ) -> Generator[None, None, tuple[AskResult, list[Any]]]:
        """`generate_with_caches` one step at a time: it yields after each prefill chunk and
        each token and returns (result, caches), so one thread can take turns between several
        generations (the server's model worker). Its times count its own steps only, and a
        seeded generation draws the same tokens however its steps are interleaved.

        `on_start(started)` learns where the prompt came from before any prefill; `stop(text so
        far)` ends generation early and is also asked (with "") between prefill chunks, so a
        caller that has gone away does not wait for a long prefill. `started` gives caches that
        already hold the prompt's first `matched` tokens (composed documents) instead of a lookup;
        `windows` which entries the lookup may use (as in `start`). `log_answer`: the answer's
        tokens are checkpointed like a prefill's (window rows, block-end states) for a caller that
        stores prompt + answer (a chat turn); it costs a copy per generated token, so only then.
        """
        from mlx_lm.sample_utils import make_sampler

        started, remainder, prefill, halted = yield from self.prompt_steps(loaded, scheme, prompt, seed=seed,
                                                                           stop=stop, on_start=on_start,
                                                                           started=started, windows=windows)
        pieces, tokens, finish, generating, first_token, first_logprobs = [], [], None, 0.0, 0.0, None
        if halted():
            finish = "stop"
        else:
            sampler = make_sampler(temp=temp, top_p=top_p)
            # The prompt's last token runs through mlx-lm's loop (decoding.py): it yields the first logits.
            responses = stream_tokens(loaded.model, loaded.tokenizer, remainder[-1:], max_tokens=max_tokens,
                                      prompt_cache=started.caches,
                                      sampler=own_randomness(sampler, seed) if temp > 0 else sampler)
            while True:
                t0 = time.perf_counter()
                response = next(responses, None)
                generating += time.perf_counter() - t0
                if log_answer and started.checkpoints is not None:
                    started.checkpoints.follow(started.caches)
                if response is None:
                    break
                if not tokens:
                    first_token = started.restore_seconds + prefill + generating
                    first_logprobs = response.logprobs
                tokens.append(response.token)
                pieces.append(response.text)
                finish = response.finish_reason
                if on_text and response.text:
                    on_text(response.text)
                if stop is not None and stop("".join(pieces)):
                    finish = "stop"
                    break
                yield
            responses.close()
        result = AskResult("".join(pieces), tokens, len(prompt), started.matched, started.tier,
                           started.restore_seconds, prefill, recorded, generating, finish, first_token,
                           first_logprobs=first_logprobs)
        return result, started.caches

    def prompt_steps(self, loaded: LoadedModel, scheme: str, prompt: Sequence[int], *, seed: int | None = None,
                     stop: Callable[[str], bool] | None = None, on_start: Callable[[Started], None] | None = None,
                     started: Started | None = None, windows: str | None = None,
                     chunk: Callable[[int], int] | None = None
                     ) -> Generator[None, None, tuple[Started, list[int], float, Callable[[], bool]]]:
        """What a generation does before its first token (options as `generation`): the seed
        checked, the stored prefix restored, all but the prompt's last token prefilled (yielding
        after each chunk). Returns (started, the prompt's tokens after the restored prefix,
        prefill seconds, whether `stop` says to end)."""
        if seed is not None and not 0 <= seed <= MAX_SEED:
            raise BadInput(f"the seed {seed} is out of range: use an integer from 0 to {MAX_SEED} (2**64 - 1)")
        started = started if started is not None else self.start(loaded, scheme, prompt[:-1], windows)
        if on_start is not None:
            on_start(started)
        remainder = list(prompt[started.matched:])
        halted = (lambda: stop("")) if stop is not None else (lambda: False)
        prefill = yield from self.prefill_steps(loaded, started.caches, remainder[:-1], cancelled=halted,
                                                at=started.matched, checkpoints=started.checkpoints, chunk=chunk)
        return started, remainder, prefill, halted

    def add_chunk(self, name: str | None, text: str, *, model: str, scheme: str | None = None,
                  system: str | None = None, adapter_path: str | None = None, pin: bool = False) -> "ChunkInfo":
        """Store `text` as a document chunk under `name` (None: its content address), prefilled
        after the prompt's prefix, to be reused at any place in `ask_documents`."""
        from tqstore.engine.chunks import add_chunk
        return add_chunk(self, self.model(model, adapter_path), text, name=name, scheme=scheme, system=system,
                         pin=pin)

    def ask_documents(self, documents: Sequence["Document | str"], question: str, *, model: str | None = None,
                      adapter_path: str | None = None, **options) -> "DocumentsAnswer":
        """Answer `question` over documents in order (stored chunk names as Document(name=...),
        texts as str or Document(text=...)), reusing stored chunks wherever they sit. The model is
        `model`, else the first named chunk's. Options as chunks.ask_documents (scheme, system,
        recompute) and `generation`."""
        from tqstore.engine.chunks import Document, ask_documents
        docs = [Document(text=d) if isinstance(d, str) else d for d in documents]
        named = next((d.name for d in docs if d.name is not None), None)
        if model is None and named is None:
            raise BadInput("pass a model: no stored chunk among the documents says which one")
        loaded = self.model(model, adapter_path) if model is not None else self.model_for(named)
        return ask_documents(self, loaded, docs, question, **options)

    def generate_composed(self, loaded: LoadedModel, scheme: str, caches: list[Any], context: Sequence[int],
                          question: Sequence[int], compose_seconds: float, **options) -> AskResult:
        """Generate after `context + question`, where `caches` already hold `context`."""
        started = Started(caches, len(context), "composed", compose_seconds)
        return self.generate(loaded, scheme, list(context) + list(question), started=started, **options)

    def chat_turn(self, name: str, question: str, child: str, *, model: str | None = None,
                  **options) -> AskResult:
        """One chat turn on entry `name`; the finished turn is saved as entry `child`, which
        shares `name`'s blocks (the next turn continues from `child`)."""
        manifest = self.store.get(name)
        loaded = self.model_for(name, model)
        tokens = list(manifest.tokens)
        if manifest.metadata.get(CHAT_PARENT):
            follow = loaded.prompt.turn_tokens(loaded.tokenizer, question)
            if follow and tokens and follow[0] == tokens[-1]:
                follow = follow[1:]  # the answer already ended with the turn's closing token
        else:
            follow = loaded.prompt.question_tokens(loaded.tokenizer, question)
        prompt = tokens + follow
        starts: list[Started] = []
        scheme, windows = self.entry_scheme(manifest, loaded)
        result, caches = self.generate_with_caches(loaded, scheme, prompt, recorded=manifest.prefill_seconds,
                                                   on_start=starts.append, windows=windows, log_answer=True,
                                                   **options)
        self.store_caches(child, loaded, scheme, caches, prompt + result.tokens,
                          prefill_seconds=manifest.prefill_seconds, metadata={**manifest.metadata, CHAT_PARENT: name},
                          checkpoints=starts[0].checkpoints, windows=windows)
        return result

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
        windows = _window_mode(windows or self.windows)
        # Recurrent layers count no tokens: the attention layers say what the caches hold.
        held = held_tokens(caches) or len(tokens)
        extra = held - len(tokens)
        if extra < 0:
            raise BadInput(f"the caches hold {held} tokens, fewer than the {len(tokens)} to store")
        boundaries, rows = _logged(checkpoints, len(tokens))
        rows = rows if windows == "token" else None
        # Windows stored by token are cut from their logged rows, not from the cache.
        cut = [c for i, c in enumerate(caches) if i not in (rows or {})]
        if extra and not all(c.is_trimmable() for c in cut):
            raise BadInput("these caches cannot drop their last tokens (a full sliding window): store them whole")
        for cache in cut:
            if extra:
                cache.trim(extra)
            if isinstance(cache, TurboQuantKVCache):
                cache.compress()
        snap = snapshot(caches, tokens=len(tokens), checkpoints=boundaries, rows=rows, windows=windows)
        mx.eval(snap.arrays())
        codec = self.codec_identity(loaded, scheme, windows)

        def put() -> PutResult:
            return self.store.put(name, snap, tokens, model=loaded.identity, codec=codec, model_ref=str(loaded.path),
                                  adapter_path=loaded.adapter_path, prefill_seconds=prefill_seconds, ttl=ttl,
                                  metadata=metadata)

        if writer is None:
            put()
            return None
        return writer.submit(tokens, put)

    def prompt_cache(self, name: str, *, model: str | None = None) -> tuple[list[Any], list[int], LoadedModel]:
        """mlx-lm caches holding entry `name` (ready for `prompt_cache=`), its tokens and model."""
        manifest = self.store.get(name)
        loaded = self.model_for(name, model)
        snap, _ = self.store.load(name)
        return restore(snap), list(manifest.tokens), loaded
