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
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx
import numpy as np

from turboquant.cache.at_rest import AtRestKVCache
from turboquant.cache.compressed import TurboQuantKVCache
from turboquant.adapter.making import make_prompt_cache
from turboquant.adapter.snapshots import restore, restore_as, snapshot
from turboquant.records import Layout, Snapshot

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


# -- the issue-31 protocol: 2,048 document tokens, a save round trip, 512 continuation tokens ----

@dataclass(frozen=True)
class ProtocolResult:
    """One scheme on one text under the save-then-continue protocol (`evaluate_saved`)."""

    scheme: str
    variant: str
    kl: np.ndarray  # per continuation position, nats, float64 [positions]
    top1: float
    bits: float  # stored bits per K/V element, everything in the snapshot counted
    seconds: float

    def kl_mean(self, first: int | None = None) -> float:
        """Mean KL over the first `first` continuation positions (all when None)."""
        return float(np.mean(self.kl[:first]))


@dataclass(frozen=True, eq=False)
class Reference:
    """A text's raw prefix (uncompressed snapshot with the observed queries) and the raw
    cache's next-token log-probabilities over the continuation: computed once, reused by
    every scheme."""

    raw: Snapshot
    continuation: mx.array  # token ids [positions]
    logprobs: list[mx.array]  # per chunk, [chunk, V] float32


def stored_bits(snap: Snapshot) -> float:
    """Bits per K/V element of a snapshot, everything it holds counted: codes, norms, affine
    scales and biases, block means, calibration scales, codebooks and rotations, protected
    layers and any raw rows, each at the width it is stored in."""
    elements = 0
    for record in snap.layers:
        c = record.config
        if "head_dim_k" in c:
            elements += record.offset * int(c["n_kv_heads"]) * (int(c["head_dim_k"]) + int(c["head_dim_v"]))
        elif "keys" in record.arrays:
            k, v = record.arrays["keys"], record.arrays["values"]
            elements += record.offset * k.shape[1] * (k.shape[3] + v.shape[3])
    return 8 * snap.nbytes / elements if elements else 0.0


def saved_caches(model, raw: Snapshot, scheme: str, **plan_options) -> tuple[list[Any], float]:
    """The scheme's caches as a restored entry would have them: the raw prefix compressed as at
    save, snapshotted and restored. Returns the caches and the snapshot's stored bits."""
    factory = plan_options.pop("factory", None)
    caches = caches_from_raw(model, raw, scheme, factory, **plan_options)
    if factory is not None:  # a peer's own cache: no snapshot of ours to round-trip through
        return caches, bits_per_element(caches)
    snap = snapshot(caches)
    return restore(snap), stored_bits(snap)


def reference(model, tokens: mx.array, prefix: int, chunk: int = 128) -> Reference:
    """Prefill tokens[:prefix] raw and score tokens[prefix:] against the raw cache."""
    raw = raw_prefix(model, tokens[:prefix])
    continuation = tokens[prefix:]
    return Reference(raw, continuation, list(chunked_logprobs(model, restore(raw), continuation, chunk)))


def save_reference(ref: Reference, path: Path) -> None:
    """Write a Reference to one .npz file (raw K/V, query power, continuation, log-probs)."""
    arrays = {"continuation": np.array(ref.continuation),
              "logprobs": np.concatenate([np.array(lp) for lp in ref.logprobs])}
    for i, r in enumerate(ref.raw.layers):
        if r.layout is not Layout.RAW:
            raise ValueError(f"layer {i} of a reference prefix is {r.layout.value}, not raw")
        arrays.update({f"{i}.{k}": np.array(v) for k, v in {**r.arrays, **r.calibration}.items()})
        arrays[f"{i}.query_rows"] = np.array(int(r.state.get("query_rows", 0)))
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(path, **arrays)


def load_reference(model, path: Path, chunk: int = 128) -> Reference:
    """Read what `save_reference` wrote for this model (layer count and shapes checked)."""
    data = np.load(path)
    template = snapshot(make_prompt_cache(model, "turbo4", protect="none"))
    layers = []
    for i, r in enumerate(template.layers):
        keys, values = mx.array(data[f"{i}.keys"]), mx.array(data[f"{i}.values"])
        rows = int(data[f"{i}.query_rows"])
        calibration = {"query_power": mx.array(data[f"{i}.query_power"])} if rows else {}
        state = {**r.state, "query_rows": rows} if rows else dict(r.state)
        layers.append(replace(r, offset=keys.shape[2], arrays={"keys": keys, "values": values},
                              state=state, calibration=calibration))
    logprobs = mx.array(data["logprobs"])
    chunks = [logprobs[s:s + chunk] for s in range(0, logprobs.shape[0], chunk)]
    return Reference(Snapshot(layers=layers, codecs=template.codecs), mx.array(data["continuation"]), chunks)


def evaluate_saved(model, ref: Reference, schemes: list[tuple[Any, str, dict]], chunk: int = 128,
                   progress: Callable[[str], None] | None = None) -> list[ProtocolResult]:
    """KL per continuation position and top-1 of every (scheme, variant, plan options) against
    the raw cache, each scheme's caches compressed as at save and restored from a snapshot. A
    scheme is a name or a SchemeSpec (variants no name states, such as float32 norms)."""
    say = progress or (lambda _: None)
    results = []
    for scheme, variant, options in schemes:
        t0 = time.perf_counter()
        caches, bits = saved_caches(model, ref.raw, scheme, **dict(options))
        scheme = getattr(scheme, "name", scheme)  # a SchemeSpec (an experiment's variant) or a name
        kl, agree = [], 0
        for r, logprobs in zip(ref.logprobs, chunked_logprobs(model, caches, ref.continuation, chunk)):
            kl.append(np.array(mx.sum(mx.exp(r) * (r - logprobs), axis=-1)))
            agree += mx.sum(mx.argmax(r, axis=-1) == mx.argmax(logprobs, axis=-1)).item()
        kl = np.concatenate(kl).astype(np.float64)
        result = ProtocolResult(scheme, variant, kl, agree / kl.shape[0], bits, time.perf_counter() - t0)
        results.append(result)
        say(f"{scheme:10s} {variant:14s} KL {result.kl_mean(128):.4f} / {result.kl_mean():.4f}  "
            f"top1 {result.top1:.3f}  bits {bits:.2f}  ({result.seconds:.0f}s)")
    return results
