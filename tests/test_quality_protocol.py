"""Issue 31's quality protocol (turboquant/quality.py: reference, evaluate_saved, stored_bits) on a
tiny random-weight model: a saved-then-restored raw cache is exact, compression costs KL, bits
count everything the snapshot holds, and a reference written to disk scores identically."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from tiny_models import build_model, prompt_tokens
from turboquant import make_prompt_cache, parse_scheme, snapshot
from turboquant.quality import evaluate_saved, load_reference, reference, save_reference, saved_caches, stored_bits

PREFIX, POSITIONS, CHUNK = 512, 64, 32


@pytest.fixture(scope="module")
def model():
    return build_model("llama")  # head dim 128, 2 KV heads, 8 layers


@pytest.fixture(scope="module")
def ref(model):
    return reference(model, prompt_tokens(PREFIX + POSITIONS), PREFIX, CHUNK)


def test_raw_is_exact_and_compression_costs_kl(model, ref):
    raw, turbo3 = evaluate_saved(model, ref, [("raw", "default", {}), ("turbo3", "default", {})], CHUNK)
    assert raw.kl.shape == (POSITIONS,) and np.all(np.abs(raw.kl) < 1e-6) and raw.top1 == 1.0
    assert raw.bits == 32.0  # float32 activations stored as they are
    assert turbo3.kl_mean() > 1e-5 and np.all(turbo3.kl > -1e-6)
    assert turbo3.kl_mean(16) == pytest.approx(float(np.mean(turbo3.kl[:16])))


def test_stored_bits_count_norms_means_scales_and_codebooks(model, ref):
    caches, bits = saved_caches(model, ref.raw, "turbo4", protect="none")
    snap = snapshot(caches)
    assert bits == stored_bits(snap)
    layers, heads, d, tokens = 8, 2, 128, PREFIX
    codes_and_norms = layers * heads * tokens * 2 * (4 * d + 32)  # bits: 4-bit codes + a float32 norm per row
    means = layers * heads * (tokens // 256) * d * 32  # one float32 key mean per 256-token block
    assert 8 * snap.nbytes > codes_and_norms + means  # + calibration scales, codebooks, rotations
    assert bits == 8 * snap.nbytes / (layers * heads * tokens * 2 * d)
    assert 4.25 + 0.125 < bits < 4.5


def test_a_reference_read_back_from_disk_scores_the_same(model, ref, tmp_path):
    path = tmp_path / "ref.npz"
    save_reference(ref, path)
    again = load_reference(model, path, CHUNK)
    runs = [("turbo4", "default", {})]
    first, = evaluate_saved(model, ref, runs, CHUNK)
    second, = evaluate_saved(model, again, runs, CHUNK)
    assert np.array_equal(first.kl, second.kl) and first.bits == second.bits and first.top1 == second.top1


def test_a_reference_must_be_uncompressed(model, ref, tmp_path):
    caches = make_prompt_cache(model, "turbo4")
    from turboquant.quality import Reference, prefill

    prefill(model, prompt_tokens(300), caches)
    for c in caches:
        c.compress()
    with pytest.raises(ValueError, match="not raw"):
        save_reference(Reference(snapshot(caches), ref.continuation, ref.logprobs), tmp_path / "x.npz")


def test_a_variant_spec_is_evaluated_under_its_name_and_half_norms_are_counted(model, ref):
    spec = replace(parse_scheme("turbo5v4"), name="turbo5v4-f32", norm_dtype=None)
    half, full = evaluate_saved(model, ref, [("turbo5v4", "default", {"protect": "none"}),
                                             (spec, "f32 norms", {"protect": "none"})], CHUNK)
    assert (half.scheme, full.scheme) == ("turbo5v4", "turbo5v4-f32")
    # The same layouts but for the norms: 16 bits less per row on each side, per 2 x 128 values.
    assert full.bits - half.bits == pytest.approx(2 * 16 / (2 * 128))
    assert 4.75 < half.bits < 4.75 + 0.2  # 5 + 4 bits of codes, float16 norms, means, scales
