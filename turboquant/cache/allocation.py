"""Bits where they matter: an autoB scheme spends a budget of B stored bits per K/V value.

Every layer starts at the scheme's base layout (TurboQuant K and V, calibrated keys). When the
first layer of a model compresses, the group of layers sharing the budget measures, on each
layer's own prefill (its first 256 keys and the queries observed over them, exactly what key
calibration already uses), how much score error the base keys would cause and how much 8-bit
affine keys would remove:

    error(layout) = sum over KV heads and channels of  E[q_c^2] * E[(k_c - k~_c)^2]

the expected squared error of a score q . k, with k~ the keys as stored (quantized with the
layer's real codec and calibration, not a model of it). Key options per layer, cheapest first:
the base, 4-bit TurboQuant keys (when the base has 3), 5-bit ones (float16 norms), 8-bit affine
keys. Under 4-bit values (budgets below 4.5 bits) each key option is paired with 2-, 3- and 4-bit
values, and a layout's error is that of the attention output instead (`output_errors`: the score
error weighted by the values' spread, plus the values' own error), which puts key and value
errors in one unit. The steps that remove
the most error per bit are taken until the next would exceed the budget; the budget counts codes,
norms, affine scales and biases at the width they are stored in, and the per-block key means and
calibration scales spread over the tokens the layer holds when it decides (so the budget holds for
that context, and more so for longer ones; the codebooks, shared by all layers, are left out: under
0.01 bit at 2,048 tokens). Each layer records its decision in its snapshot, so a restored entry
continues with it; layers that compress without their group (restored raw on their own) keep the base.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING

import mlx.core as mx

from turboquant.codec.calibration import CALIBRATION_TOKENS, block_mean
from turboquant.codec.schemes import side_bytes
from turboquant.codec.plan import BASE_KEYS
from turboquant.codec.sides import SHIFT_BLOCK

if TYPE_CHECKING:
    from turboquant.cache.compressed import TurboQuantKVCache
    from turboquant.codec.plan import LayerPlan

MEAN_BITS = 32  # one float32 key mean per channel and 256-token block
SCALE_BITS = 32  # calibration scales: float32 [H, D] per layer (two for TurboQuant keys, one for affine)


@dataclass(frozen=True)
class LayerMeasure:
    """One layer's measurements: per layout option (plan.layout_options(), cheapest first), its
    error and the layer's stored bits per token; and the layer's K/V values per token."""

    errors: tuple[float, ...]
    bits: tuple[float, ...]
    elements: int
    options: tuple[str, ...] = ()


class AllocationGroup:
    """The layers of one model's caches that share one budget (made by make_prompt_cache)."""

    def __init__(self, budget: float):
        self.budget = budget
        self._members: "weakref.WeakSet[TurboQuantKVCache]" = weakref.WeakSet()

    def join(self, cache: "TurboQuantKVCache") -> None:
        self._members.add(cache)

    def decide(self) -> None:
        """Measure every member that holds raw prefill rows and has no decision yet, then
        upgrade the best of them within the budget."""
        pending = [c for c in self._members if not c.compressed and c.allocated is None and c.offset > 0]
        measures = {c: measure_layer(c) for c in pending}
        for c, index in choose(measures, self.budget).items():
            c.allocated = measures[c].options[index]


def choose(measures: dict, budget: float, options: dict | None = None) -> dict:
    """Per layer, the index of its key option (0: the base). Greedy on the knapsack: the step
    (one layer, to a better option) with the most score error removed per bit is taken while
    the total stays within `budget` bits per value; steps that remove nothing are never taken.
    Option 0 of each layer is its cheapest; a step goes to any option that costs more."""
    elements = sum(m.elements for m in measures.values())
    spent = sum(m.bits[0] for m in measures.values())
    at = {key: 0 for key in measures}
    while True:
        best, best_rate = None, 0.0
        for key, m in measures.items():
            for j in range(len(m.bits)):
                gain, cost = m.errors[at[key]] - m.errors[j], m.bits[j] - m.bits[at[key]]
                if gain > 0 and cost > 0 and spent + cost <= budget * elements and gain / cost > best_rate:
                    best, best_rate = (key, j, cost), gain / cost
        if best is None:
            return at
        key, j, cost = best
        at[key], spent = j, spent + cost


