"""The answer's token loop: mlx-lm's `stream_generate` over `generate_step` (mlx_lm/generate.py)
for what the engine asks of them, without importing `mlx_lm.generate`, which imports
transformers (a second of a fresh process's start here, two on the H200).

The same computation in the same order: the prompt's tokens but the last prefilled in steps,
then each step runs the model on the previous token and samples from the log-probabilities,
one step ahead of the token handed out (mlx-lm evaluates the next token asynchronously while
the caller handles this one, so the caches hold one token more than was yielded; here the
first token goes out before the second step is built, see `_steps`), end of
sequence and the length limit as mlx-lm reports them, text through the tokenizer's streaming
detokenizer. tests/test_light_load.py compares tokens, log-probabilities, text and caches with
mlx-lm's.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

PREFILL_STEP = 2048  # mlx-lm's prefill_step_size default


@dataclass
class Step:
    """One generated token (mlx-lm's GenerationResponse, the fields the engine reads)."""

    text: str
    token: int
    logprobs: mx.array
    finish_reason: str | None = None


@functools.lru_cache(maxsize=1)
def _generation_stream() -> Any:
    return mx.new_thread_local_stream(mx.default_device())


def stream_tokens(model: Any, tokenizer: Any, prompt: list[int], *, max_tokens: int, prompt_cache: list[Any],
                  sampler: Callable[[mx.array], mx.array]) -> Iterator[Step]:
    """mlx-lm's `stream_generate(model, tokenizer, prompt, max_tokens, prompt_cache=...,
    sampler=...)` for a prompt of token ids: one Step per token, the last with its
    finish_reason ("stop" at an end-of-sequence token, else "length")."""
    if max_tokens == 0:
        raise ValueError("Maximum number of tokens must be non-zero (use -1 for no limit).")
    detokenizer = tokenizer.detokenizer
    stream = _generation_stream()
    token, logprobs, n = None, None, 0
    steps = _steps(mx.array(prompt), model, stream, max_tokens, prompt_cache, sampler)
    # (closed when this generator ends, after its last Step went out: see `_steps`)
    with _wired_limit(stream), contextlib.closing(steps):
        for n, (token, logprobs) in enumerate(steps):
            if token in tokenizer.eos_token_ids:
                break
            detokenizer.add_token(token)
            if n + 1 == max_tokens:
                break
            yield Step(detokenizer.last_segment, token, logprobs)
        detokenizer.finalize()
        yield Step(detokenizer.last_segment, token, logprobs,
                   "stop" if token in tokenizer.eos_token_ids else "length")


def _steps(prompt: mx.array, model: Any, stream: Any, max_tokens: int, cache: list[Any],
           sampler: Callable[[mx.array], mx.array]) -> Iterator[tuple[int, mx.array]]:
    """mlx-lm's `generate_step` without logits processors, input embeddings or a quantized cache."""
    def step(tokens: mx.array) -> tuple[mx.array, mx.array]:
        with mx.stream(stream):
            logits = model(tokens[None], cache=cache)[:, -1, :]
            logprobs = logits - mx.logsumexp(logits, keepdims=True)
            return sampler(logprobs), logprobs.squeeze(0)

    with mx.stream(stream):
        while len(prompt) > 1:
            n = min(PREFILL_STEP, len(prompt) - 1)
            model(prompt[:n][None], cache=cache)
            mx.eval([c.state for c in cache])
            prompt = prompt[n:]
            mx.clear_cache()
        y, logprobs = step(prompt)
        mx.async_eval(y, logprobs)
        n, ahead, handed = 0, None, False
        try:
            while True:
                # Each step is built while the device computes the one before, as in mlx-lm,
                # except the second: the first token goes out before it is built. Building a
                # step is host work that can outlast its device time on a fast GPU (compressed
                # caches' most of all), and the first token waited on it.
                if n != max_tokens and n > 0:
                    ahead = step(y)
                    mx.async_eval(*ahead)
                if n == max_tokens:
                    break
                token, handed = y.item(), True
                yield token, logprobs
                if n == 0:
                    ahead = step(y)
                    mx.async_eval(*ahead)
                if n % 256 == 0:
                    mx.clear_cache()
                (y, logprobs), ahead = ahead, None
                n += 1
        finally:
            if handed and n == 0 and ahead is None:
                # Closed after the first token (a one-token answer, an end of sequence): the
                # step is run anyway, so that the caches hold the token, as mlx-lm's do and
                # as a caller storing prompt + answer needs.
                mx.async_eval(*step(y))


@contextlib.contextmanager
def _wired_limit(stream: Any) -> Iterator[None]:
    """mlx-lm's wired_limit: on a Metal GPU the recommended working set is wired while
    generating (and the streams synchronized before it is restored); elsewhere nothing."""
    recommended = mx.device_info().get("max_recommended_working_set_size")
    if recommended is None:
        yield
        return
    old = mx.set_wired_limit(recommended)
    try:
        yield
    finally:
        mx.synchronize(stream)
        mx.set_wired_limit(old)
