"""A model's per-layer caches under a scheme: the plan of each layer, the protected layers, the
check that the model reads what it wrote, and where each layer lives."""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache, RotatingKVCache
from mlx_lm.models.cache import make_prompt_cache as mlx_make_prompt_cache

from turboquant.adapter.dispatch import install_attention_dispatch
from turboquant.adapter.residence import NATIVE_KINDS, Residence, kind_name, layers_read_by_model, residence_of
from turboquant.adapter.snapshots import restore, snapshot
from turboquant.adapter.verdicts import VerdictBook, book_for, register
from turboquant.cache.allocation import AllocationGroup
from turboquant.cache.at_rest import CLASS as AT_REST_CLASS
from turboquant.cache.at_rest import AtRestKVCache
from turboquant.cache.compressed import BLOCK, TurboQuantKVCache
from turboquant.codec.calibration import CalibrationConfig
from turboquant.codec.plan import DEFAULT_CALIBRATION, DEFAULT_GUARD, LayerPlan, plan_layer
from turboquant.codec.schemes import Format, SchemeSpec, parse_scheme
from turboquant.codec.stages import run_all, stepping
from turboquant.records import LayerRecord, Layout, Snapshot

_notices: set[str] = set()


def _notice_once(message: str) -> None:
    if message not in _notices:
        _notices.add(message)
        warnings.warn(message, stacklevel=3)


def probe_kv_shapes(model) -> list[tuple[int, int, int, mx.Dtype] | None]:
    """(kv heads, head dim K, head dim V, dtype) per layer from a one-token forward; None for non-KV layers."""
    caches = mlx_make_prompt_cache(model)
    model(mx.array([[0]]), cache=caches)
    shapes = []
    for c in caches:
        keys = getattr(c, "keys", None)
        if isinstance(c, (KVCache, RotatingKVCache)) and keys is not None:
            shapes.append((keys.shape[1], keys.shape[3], c.values.shape[3], keys.dtype))
        else:
            shapes.append(None)
    return shapes