def stored_bits_per_token(plan: "LayerPlan", dtype_bytes: int, tokens: int | None = None) -> float:
    """Bits one token costs this layer when it holds `tokens` tokens (None: a long context):
    codes, norms, affine scales, and the block means and calibration scales spread over them."""
    k = side_bytes(plan.key.format, plan.key.bits, plan.head_dim_k, dtype_bytes, plan.key.norm_bytes)
    v = side_bytes(plan.value.format, plan.value.bits, plan.head_dim_v, dtype_bytes, plan.value.norm_bytes)
    blocks = SHIFT_BLOCK if tokens is None else tokens / -(-tokens // SHIFT_BLOCK)  # tokens per stored mean
    means = plan.head_dim_k * MEAN_BITS / blocks if plan.calibrated and plan.calibration.center else 0.0
    scales = 0.0
    if tokens and plan.calibrated:
        arrays = int(plan.calibration.channel_scale) + int(plan.calibration.rotated_scale)
        scales = arrays * plan.head_dim_k * SCALE_BITS / tokens
    return plan.n_kv_heads * (8 * (k + v) + means + scales)


def score_error(plan: "LayerPlan", keys: mx.array, power: mx.array | None, fit) -> float:
    """sum_h,c E[q_c^2] E[(k_c - k~_c)^2] for the first block of `keys` stored under `plan`
    (`fit(plan, keys, power)` gives its calibration). Without observed queries, flat query power."""
    return mx.sum(head_score_error(plan, keys, power, fit)).item()


def head_score_error(plan: "LayerPlan", keys: mx.array, power: mx.array | None, fit) -> mx.array:
    """Per KV head [H]: the expected squared score error sum_c E[q_c^2] E[(k_c - k~_c)^2]."""
    keys = keys[..., :CALIBRATION_TOKENS, :].astype(mx.float32)
    calibration = fit(plan, keys, power) if plan.calibrated else None
    side = plan.key.side("keys", calibration)
    mean = block_mean(keys)[None, :, None, :] if plan.calibrated and plan.calibration.center else None
    target = keys if mean is None else keys - mean
    err = target - side.decode(side.encode(keys, mean)).astype(mx.float32)
    q = mx.ones(keys.shape[1:2] + keys.shape[3:]) if power is None else power
    return mx.sum(q * mx.mean(err * err, axis=(0, 2)), axis=-1)


def head_value_error(plan: "LayerPlan", values: mx.array) -> mx.array:
    """Per KV head [H]: the mean squared error of a value row stored under `plan`, sum over channels."""
    values = values[..., :CALIBRATION_TOKENS, :].astype(mx.float32)
    side = plan.value.side("values")
    err = values - side.decode(side.encode(values)).astype(mx.float32)
    return mx.sum(mx.mean(err * err, axis=(0, 2)), axis=-1)


def output_errors(key_errors: dict, value_errors: dict, values: mx.array, options: tuple[str, ...]) -> tuple:
    """Per layout option, the expected squared error of the attention output it causes.

    To first order a score error d_s moves the output o = sum_j a_j v_j by sum_j a_j d_s_j (v_j - o),
    and a value error e by sum_j a_j e_j; for independent errors both scale with sum_j a_j^2,
    which is the same for K and V of one head, so per head the output error is
    E[d_s^2] E|v - o|^2 + E|e|^2, with E|v - o|^2 read as the values' spread about their mean."""
    values = values[..., :CALIBRATION_TOKENS, :].astype(mx.float32)
    centred = values - mx.mean(values, axis=2, keepdims=True)
    spread = mx.sum(mx.mean(centred * centred, axis=(0, 2)), axis=-1)
    out = []
    for option in options:
        keys, _, vals = option.partition("+")
        out.append(mx.sum(key_errors[keys] * spread + value_errors[vals]).item())
    return tuple(out)


def measure_layer(cache: "TurboQuantKVCache") -> LayerMeasure:
    """The measurements of one uncompressed layer from its raw prefill rows: the score error of
    each key option or, where the values' width is chosen too, the output error of each layout."""
    options = cache.plan.layout_options()
    plans = [cache.plan.with_layout(option) for option in options]
    keys, power = cache.raw_keys(), cache.query_power()
    dtype_bytes = cache.native_dtype.size
    bits = tuple(stored_bits_per_token(p, dtype_bytes, cache.offset) for p in plans)
    elements = cache.plan.n_kv_heads * (cache.plan.head_dim_k + cache.plan.head_dim_v)
    if options == cache.plan.key_options():
        errors = tuple(score_error(p, keys, power, cache.fit) for p in plans)
    else:
        values = cache.raw_values()
        key_errors = {k: head_score_error(cache.plan.with_keys(k), keys, power, cache.fit)
                      for k in cache.plan.key_options()}
        value_errors = {v: head_value_error(cache.plan.with_layout(f"{BASE_KEYS}+{v}"), values) if v
                        else head_value_error(cache.plan, values)
                        for v in {o.partition("+")[2] for o in options}}
        errors = output_errors(key_errors, value_errors, values, options)
    order = sorted(range(len(options)), key=lambda i: bits[i])
    return LayerMeasure(tuple(errors[i] for i in order), tuple(bits[i] for i in order), elements,
                        tuple(options[i] for i in order))
