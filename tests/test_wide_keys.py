"""turbo5vN schemes: 5-bit TurboQuant keys, float16 row norms, keys-only protection (the
default scheme since issue 31: docs/quality.md). Restored entries are bit-exact and decode
exactly as the caches they were saved from."""

from __future__ import annotations

from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest

from kv_data import kv_rows
from tiny_models import build_model, prompt_tokens
from turboquant import make_prompt_cache, parse_scheme, restore, snapshot
from turboquant.cache.compressed import TurboQuantKVCache
from turboquant.codec.codebook import lloyd_max_codebook
from turboquant.codec.plan import LayerPlan, plan_layer
from turboquant.quality import prefill, stored_bits
from turboquant.records import Layout

TOKENS = 300


def test_turbo5v4_counts_five_bit_keys_and_half_norms():
    spec = parse_scheme("TURBO5V4")
    assert (spec.key_bits, spec.value_bits, spec.norm_dtype, spec.protect_values) == (5, 4, "float16", False)
    # d=128 at fp16 activations: K 80 bytes of codes + 2 of norm, V 64 + 2.
    assert spec.bytes_per_token(128) == 148
    assert parse_scheme("turbo5v3").bytes_per_token(64) == 42 + 26
    # 4 bits of D_mse for one more bit: the codebook quarters the error.
    assert lloyd_max_codebook(64, 5).d_mse < lloyd_max_codebook(64, 4).d_mse / 3.5


def test_norms_are_stored_in_float16_and_the_identity_says_so():
    plan = plan_layer(parse_scheme("turbo5v4"), 2, 64, 64, mx.float32)
    meta = plan.meta()
    assert meta["key_norms"] == meta["value_norms"] == "float16" and meta["protect_values"] is False
    assert LayerPlan.from_meta(meta, plan.codecs()).meta() == meta
    old = plan_layer(parse_scheme("turbo4"), 2, 64, 64, mx.float32).meta()
    assert not {"key_norms", "value_norms", "protect_values"} & set(old)  # older identities unchanged
    cache = TurboQuantKVCache(plan)
    k, v = kv_rows(1, 2, TOKENS, 64)
    cache.update_and_fetch(k, v)
    cache.compress()
    record = cache.to_record()
    assert record.arrays["keys_norms"].dtype == record.arrays["values_norms"].dtype == mx.float16
    assert record.arrays["keys_packed"].shape[-1] == 10  # 64 codes of 5 bits


def test_half_norms_cost_no_more_than_their_rounding():
    """float16 norms change each decoded row by its norm's rounding (2^-11 relative), no more."""
    k, v = kv_rows(1, 2, TOKENS, 64, seed=3)
    decoded = []
    for norms in ("float16", None):
        spec = replace(parse_scheme("turbo5v4"), name=f"turbo5v4-{norms}", norm_dtype=norms)
        plan = plan_layer(spec, 2, 64, 64, mx.float32)
        cache = TurboQuantKVCache(plan)
        cache.update_and_fetch(k, v)
        cache.compress()
        decoded.append(cache.dequantized())
    for half, full in zip(*decoded):
        rel = np.linalg.norm(np.array(half - full), axis=-1) / np.linalg.norm(np.array(full), axis=-1)
        assert rel.max() <= 2.0 ** -11


def test_guard_protects_keys_only():
    plan = plan_layer(parse_scheme("turbo5v4"), 2, 64, 64, mx.float32, guard=3.6)
    cache = TurboQuantKVCache(plan)
    k, v = kv_rows(1, 2, TOKENS, 64)
    cache.update_and_fetch(k, v)
    cache.observe_queries(mx.random.normal((1, 4, TOKENS, 64), key=mx.random.key(0)) * 100.0, scale=0.125)
    cache.compress()
    assert cache.guarded and cache.layout is Layout.AFFINEK_TURBO
    assert cache.to_record().arrays["values_norms"].dtype == mx.float16
    (restored,) = restore(snapshot([cache]))
    assert restored.guarded and restored.layout is Layout.AFFINEK_TURBO


@pytest.fixture(scope="module")
def model():
    return build_model("llama")  # 8 layers, 2 KV heads, head dim 128


@pytest.mark.parametrize("scheme", ["turbo5v4", pytest.param("auto5", marks=pytest.mark.slow)])
def test_a_saved_entry_restores_bit_exactly_and_decodes_identically(model, scheme):
    caches = make_prompt_cache(model, scheme)
    prefill(model, prompt_tokens(512), caches)  # two whole blocks: the budget's long-context count
    for c in caches:
        c.compress()
    snap = snapshot(caches)
    restored = restore(snap)
    again = snapshot(restored)
    for a, b in zip(snap.layers, again.layers):
        assert a.config == b.config and a.layout is b.layout
        assert all(mx.array_equal(a.arrays[n], b.arrays[n]).item() and a.arrays[n].dtype == b.arrays[n].dtype
                   for n in a.arrays)
    for token in (5, 9, 11):  # decode steps on both, through the plain-ops attention
        q = mx.array([[token]])
        assert mx.array_equal(model(q, cache=restored), model(q, cache=caches)).item()
    # codebooks and calibration scales: the constant the budget leaves out (test_allocation.py)
    assert stored_bits(snap) <= 5.02
