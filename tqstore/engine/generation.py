"""Answering: generation after a prompt whose longest stored prefix is restored, questions about
an entry (`ask`), chat turns saved as entries that share their parent's blocks (`chat_turn`), and
an entry's caches for mlx-lm (`prompt_cache`).
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Generator, Sequence

import mlx.core as mx

from turboquant import restore

from tqstore.engine.decoding import stream_tokens
from tqstore.engine.models import LoadedModels
from tqstore.engine.prefill import PrefillRow, Prefiller, Started, finish
from tqstore.engine.receipts import KEYS as RECEIPT_KEYS
from tqstore.engine.saving import Saver
from tqstore.errors import BadInput
from tqstore.models.loading import LoadedModel
from tqstore.store.store import Store

MAX_SEED = (1 << 64) - 1  # MLX seeds are unsigned 64-bit
CHAT_PARENT = "chat.parent"


@dataclass(frozen=True)
class AskResult:
    """One answer and where its prompt came from."""

    text: str
    tokens: list[int]
    prompt_tokens: int
    cached_tokens: int  # prompt tokens restored from the store
    tier: str  # memory, lmdb, s3 or none
    restore_seconds: float
    prefill_seconds: float  # this ask's remainder (its last chunk's device time counts in generation_seconds)
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


class OwnRandomness:
    """A sampler drawing from one generation's own random sequence (from `seed`, or fresh): each
    draw reseeds MLX's global generator, which generations interleaved on one thread share."""

    def __init__(self, sampler: Callable[[mx.array], mx.array], seed: int | None):
        self.sampler = sampler
        self._draws = random.Random(seed)
        self._before: Any = None

    def __call__(self, logprobs: mx.array) -> mx.array:
        self._before = self._draws.getstate()
        mx.random.seed(self._draws.getrandbits(64))
        return self.sampler(logprobs)

    def rewind(self) -> None:
        """Take the last draw back, so the next one repeats it: a batched step run ahead for a
        row that then sat it out (tqstore/engine/batch.py) must not move the row's sequence."""
        if self._before is not None:
            self._draws.setstate(self._before)
            self._before = None


def own_randomness(sampler: Callable[[mx.array], mx.array], seed: int | None) -> OwnRandomness:
    """`sampler` drawing from this generation's own random sequence (`OwnRandomness`)."""
    return OwnRandomness(sampler, seed)


