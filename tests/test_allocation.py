"""autoB schemes (turboquant/allocation.py): a bit budget spent on wider keys (4 or 5 bits, 8-bit
affine) where the measured score error says they matter, decided once for all layers, stored
with the entry."""

from __future__ import annotations

import mlx.core as mx
import pytest

from tiny_models import build_model, prompt_tokens
from turboquant import make_prompt_cache, parse_scheme, restore, snapshot
from turboquant.allocation import LayerMeasure, choose, measure_layer
from turboquant.plan import AFFINE8_KEYS, BASE_KEYS, TURBO4_KEYS, TURBO5_KEYS
from turboquant.quality import prefill, stored_bits
from turboquant.records import Layout
from turboquant.schemes import SCHEMES

TOKENS = 512
# The layouts turboquant/kernels runs (with float32 norms; float16 norms and 5-bit keys are the
# kernels' next step, docs/quality.md).
KERNEL_LAYOUTS = {Layout.CALIBRATED, Layout.AFFINEK_TURBO}


@pytest.fixture(scope="module")
def model():
    return build_model("llama")  # 8 layers, 2 KV heads, head dim 128


def _prefilled(model, scheme: str):
    caches = make_prompt_cache(model, scheme)
    prefill(model, prompt_tokens(TOKENS), caches)
    return caches


def test_auto_names_state_their_budget():
    assert {"auto4", "auto5", "auto6"} <= set(SCHEMES)
    assert parse_scheme("AUTO5").budget == 5.0 and parse_scheme("auto5.0").name == "auto5"
    assert parse_scheme("auto5.5").budget == 5.5 and parse_scheme("auto5.5").value_bits == 4
    assert parse_scheme("auto4").value_bits == 3 and parse_scheme("auto4").key_bits == 4
    assert parse_scheme("auto3.5").value_bits == 3 and parse_scheme("auto3.5").key_bits == 3
    assert parse_scheme("auto5").norm_dtype == "float16" and parse_scheme("turbo4").norm_dtype is None
    assert parse_scheme("turbo4").budget is None
    with pytest.raises(ValueError, match="3.5 to 9 bits"):
        parse_scheme("auto12")


def test_choose_spends_the_budget_where_it_removes_most_error_per_bit():
    def m(*errors):
        return LayerMeasure(errors, bits=(100.0, 150.0, 200.0)[:len(errors)], elements=20)

    measures = {"a": m(1.0, 0.1), "b": m(5.0, 0.2), "c": m(3.0, 0.1), "d": m(0.1, 0.2)}
    # 4 layers x 20 values at 6 bits = 480 bits: base 400, each upgrade +50, so one upgrade fits.
    assert choose(measures, 6.0) == {"a": 0, "b": 1, "c": 0, "d": 0}
    assert choose(measures, 7.5) == {"a": 1, "b": 1, "c": 1, "d": 0}  # d gains nothing
    assert set(choose(measures, 4.0).values()) == {0}  # the base alone is over budget
    # A ladder: the cheap first step everywhere before the dear second one.
    ladder = {"a": m(4.0, 1.0, 0.0), "b": m(4.0, 1.0, 0.0)}
    assert choose(ladder, 150 * 2 / 40) == {"a": 1, "b": 1}
    assert choose(ladder, 350 / 40) == {"a": 2, "b": 1}


@pytest.mark.parametrize("scheme,budget", [("auto5", 5.0), ("auto6", 6.0)])
def test_the_budget_holds_and_the_best_layers_are_upgraded(model, scheme, budget):
    caches = _prefilled(model, scheme)
    measures = [measure_layer(c) for c in caches]
    for c in caches:
        c.compress()
    bits = stored_bits(snapshot(caches))
    upgraded = [i for i, c in enumerate(caches) if c.allocated == AFFINE8_KEYS]
    assert 0 < len(upgraded) < len(caches)
    # 4-bit base keys: 5-bit keys everywhere the budget reaches before 8-bit keys where they pay most
    assert {c.allocated for c in caches} == {TURBO5_KEYS, AFFINE8_KEYS}
    assert bits <= budget + 0.02  # codebooks and calibration scales: the constant the budget leaves out
    assert {c.layout for c in caches} <= KERNEL_LAYOUTS
    options = caches[0].plan.key_options()
    chosen = choose(dict(enumerate(measures)), budget)
    assert [c.allocated for c in caches] == [options[chosen[i]] for i in range(len(caches))]
    gains = sorted(range(len(caches)), key=lambda i: measures[i].errors[-1] - measures[i].errors[1])
    assert sorted(upgraded) == sorted(gains[:len(upgraded)])


def test_auto3_5_raises_3_bit_keys_where_they_matter(model):
    caches = _prefilled(model, "auto3.5")
    for c in caches:
        c.compress()
    snap = snapshot(caches)
    assert {TURBO4_KEYS, TURBO5_KEYS} & {c.allocated for c in caches} and stored_bits(snap) <= 3.52
    assert {c.layout for c in caches} <= KERNEL_LAYOUTS
    restored = restore(snap)
    assert [c.allocated for c in restored] == [c.allocated for c in caches]
    q = mx.array([[7]])
    assert mx.array_equal(model(q, cache=restored), model(q, cache=caches)).item()


def test_the_allocation_survives_a_snapshot_and_decodes_identically(model):
    caches = _prefilled(model, "auto5")
    for c in caches:
        c.compress()
    snap = snapshot(caches)
    restored = restore(snap)
    assert [c.allocated for c in restored] == [c.allocated for c in caches]
    assert [c.layout for c in restored] == [c.layout for c in caches]
    for token in (5, 9):  # two decode steps on both
        q = mx.array([[token]])
        assert mx.array_equal(model(q, cache=restored), model(q, cache=caches)).item()


def test_the_budget_is_part_of_the_codec_identity_and_other_schemes_are_unchanged(model):
    auto = make_prompt_cache(model, "auto5")[0].plan.meta()
    turbo = make_prompt_cache(model, "turbo4")[0].plan.meta()
    assert auto["budget"] == 5.0 and auto["scheme"] == "auto5"
    assert "budget" not in turbo
