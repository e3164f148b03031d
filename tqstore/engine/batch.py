"""Batched decoding: several generations' next tokens from one forward pass of the model.

Each generation keeps its own per-layer caches (raw KVCache or TurboQuantKVCache, restored
from any tier, prefilled on their own). A decode step stacks the generations' next tokens into
one [B, 1] input and runs the model once: embeddings, projections, MLPs, norms and the output
head run batched; attention alone runs per row, each row over its own cache (`RowsCache`
stands for the B caches of one layer, and `rows_sdpa` splits the attention call). So caches
of any length and either scheme share a step without padding or copying, and a row's
arithmetic is its own: a greedy answer does not depend on what else is in the batch.

`batched_generation` is `Engine.generation` with its decode handed to the caller: it yields
`None` after each prefill chunk (as `Engine.generation`) and a `Row` whenever it needs its
next token, which the caller fills by running `decode_step` over every waiting row.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Generator, Sequence

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from turboquant import TurboQuantKVCache
from turboquant.integration import compressed_sdpa, install_attention_dispatch

from tqstore.engine.engine import AskResult, Engine, Started, own_randomness
from tqstore.models.loading import LoadedModel

# Model families whose attention layers use their cache only through `offset`,
# `update_and_fetch` and mlx-lm's `scaled_dot_product_attention` (and build their mask through
# `create_attention_mask`), so that per-row attention is theirs exactly; each is tested
# (tests/test_server_batch.py; mistral runs mlx-lm's llama module). Others decode alone.
BATCHED_FAMILIES = frozenset({"llama", "mistral", "qwen2", "qwen3"})
_ROW_CACHES = (KVCache, TurboQuantKVCache)


def batchable(loaded: LoadedModel, caches: Sequence[Any]) -> bool:
    """Whether generations on these caches may share decode steps: a family in
    BATCHED_FAMILIES whose every layer is a plain (raw or TurboQuant) attention cache (no
    sliding windows, no recurrent states)."""
    family = getattr(getattr(loaded.model, "args", None), "model_type", None)
    return family in BATCHED_FAMILIES and all(type(c) in _ROW_CACHES for c in caches)


class RowKeys:
    """The keys `RowsCache.update_and_fetch` returns: each row's own (keys, values, cache)."""

    def __init__(self, rows: list[tuple[Any, Any, Any]]):
        self.rows = rows


class RowsCache:
    """One layer's caches of the rows of a decode batch, as the model sees one cache: per-row
    offsets (RoPE takes an array), per-row updates, and keys that route attention per row."""

    def __init__(self, caches: list[Any]):
        self.caches = caches
        self.offset = mx.array([c.offset for c in caches])

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[RowKeys, RowKeys]:
        rows = []
        for i, cache in enumerate(self.caches):
            k, v = cache.update_and_fetch(keys[i:i + 1], values[i:i + 1])
            rows.append((k, v, cache))
        fetched = RowKeys(rows)
        return fetched, fetched

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        if N != 1:
            raise ValueError("a decode batch runs one token per row")
        return None


def rows_sdpa(queries, keys, values, cache, scale: float, mask, sinks=None):
    """mlx-lm's scaled_dot_product_attention (through TurboQuant's dispatch), once per row when
    the keys are a decode batch's."""
    if isinstance(keys, RowKeys):
        return mx.concatenate([compressed_sdpa(queries[i:i + 1], k, v, cache=c, scale=scale, mask=mask, sinks=sinks)
                               for i, (k, v, c) in enumerate(keys.rows)], axis=0)
    return compressed_sdpa(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)


def install_rows_dispatch() -> None:
    """Point every loaded mlx_lm.models module's attention at `rows_sdpa` (idempotent; after
    TurboQuant's dispatch, which `rows_sdpa` calls)."""
    install_attention_dispatch()
    for name, module in list(sys.modules.items()):
        if (name.startswith("mlx_lm.models.")
                and getattr(module, "scaled_dot_product_attention", None) is compressed_sdpa):
            module.scaled_dot_product_attention = rows_sdpa


