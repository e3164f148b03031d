"""autoB schemes (turboquant/cache/allocation.py): a bit budget spent on wider keys (4 or 5 bits, 8-bit
affine) where the measured score error says they matter (and below 4.5 bits on the values' width
too, by the attention output's error), decided once for all layers, stored with the entry."""

from __future__ import annotations

import mlx.core as mx
import pytest

from tiny_models import build_model, prompt_tokens
from turboquant import make_prompt_cache, parse_scheme, restore, snapshot
from turboquant.cache.allocation import LayerMeasure, choose, measure_layer, output_errors
from turboquant.codec.plan import AFFINE8_KEYS, BASE_KEYS, TURBO5_KEYS
from turboquant.quality import prefill, stored_bits
from turboquant.records import Layout
from turboquant.codec.schemes import SCHEMES

TOKENS = 512
# The layouts turboquant/attention/kernels runs (with float32 norms; float16 norms and 5-bit keys are the
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


def test_a_head_dim_without_an_affine_group_still_spends_the_budget():
    # At head dim 80 no affine group size fits, and the budget was dropped: auto6 ran as turbo4.
    model = build_model("qwen3", num_hidden_layers=4, head_dim=80)
    caches = _prefilled(model, "auto6")
    assert all(c.plan.budget == 6.0 and AFFINE8_KEYS not in c.plan.layout_options() for c in caches)
    for c in caches:
        c.compress()
    assert TURBO5_KEYS in {c.allocated for c in caches}
    assert stored_bits(snapshot(caches)) <= 6.0 + 0.02


def test_auto3_5_chooses_key_and_value_widths_by_measured_output_error(model):
    caches = _prefilled(model, "auto3.5")
    measures = [measure_layer(c) for c in caches]
    # Under 4-bit values the layouts pair every key option with 2-, 3- and 4-bit values.
    assert set(measures[0].options) == {k if b == 3 else f"{k}+values{b}"
                                        for k in caches[0].plan.key_options() for b in (2, 3, 4)}
    assert all(list(m.bits) == sorted(m.bits) for m in measures)  # option 0 is the cheapest
    for c in caches:
        c.compress()
    chosen = choose(dict(enumerate(measures)), 3.5)
    assert [c.allocated for c in caches] == [measures[i].options[chosen[i]] for i in range(len(caches))]
    assert any(c.allocated != BASE_KEYS for c in caches)
    assert {c.active.value.bits for c in caches} <= {2, 3, 4}
    snap = snapshot(caches)
    assert 3.4 <= stored_bits(snap) <= 3.52
    assert {c.layout for c in caches} <= KERNEL_LAYOUTS
    restored = restore(snap)
    assert [c.allocated for c in restored] == [c.allocated for c in caches]
    assert [c.active.value.bits for c in restored] == [c.active.value.bits for c in caches]
    q = mx.array([[7]])
    assert mx.array_equal(model(q, cache=restored), model(q, cache=caches)).item()


def test_output_error_weighs_key_error_by_the_values_spread():
    # Two heads; head 0's values spread 4 (per channel +-1 over 2 channels... summed: 2), head 1's 0.
    values = mx.array([[[[1.0, -1.0], [-1.0, 1.0]], [[3.0, 3.0], [3.0, 3.0]]]])  # [1, H=2, T=2, D=2]
    key_errors = {"base": mx.array([0.5, 7.0]), "keys4": mx.array([0.25, 1.0])}
    value_errors = {"": mx.array([0.1, 0.2]), "values2": mx.array([0.4, 0.8])}
    errors = output_errors(key_errors, value_errors, values, ("base", "keys4+values2"))
    # spread: head 0 sum over channels of E[(v - mean)^2] = 1 + 1 = 2; head 1: 0 (its key error is harmless)
    assert errors == pytest.approx((0.5 * 2 + 0.1 + 0.2, 0.25 * 2 + 0.4 + 0.8))


def test_a_layout_option_names_its_values_and_a_bare_key_option_keeps_the_base():
    plan = make_prompt_cache(build_model("llama"), "auto3.5")[0].plan
    assert plan.with_layout("keys4").value is plan.value
    wide = plan.with_layout("keys4+values2")
    assert (wide.key.bits, wide.value.bits, wide.value.norm_dtype) == (4, 2, "float16")
    assert wide.value.turbo_name in plan.codecs()  # every codec an allocation may choose is persisted
    with pytest.raises(ValueError, match="value option"):
        plan.with_layout("keys4+values7")
    assert make_prompt_cache(build_model("llama"), "auto5")[0].plan.layout_options() == \
        make_prompt_cache(build_model("llama"), "auto5")[0].plan.key_options()


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


def test_a_snapshot_taken_before_the_allocation_restores_into_one_budget_again(model):
    # The plan's group is runtime only: restored before their first decode step, the layers each
    # fell back to the base layout, and the caches decoded otherwise than the originals.
    caches = _prefilled(model, "auto6")
    restored = restore(snapshot(caches))
    for token in (5, 9):
        q = mx.array([[token]])
        assert mx.array_equal(model(q, cache=restored), model(q, cache=caches)).item()
    assert [c.allocated for c in restored] == [c.allocated for c in caches]
    assert {c.allocated for c in caches} != {BASE_KEYS}  # the budget bought wider keys somewhere


def test_the_budget_is_part_of_the_codec_identity_and_other_schemes_are_unchanged(model):
    auto = make_prompt_cache(model, "auto5")[0].plan.meta()
    turbo = make_prompt_cache(model, "turbo4")[0].plan.meta()
    assert auto["budget"] == 5.0 and auto["scheme"] == "auto5"
    assert "budget" not in turbo