class Answerer:
    """Answers from models over the entries of `store`, each prompt starting from its longest
    stored prefix."""

    def __init__(self, store: Store, models: LoadedModels, prefiller: Prefiller, saver: Saver):
        self.store = store
        self.models = models
        self.prefiller = prefiller
        self.saver = saver

    def ask(self, name: str, question: str, *, model: str | None = None, max_tokens: int = 256,
            temp: float = 0.0, top_p: float = 1.0, seed: int | None = None,
            on_text: Callable[[str], None] | None = None) -> AskResult:
        """Answer `question` about entry `name`, restoring its context instead of prefilling it."""
        manifest = self.store.get(name)
        start = time.perf_counter()
        loaded = self.models.model_for(name, model)
        model_seconds = time.perf_counter() - start
        prompt = list(manifest.tokens) + _follow(manifest, loaded, question)
        scheme, windows = self.models.entry_scheme(manifest, loaded)
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
        return finish(self.generation(loaded, scheme, prompt, **options))

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

        _check_request(prompt, max_tokens, temp, top_p)
        started, remainder, prefill, halted = yield from self.prompt_steps(loaded, scheme, prompt, seed=seed,
                                                                           stop=stop, on_start=on_start,
                                                                           started=started, windows=windows)
        pieces, tokens, finish_reason, generating, first_token, first_logprobs = [], [], None, 0.0, 0.0, None
        if halted():
            finish_reason = "stop"
        else:
            sampler = make_sampler(temp=temp, top_p=top_p)
            context = started.context
            context.start_decoding()  # before mlx-lm's loop, all layers at once (not one by one in its first step)
            # The prompt's last token runs through mlx-lm's loop (decoding.py): it yields the first logits.
            responses = stream_tokens(loaded.model, loaded.tokenizer, remainder[-1:], max_tokens=max_tokens,
                                      prompt_cache=started.caches,
                                      sampler=own_randomness(sampler, seed) if temp > 0 else sampler)
            while True:
                t0 = time.perf_counter()
                response = next(responses, None)
                generating += time.perf_counter() - t0
                if log_answer:
                    context.stepped()
                if response is None:
                    break
                if not tokens:
                    first_token = started.restore_seconds + prefill + generating
                    first_logprobs = response.logprobs
                tokens.append(response.token)
                pieces.append(response.text)
                finish_reason = response.finish_reason
                if on_text and response.text:
                    on_text(response.text)
                if stop is not None and stop("".join(pieces)):
                    finish_reason = "stop"
                    break
                yield
            responses.close()
        result = AskResult("".join(pieces), tokens, len(prompt), started.matched, started.tier,
                           started.restore_seconds, prefill, recorded, generating, finish_reason, first_token,
                           first_logprobs=first_logprobs)
        return result, started.caches

    def prompt_steps(self, loaded: LoadedModel, scheme: str, prompt: Sequence[int], *, seed: int | None = None,
                     stop: Callable[[str], bool] | None = None, on_start: Callable[[Started], None] | None = None,
                     started: Started | None = None, windows: str | None = None,
                     chunk: Callable[[int], int] | None = None, share: int = 0
                     ) -> Generator[PrefillRow | None, None, tuple[Started, list[int], float, Callable[[], bool]]]:
        """What a generation does before its first token (options as `generation`): the seed
        checked, the stored prefix restored, all but the prompt's last token prefilled (yielding
        after each chunk). A prefill of at most `share` tokens is yielded instead, as one
        `PrefillRow` that the caller runs (with others') before resuming; only for models whose
        layers are all plain attention caches (`batch.batchable`), whose prefill keeps no
        checkpoints and settles no windows. Returns (started, the prompt's tokens after the
        restored prefix, prefill seconds, whether `stop` says to end)."""
        if seed is not None and not 0 <= seed <= MAX_SEED:
            raise BadInput(f"the seed {seed} is out of range: use an integer from 0 to {MAX_SEED} (2**64 - 1)")
        started = started if started is not None else self.prefiller.start(loaded, scheme, prompt[:-1], windows)
        if on_start is not None:
            on_start(started)
        remainder = list(prompt[started.matched:])
        halted = (lambda: stop("")) if stop is not None else (lambda: False)
        if 0 < len(remainder) - 1 <= share and not halted():
            row = PrefillRow(started.caches, remainder[:-1])
            yield row
            return started, remainder, row.seconds, halted
        # (the last chunk queued: the prompt's last token is built while the device runs it)
        prefill = yield from self.prefiller.prefill_steps(loaded, started.caches, remainder[:-1], cancelled=halted,
                                                          at=started.matched, checkpoints=started.checkpoints,
                                                          chunk=chunk, queue_last=True)
        return started, remainder, prefill, halted

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
        loaded = self.models.model_for(name, model)
        prompt = list(manifest.tokens) + _follow(manifest, loaded, question)
        starts: list[Started] = []
        scheme, windows = self.models.entry_scheme(manifest, loaded)
        result, caches = self.generate_with_caches(loaded, scheme, prompt, recorded=manifest.prefill_seconds,
                                                   on_start=starts.append, windows=windows, log_answer=True,
                                                   **options)
        self.saver.store_caches(child, loaded, scheme, caches, prompt + result.tokens,
                                prefill_seconds=manifest.prefill_seconds,
                                metadata={**_inherited(manifest.metadata), CHAT_PARENT: name},
                                checkpoints=starts[0].checkpoints, windows=windows)
        return result

    def prompt_cache(self, name: str, *, model: str | None = None) -> tuple[list[Any], list[int], LoadedModel]:
        """mlx-lm caches holding entry `name` (ready for `prompt_cache=`), its tokens and model."""
        manifest = self.store.get(name)
        loaded = self.models.model_for(name, model)
        snap, _ = self.store.load(name)
        return restore(snap), list(manifest.tokens), loaded


def _follow(manifest, loaded: LoadedModel, question: str) -> list[int]:
    """The tokens after entry `manifest`'s that ask `question`: a new user turn after a chat
    turn's answer (the answer's turn closed first), else the question after the document."""
    if not manifest.metadata.get(CHAT_PARENT):
        return loaded.prompt.question_tokens(loaded.tokenizer, question)
    follow = loaded.prompt.turn_tokens(loaded.tokenizer, question)
    tokens = manifest.tokens
    if follow and tokens and follow[0] == tokens[-1]:
        return follow[1:]  # the answer already ended with the turn's closing token
    return follow


def _inherited(metadata) -> dict[str, str]:
    """What a chat turn keeps of its parent's metadata: not its quality receipt, measured on
    the parent's tokens (a turn's own is not measured)."""
    return {k: v for k, v in metadata.items() if k not in RECEIPT_KEYS}


def _check_request(prompt: Sequence[int], max_tokens: int, temp: float, top_p: float) -> None:
    """BadInput for what the command line and the server refuse before they get here: a
    negative or fractional token cap generated without end, a NaN temperature always gave the
    last token id, and an empty prompt (a model folder without its tokenizer files encodes
    everything to nothing) failed inside MLX's gather."""
    if not prompt:
        raise BadInput("the prompt has no tokens: is the model's tokenizer complete (tokenizer.json, "
                       "tokenizer_config.json)?")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise BadInput(f"max_tokens must be a whole number of at least 1, not {max_tokens!r}")
    if not temp >= 0.0:
        raise BadInput(f"temp must be 0 or more, not {temp!r}")
    if not 0.0 < top_p <= 1.0:
        raise BadInput(f"top_p must be in (0, 1], not {top_p!r}")