@dataclass
class Row:
    """One generation's place in a decode step: the token to run and, after the step, the
    token drawn and its log-probabilities."""

    caches: list[Any]
    token: int  # the input of the next step
    sample: Callable[[mx.array], mx.array]
    drawn: int | None = None
    logprobs: mx.array | None = field(default=None, repr=False)


def decode_step(model: Any, rows: Sequence[Row]) -> float:
    """Run every row's next token through the model in one forward pass and draw each row's
    next token with its own sampler; returns the seconds taken. The rows come from
    `batched_generation`, which installed the per-row attention dispatch."""
    t0 = time.perf_counter()
    layers = len(rows[0].caches)
    caches = [RowsCache([row.caches[layer] for row in rows]) for layer in range(layers)]
    logits = model(mx.array([[row.token] for row in rows]), cache=caches)[:, -1, :]
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    drawn = [row.sample(logprobs[i:i + 1]) for i, row in enumerate(rows)]
    mx.eval(drawn, logprobs)
    for i, row in enumerate(rows):
        row.drawn = drawn[i].item()
        if row.logprobs is None:  # the first token's, for the result; later steps' are not kept
            row.logprobs = logprobs[i]
    return time.perf_counter() - t0


def _sampler(temp: float, top_p: float, seed: int | None) -> Callable[[mx.array], mx.array]:
    """mlx-lm's sampler; a sampled one draws from this generation's own random sequence."""
    from mlx_lm.sample_utils import make_sampler

    sampler = make_sampler(temp=temp, top_p=top_p)
    return own_randomness(sampler, seed) if temp > 0 else sampler


def batched_generation(engine: Engine, loaded: LoadedModel, scheme: str, prompt: Sequence[int], *,
                       max_tokens: int = 256, temp: float = 0.0, top_p: float = 1.0, seed: int | None = None,
                       stop: Callable[[str], bool] | None = None, on_start: Callable[[Started], None] | None = None,
                       started: Started | None = None, step_seconds: Callable[[], float] | None = None
                       ) -> Generator[Row | None, None, tuple[AskResult, list[Any]]]:
    """`Engine.generation` whose tokens come from shared decode steps: it yields None after each
    prefill chunk and its `Row` whenever it needs a token (the caller runs `decode_step` over the
    waiting rows, then resumes it). Stops, token cap, EOS and text are mlx-lm's
    `stream_generate`'s. `step_seconds()` says how long the last step took (the generation's
    decode time counts the steps it took part in)."""
    install_rows_dispatch()  # model modules imported since the last request get it too
    started, remainder, prefill, halted = yield from engine.prompt_steps(loaded, scheme, prompt, seed=seed, stop=stop,
                                                                         on_start=on_start, started=started)
    pieces, tokens, finish, generating, first_token, first_logprobs = [], [], None, 0.0, 0.0, None
    if halted():
        finish = "stop"
    else:
        tokenizer = loaded.tokenizer
        detokenizer = tokenizer.detokenizer
        row = Row(started.caches, remainder[-1], _sampler(temp, top_p, seed))
        while True:
            yield row
            generating += step_seconds() if step_seconds is not None else 0.0
            token = row.drawn
            if not tokens:
                first_token = started.restore_seconds + prefill + generating
                first_logprobs = row.logprobs
            tokens.append(token)
            ended = token in tokenizer.eos_token_ids
            if not ended:
                detokenizer.add_token(token)
            if ended or len(tokens) == max_tokens:
                detokenizer.finalize()
                pieces.append(detokenizer.last_segment)
                finish = "stop" if ended else "length"
                if stop is not None and stop("".join(pieces)):
                    finish = "stop"
                break
            pieces.append(detokenizer.last_segment)
            if stop is not None and stop("".join(pieces)):
                finish = "stop"
                break
            row.token = token
    result = AskResult("".join(pieces), tokens, len(prompt), started.matched, started.tier, started.restore_seconds,
                       prefill, 0.0, generating, finish, first_token, first_logprobs=first_logprobs)
    return result, started.caches
