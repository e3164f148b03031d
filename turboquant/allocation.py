"""Bits where they matter: an autoB scheme spends a budget of B stored bits per K/V value.

Every layer starts at the scheme's base layout (TurboQuant K and V, calibrated keys). When the
first layer of a model compresses, the group of layers sharing the budget measures, on each
layer's own prefill (its first 256 keys and the queries observed over them, exactly what key
calibration already uses), how much score error the base keys would cause and how much 8-bit
affine keys would remove:

    error(layout) = sum over KV heads and channels of  E[q_c^2] * E[(k_c - k~_c)^2]

the expected squared error of a score q . k, with k~ the keys as stored (quantized with the
layer's real codec and calibration, not a model of it). The layers are then upgraded to 8-bit
affine keys in order of the error removed until the next upgrade would exceed the budget; the
budget counts codes, norms, affine scales and biases at the activations' width and the
per-block key means (codebooks and calibration scales are a constant under 0.02 bit at 2,048
tokens). Both layouts are ones the fused kernels run (calibrated TurboQuant, affine-K +
TurboQuant-V). Each layer records its decision in its snapshot, so a restored entry continues
with it; layers that compress without their group (restored raw on their own) keep the base.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING

import mlx.core as mx

from .calibration import CALIBRATION_TOKENS, block_mean
from .schemes import side_bytes
from .sides import SHIFT_BLOCK

if TYPE_CHECKING:
    from .cache import TurboQuantKVCache
    from .plan import LayerPlan

BASE, UPGRADED = "base", "keys8"
MEAN_BITS = 32  # one float32 key mean per channel and 256-token block


@dataclass(frozen=True)
class LayerMeasure:
    """One layer's measurements: score error of each key layout, and its cost."""

    base_error: float
    upgraded_error: float
    base_bits: float  # stored bits per token of the layer, base layout
    upgraded_bits: float
    elements: int  # K/V values per token

    @property
    def gain(self) -> float:
        return self.base_error - self.upgraded_error


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
        for c, choice in choose(measures, self.budget).items():
            c.allocated = choice


def choose(measures: dict, budget: float) -> dict:
    """Upgrade in order of score error removed while the total stays within `budget` bits per
    value; everything else keeps the base. Ties keep the given order."""
    elements = sum(m.elements for m in measures.values())
    spent = sum(m.base_bits for m in measures.values())
    choice = {key: BASE for key in measures}
    for key, m in sorted(measures.items(), key=lambda item: -item[1].gain):
        extra = m.upgraded_bits - m.base_bits
        if m.gain <= 0 or spent + extra > budget * elements:
            continue
        spent += extra
        choice[key] = UPGRADED
    return choice


def stored_bits_per_token(plan: "LayerPlan", dtype_bytes: int) -> float:
    """Bits one token costs this layer at long contexts: codes, norms, scales, block means."""
    k = side_bytes(plan.key.format, plan.key.bits, plan.head_dim_k, dtype_bytes)
    v = side_bytes(plan.value.format, plan.value.bits, plan.head_dim_v, dtype_bytes)
    means = plan.head_dim_k * MEAN_BITS / SHIFT_BLOCK if plan.calibrated and plan.calibration.center else 0.0
    return plan.n_kv_heads * (8 * (k + v) + means)


def score_error(plan: "LayerPlan", keys: mx.array, power: mx.array | None, fit) -> float:
    """sum_h,c E[q_c^2] E[(k_c - k~_c)^2] for the first block of `keys` stored under `plan`
    (`fit(plan, keys, power)` gives its calibration). Without observed queries, flat query power."""
    keys = keys[..., :CALIBRATION_TOKENS, :].astype(mx.float32)
    calibration = fit(plan, keys, power) if plan.calibrated else None
    side = plan.key.side("keys", calibration)
    mean = block_mean(keys)[None, :, None, :] if plan.calibrated and plan.calibration.center else None
    target = keys if mean is None else keys - mean
    err = target - side.decode(side.encode(keys, mean)).astype(mx.float32)
    q = mx.ones(keys.shape[1:2] + keys.shape[3:]) if power is None else power
    return mx.sum(q * mx.mean(err * err, axis=(0, 2))).item()


def measure_layer(cache: "TurboQuantKVCache") -> LayerMeasure:
    """The measurements of one uncompressed layer from its raw prefill rows."""
    plan = cache.plan
    upgraded = plan.upgraded_keys_plan()
    keys = cache.raw_keys()
    power = cache.query_power()
    dtype_bytes = cache.native_dtype.size
    return LayerMeasure(score_error(plan, keys, power, cache.fit), score_error(upgraded, keys, power, cache.fit),
                        stored_bits_per_token(plan, dtype_bytes), stored_bits_per_token(upgraded, dtype_bytes),
                        plan.n_kv_heads * (plan.head_dim_k + plan.head_dim_v))
