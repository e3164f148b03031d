"""Quality of compressed caches against an uncompressed one with the same weights.

A two-phase cache never compresses inside a single teacher-forced pass, so that would report
KL = 0. Instead: prefill a raw prefix once, load it into each scheme's caches and compress,
then feed the evaluated tokens in chunks through the compressed multi-token path (each token
attends to compressed storage only, exactly as in decoding) and compare the next-token
distributions position by position with the raw cache's.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Callable

import mlx.core as mx

from .at_rest import AtRestKVCache
from .cache import TurboQuantKVCache
from .integration import make_prompt_cache, restore, restore_as, snapshot
from .records import Snapshot

NATIVE_BYTES = 2  # ratios are quoted against an fp16 cache


@dataclass(frozen=True)
class QualityResult:
    """One scheme (and calibration/protection variant) on one text."""

    scheme: str
    variant: str
    kl: float  # mean full-vocabulary KL(p_raw || p_scheme) per position, nats
    top1: float  # agreement of the argmax with the raw cache's
    ppl: float  # perplexity of the evaluated tokens under the scheme
    ref_ppl: float  # the same under the raw cache
    bits_per_element: float  # stored K+V bits per element at fp16 activations, norms/scales included
    compression: float  # fp16 bytes / stored bytes
    positions: int
    prefix: int
    seconds: float


def prefill(model, tokens: mx.array, caches: list[Any], chunk: int = 512) -> None:
    """Run `tokens` through the model body in chunks (no logits: the lm_head is the costly part)."""
    for start in range(0, tokens.shape[0], chunk):
        mx.eval(model.model(tokens[None, start:start + chunk], cache=caches))
        mx.eval([c.state for c in caches])


def raw_prefix(model, tokens: mx.array, chunk: int = 512) -> Snapshot:
    """Prefill once, uncompressed, remembering the queries that calibration uses."""
    recorder = make_prompt_cache(model, "turbo4", protect="none")
    prefill(model, tokens, recorder, chunk)
    return snapshot(recorder)


def caches_from_raw(model, raw: Snapshot, scheme: str, factory: Callable | None = None,
                    **plan_options) -> list[Any]:
    """The scheme's caches holding the raw prefix, compressed now (one raw prefill, many schemes).

    `factory(model, raw)` builds other caches (a peer's, such as mlx-lm's QuantizedKVCache)."""
    if factory is not None:
        return factory(model, raw)
    caches = restore_as(raw, make_prompt_cache(model, scheme, **plan_options))
    for cache in caches:
        if isinstance(cache, TurboQuantKVCache):
            cache.compress()
    if any(isinstance(c, AtRestKVCache) for c in caches):
        caches = restore(snapshot(caches))  # at-rest layers decode what their codes hold on restore
    return caches


def chunked_logprobs(model, caches: list[Any], tokens: mx.array, chunk: int):
    """Yield next-token log-probabilities [n, V] (float32) for consecutive chunks of `tokens`."""
    for start in range(0, tokens.shape[0], chunk):
        logits = model(tokens[None, start:start + chunk], cache=caches)[0].astype(mx.float32)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        mx.eval(logprobs)
        yield logprobs


def bits_per_element(caches: list[Any]) -> float:
    """Stored bits per K/V element at fp16 activations over every layer (native layers at 16)."""
    stored = elements = 0
    for c in caches:
        if isinstance(c, (TurboQuantKVCache, AtRestKVCache)):
            plan = c.active
            stored += 8 * plan.bytes_per_token(NATIVE_BYTES)
            elements += plan.n_kv_heads * (plan.head_dim_k + plan.head_dim_v)
        elif hasattr(c, "bits"):  # mlx-lm QuantizedKVCache: codes plus an fp16 scale and bias per group
            n = c.keys[0].shape[1] * (c.keys[0].shape[3] * 32 // c.bits + c.values[0].shape[3] * 32 // c.bits)
            stored += n * (c.bits + 2 * 8 * NATIVE_BYTES / c.group_size)
            elements += n
        elif getattr(c, "keys", None) is not None:
            n = c.keys.shape[1] * (c.keys.shape[3] + c.values.shape[3])
            stored += 16 * n
            elements += n
    return stored / elements if elements else 16.0


def evaluate(
    model,
    tokens: mx.array,
    prefix: int,
    schemes: list[tuple[str, str, dict]],
    chunk: int = 128,
    progress: Callable[[str], None] | None = None,
) -> list[QualityResult]:
    """KL, top-1 and perplexity of every (scheme, variant, plan options) against the raw cache.

    tokens[:prefix] is prefilled once; tokens[prefix:] are the evaluated positions.
    """
    say = progress or (lambda _: None)
    t0 = time.perf_counter()
    raw = raw_prefix(model, tokens[:prefix])
    say(f"raw prefix of {prefix} tokens in {time.perf_counter() - t0:.1f}s")
    evaluated = tokens[prefix:]
    targets = evaluated[1:]
    # Uncompressed caches stay raw through multi-token chunks: this is the reference.
    ref = list(chunked_logprobs(model, restore(raw), evaluated, chunk))
    ref_nll = _nll(ref, targets)
    results = []
    for scheme, variant, options in schemes:
        t0 = time.perf_counter()
        caches = caches_from_raw(model, raw, scheme, **options)
        kl = agree = 0.0
        nll = []
        for r, logprobs in zip(ref, chunked_logprobs(model, caches, evaluated, chunk)):
            kl += mx.sum(mx.exp(r) * (r - logprobs)).item()
            agree += mx.sum(mx.argmax(r, axis=-1) == mx.argmax(logprobs, axis=-1)).item()
            nll.append(logprobs)
        n = evaluated.shape[0]
        bits = bits_per_element(caches)
        results.append(QualityResult(scheme, variant, kl / n, agree / n, math.exp(_nll(nll, targets)),
                                     math.exp(ref_nll), bits, 16.0 / bits, n, prefix,
                                     time.perf_counter() - t0))
        say(f"{scheme:10s} {variant:14s} KL {kl / n:.4f}  top1 {agree / n:.3f}  bits {bits:.2f}")
    return results


def _nll(logprobs: list[mx.array], targets: mx.array) -> float:
    """Mean negative log-likelihood of targets (the last position has no target)."""
    lp = mx.concatenate(logprobs, axis=0)[:-1]
    picked = mx.take_along_axis(lp, targets[:, None], axis=-1)
    return -mx.mean(picked).item()