def protected_layers(eligible: list[int], fragile: bool) -> set[int]:
    """Boundary protection: the first and last two eligible layers (one each below 8 eligible).

    Never more than half of the eligible layers, so at least half stay TurboQuant.
    """
    k = 2 if len(eligible) >= 8 else 1
    k = min(k, len(eligible) // 4)
    if not fragile or k == 0:
        return set()
    return set(eligible[:k]) | set(eligible[-k:])


PROTECTION_MODES = ("stats", "position", "none")


def make_prompt_cache(
    model,
    scheme: str | SchemeSpec = "turbo0v4",
    *,
    seed: int = 0,
    protect: str = "stats",
    calibration: CalibrationConfig = DEFAULT_CALIBRATION,
    guard: float = DEFAULT_GUARD,
    at_rest: bool = False,
    verdicts: VerdictBook | None = None,
) -> list[Any]:
    """One cache per layer as the scheme decides; honours `model.make_cache()` (sliding layers).

    Plain attention layers that attend through the dispatch become TurboQuantKVCache
    (compressed in memory); plain layers whose arrays the model code reads itself become
    AtRestKVCache (compressed in the store, native in memory; found by a probe); every other
    cache kind stays native (residence.py has the table). Each residence that is not "in
    memory" is stated once per family as a warning. The plan is checked once per model and
    options (prefill, compress, snapshot, restore, one decode step): a plan that fails it falls
    back, with a stated warning, to at-rest and then to native layers, so nothing is stored
    that cannot be restored and decoded.
    Protection of fragile schemes: "stats" lets each TurboQuant-key layer decide at compression
    from its prefill statistics whether to store affine8 instead (falling back to the boundary
    rule without observed queries); "position" makes the first and last two eligible layers
    affine8; "none" protects nothing. `at_rest` compresses every compressible layer at rest only
    (native attention in memory; for comparisons). `verdicts` as `codec_snapshot` takes it.
    """
    if verdicts is not None:
        register(model, verdicts)
    if protect not in PROTECTION_MODES:
        raise ValueError(f"protect must be one of {PROTECTION_MODES}, got {protect!r}")
    spec = parse_scheme(scheme) if isinstance(scheme, str) else scheme
    options = dict(seed=seed, protect=protect, calibration=calibration, guard=guard)
    layout = _layout(model, spec, options, at_rest)
    caches = _caches(layout.base, layout.plans, layout.read)
    if spec.compressed:
        _state_residences(model, spec, caches, read_by_model=not at_rest and layout.checked)
    return caches


def codec_snapshot(model, scheme: str | SchemeSpec = "turbo0v4", *, windows: str = "whole",
                   verdicts: VerdictBook | None = None) -> Snapshot:
    """The snapshot that fresh `make_prompt_cache(model, scheme)` caches give (no tokens): every
    layer's config and the codecs they use, which is all a codec identity hashes. Compressed
    layers are described by their plans and the others by mlx-lm's own empty caches, so no
    compressed cache is built. `windows` as `snapshot` takes it. `verdicts`: where what the plan
    check learns about this model is kept for the next process (consulted for the model from
    now on, by every function that makes its caches)."""
    if verdicts is not None:
        register(model, verdicts)
    spec = parse_scheme(scheme) if isinstance(scheme, str) else scheme
    options = dict(seed=0, protect="stats", calibration=DEFAULT_CALIBRATION, guard=DEFAULT_GUARD)
    layout = _layout(model, spec, options, at_rest=False)
    native = snapshot(layout.base, windows=windows)
    layers, codecs = [], {}
    for i, (record, plan) in enumerate(zip(native.layers, layout.plans)):
        if plan is None:
            layers.append(record)
            continue
        codecs.update(plan.codecs())
        meta = {**plan.meta(), "class": AT_REST_CLASS} if i in layout.read else plan.meta()
        layers.append(LayerRecord(Layout.RAW, 0, {}, meta))
    return Snapshot(layers=layers, codecs=codecs)


@dataclass(frozen=True)
class _Layout:
    """What `make_prompt_cache` decides for a model: mlx-lm's own caches, the plan of each layer
    to compress (None: native), the layers compressed at rest only, and whether the plan passed
    its check as asked (no fallback)."""

    base: list[Any]
    plans: list[LayerPlan | None]
    read: frozenset[int]
    checked: bool


def _layout(model, spec: SchemeSpec, options: dict, at_rest: bool) -> _Layout:
    install_attention_dispatch()
    base = mlx_make_prompt_cache(model)
    if not spec.compressed:
        return _Layout(base, [None] * len(base), frozenset(), True)
    shapes = probe_kv_shapes(model)
    eligible = [i for i, c in enumerate(base) if type(c) is KVCache and shapes[i] is not None]
    read = frozenset(eligible) if at_rest else layers_read_by_model(model, eligible)
    fallback = _checked_fallback(model, spec, options, eligible, read)
    if fallback == "native":
        eligible = []
    elif fallback == "at rest":
        read = frozenset(eligible)
    return _Layout(base, _plans(spec, base, shapes, eligible, options), read, fallback is None)


def _planned_caches(model, spec: SchemeSpec, base: list[Any], shapes, eligible: list[int], read: frozenset[int],
                    options: dict) -> list[Any]:
    return _caches(base, _plans(spec, base, shapes, eligible, options), read)


def _caches(base: list[Any], plans: list[LayerPlan | None], read: frozenset[int]) -> list[Any]:
    return [c if plan is None else AtRestKVCache(plan) if i in read else TurboQuantKVCache(plan)
            for i, (c, plan) in enumerate(zip(base, plans))]


def _plans(spec: SchemeSpec, base: list[Any], shapes, eligible: list[int], options: dict) -> list[LayerPlan | None]:
    boundary = protected_layers(eligible, spec.fragile)
    protect = options["protect"]
    by_stats = protect == "stats" and spec.key_format is Format.TURBO
    static = boundary if protect == "position" or (protect == "stats" and not by_stats) else set()
    group = None if spec.budget is None else AllocationGroup(spec.budget)  # one budget for all layers
    plans: list[LayerPlan | None] = []
    for i in range(len(base)):
        plan = None
        if i in eligible:
            heads, dk, dv, dtype = shapes[i]
            plan = plan_layer(spec, heads, dk, dv, dtype, seed=options["seed"], protected=i in static,
                              calibration=options["calibration"], guard=options["guard"] if by_stats else None,
                              boundary=i in boundary, group=group)
        plans.append(plan)
    return plans


# The check's prompt: long enough to fit key calibration (calibration.MIN_ROWS rows), token ids
# that every vocabulary has.
CHECK_TOKENS = 40
_checked: dict[tuple, tuple[weakref.ref, str | None]] = {}


def _checked_fallback(model, spec: SchemeSpec, options: dict, eligible: list[int], read: frozenset[int]) -> str | None:
    """None when the plan passes `check_plan`; else "at rest" or "native", the first fallback
    that passes (stated as a warning). Cached per model object, scheme, options and layers, and
    in the model's `verdicts` book where one is registered."""
    key = (id(model), spec.name, tuple(eligible), read, *sorted((k, repr(v)) for k, v in options.items()))
    hit = _checked.get(key)
    if hit is not None and hit[0]() is model:
        return hit[1]
    book = book_for(model)
    kept_key = f"plan:{key[1:]!r}"
    kept = book.get(kept_key) if book is not None else None
    if isinstance(kept, dict) and kept.get("fallback") in (None, "at rest", "native"):
        if kept.get("notice"):
            _notice_once(kept["notice"])
        _checked[key] = (weakref.ref(model), kept["fallback"])
        return kept["fallback"]
    family = family_name(model)
    result, notice = None, None
    for fallback, layers_read in ((None, read), ("at rest", frozenset(eligible)), ("native", None)):
        if fallback == "native":
            notice = (f"scheme {spec.name} does not work for family {family} ({error}): "
                      "every layer of it is stored uncompressed")
            result = fallback
            break
        try:
            check_plan(model, lambda: _planned_caches(model, spec, mlx_make_prompt_cache(model),
                                                      probe_kv_shapes(model), eligible, layers_read, options))
            result = fallback
            if fallback is not None:
                notice = (f"scheme {spec.name} cannot attend over compressed storage for family {family} "
                          f"({error}): its layers are compressed at rest only")
            break
        except Exception as e:  # any failure of the plan is a fallback, stated above
            error = f"{type(e).__name__}: {e}"
    if notice is not None:
        _notice_once(notice)
    _checked[key] = (weakref.ref(model), result)
    if book is not None:
        book.put(kept_key, {"fallback": result, "notice": notice})
    return result


def check_plan(model, make_caches) -> None:
    """Prefill, compress, snapshot, restore and decode one token through `make_caches()`;
    raises where any step fails, or where the restored caches do not snapshot to exactly what
    was saved."""
    caches = make_caches()
    model(mx.arange(1, CHECK_TOKENS + 1)[None], cache=caches)
    compress_caches(caches)
    snap = snapshot(caches)
    restored = restore(snap)
    again = snapshot(restored)
    for i, (a, b) in enumerate(zip(snap.layers, again.layers)):
        if a.layout is not b.layout or set(a.arrays) != set(b.arrays) or not all(
                mx.array_equal(a.arrays[n], b.arrays[n]).item() for n in a.arrays):
            raise ValueError(f"layer {i} does not restore to what was saved")
    logits = model(mx.array([[1]]), cache=restored)
    if not mx.all(mx.isfinite(logits)).item():
        raise ValueError("a decode step through the restored caches is not finite")


def family_name(model) -> str:
    """The model's mlx-lm family (model_type), for messages and the support table."""
    name = getattr(model, "model_type", None)
    return name if isinstance(name, str) else type(model).__module__.rsplit(".", 1)[-1]


def _state_residences(model, spec: SchemeSpec, caches: list[Any], read_by_model: bool) -> None:
    family = family_name(model)
    for kind in sorted({kind_name(c) for c in caches if residence_of(c) is Residence.NATIVE}):
        why = NATIVE_KINDS.get(kind, "no compressed layout for this kind")
        _notice_once(f"layer kind {kind} ({why}) of family {family} is stored uncompressed under {spec.name}")
    if read_by_model and any(residence_of(c) is Residence.AT_REST for c in caches):
        _notice_once(f"layer kind KVCache of family {family} is read by the model code: compressed at rest only")


def layer_residences(model, scheme: str | SchemeSpec) -> list[tuple[str, Residence]]:
    """(cache kind, residence) per layer under `scheme`: the support table's columns."""
    shown = set(_notices)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        caches = make_prompt_cache(model, scheme)
    _notices.intersection_update(shown)  # silenced here, so not shown: the next cache still says it
    return [(kind_name(c), residence_of(c)) for c in caches]


def start_decoding(caches: list[Any]) -> None:
    """Compress the TurboQuant layers a prefill left raw that hold a block or more, all in
    lockstep (one evaluation per decision for all of them), as each one's first decode step
    would on its own; shorter ones decode raw until a block is held (`TurboQuantKVCache.defer`).
    Layers already compressed (restored ones) keep their newest rows raw in the tail until their
    block fills, as a decode step's rows wait."""
    for _ in starting(caches):
        pass


def starting(caches: list[Any], rows: int | None = None) -> Generator[None, None, None]:
    """`start_decoding` as steps: it yields after each evaluation (`stages.stepping`). With
    `rows`, each evaluation encodes about that many rows over all the layers together (each
    layer's share rounded to whole blocks, at least one), so a long prompt's encoding is many
    short steps instead of one long one."""
    fresh = [c for c in caches if isinstance(c, TurboQuantKVCache) and not c.compressed]
    for cache in fresh:
        if cache.offset < BLOCK:
            cache.defer()
    held = [c for c in fresh if c.offset >= BLOCK]
    piece = None if rows is None or not held else max(BLOCK, rows // len(held) // BLOCK * BLOCK)
    yield from stepping([c.compressing(piece) for c in held])


def compress_caches(caches: list[Any]) -> None:
    """Compress every compressible cache now (what `save` does before its snapshot); the
    TurboQuant layers in lockstep (`Context.compress`)."""
    run_all([c.compressing() for c in caches if isinstance(c, TurboQuantKVCache)])
    for cache in caches:
        if isinstance(cache, AtRestKVCache):
            cache.compress()
