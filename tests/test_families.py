"""Residences (issue 18): which layers are compressed in memory, at rest or stay native, the
at-rest layout's round trip, the plan check's fallbacks, and the codec fixes the families needed."""

import warnings

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache
from mlx_lm.models.cache import make_prompt_cache as mlx_make_prompt_cache

from tiny_models import build_model, prompt_tokens
from turboquant import parse_scheme
from turboquant.cache.at_rest import AtRestKVCache
from turboquant.cache.compressed import TurboQuantKVCache
from turboquant.codec.calibration import CalibrationConfig, fit_key_calibration
from turboquant.adapter.making import (_checked_fallback, _planned_caches, check_plan, layer_residences,
                                       make_prompt_cache, probe_kv_shapes)
from turboquant.adapter.snapshots import restore, snapshot
from turboquant.codec.plan import plan_layer
from turboquant.adapter.residence import Residence, layers_read_by_model
from turboquant.codec.rotation import Rotation

IN, REST, NATIVE = Residence.IN_MEMORY, Residence.AT_REST, Residence.NATIVE


@pytest.fixture(scope="module")
def models():
    return {kind: build_model(kind) for kind in ("llama", "gpt_oss", "deepseek_v3", "gemma2", "gemma3n")}


def _prefilled(model, scheme: str, tokens: int) -> list:
    """The scheme's caches (notices silenced) after a prefill of `tokens` tokens."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        caches = make_prompt_cache(model, scheme)
    model(prompt_tokens(tokens)[None], cache=caches)
    return caches


def _equal_records(a, b) -> bool:
    return a.layout is b.layout and a.offset == b.offset and set(a.arrays) == set(b.arrays) and all(
        mx.array_equal(a.arrays[n], b.arrays[n]).item() for n in a.arrays)


@pytest.mark.parametrize("kind, expected", [
    ("llama", [IN] * 8),
    ("gpt_oss", [NATIVE, IN, NATIVE, IN]),  # sinks attend over compressed storage; sliding layers native
    ("deepseek_v3", [REST] * 4),  # MLA: the model scores the rope part and unembeds the latent itself
    ("gemma2", [REST] * 4),  # soft-capped scores computed by the model
    ("gemma3n", [NATIVE, REST]),  # the KV-shared layers read the full-attention cache's arrays
])
def test_the_probe_finds_the_layers_the_model_reads_itself(models, kind, expected):
    assert [r for _, r in layer_residences(models[kind], "turbo4")] == expected
    assert all(r is NATIVE for _, r in layer_residences(models[kind], "raw"))


@pytest.mark.parametrize("kind", ["deepseek_v3", "gemma2", "gemma3n"])
@pytest.mark.parametrize("scheme", ["turbo4", "turbo8v3"])
def test_at_rest_layers_restore_to_what_was_saved_and_keep_their_codes(models, kind, scheme):
    model = models[kind]
    caches = _prefilled(model, scheme, 300)
    rest = [i for i, c in enumerate(caches) if isinstance(c, AtRestKVCache)]
    raw = sum(caches[i].keys[:, :, :300].nbytes + caches[i].values[:, :, :300].nbytes for i in rest)
    snap = snapshot(caches)
    assert sum(snap.layers[i].nbytes for i in rest) < raw / 1.5  # compressed at rest
    restored = restore(snap)
    assert [i for i, c in enumerate(restored) if isinstance(c, AtRestKVCache)] == rest
    for c, record in ((restored[i], snap.layers[i]) for i in rest):  # native rows are the decoded codes
        keys, values = c._codes.dequantized()
        assert mx.array_equal(c.keys[:, :, :c.offset], keys.astype(c.keys.dtype)).item()
        assert record.config["class"] == "AtRestKVCache"
    assert all(_equal_records(a, b) for a, b in zip(snap.layers, snapshot(restored).layers))
    logits = model(mx.array([[7, 8]]), cache=restored)  # decode runs native
    assert mx.all(mx.isfinite(logits)).item()
    later = snapshot(restored)  # the saved rows keep their codes; only new rows are encoded
    for before, after in zip(snap.layers, later.layers):
        assert after.offset == before.offset + 2
        for name in ("keys_packed", "keys_w", "values_packed"):
            if name in before.arrays:
                n = before.arrays[name].shape[2]
                assert mx.array_equal(after.arrays[name][:, :, :n], before.arrays[name]).item()


def test_at_rest_trim_drops_codes_past_the_new_end(models):
    model = models["gemma2"]
    caches = _prefilled(model, "turbo4", 60)
    full = snapshot(caches)
    for c in caches:
        c.trim(20)
    model(prompt_tokens(20, seed=9)[None], cache=caches)
    again = snapshot(caches)
    assert [r.offset for r in again.layers] == [60] * 4
    assert not all(_equal_records(a, b) for a, b in zip(full.layers, again.layers))


def test_a_plan_that_cannot_decode_falls_back_to_at_rest_with_a_stated_warning(models):
    """gemma2 compressed in memory fails its first decode (the model multiplies the keys
    itself): the check catches it, and the fallback is stated, not an internal error."""
    model = models["gemma2"]
    spec = parse_scheme("turbo4")
    options = dict(seed=0, protect="stats", calibration=CalibrationConfig(True, True, True), guard=3.6)
    eligible = list(range(4))
    in_memory = lambda: _planned_caches(model, spec, mlx_make_prompt_cache(model), probe_kv_shapes(model),
                                        eligible, frozenset(), options)
    assert all(isinstance(c, TurboQuantKVCache) for c in in_memory())
    with pytest.raises(Exception):
        check_plan(model, in_memory)
    with pytest.warns(UserWarning, match="cannot attend over compressed storage for family gemma2"):
        assert _checked_fallback(model, spec, options, eligible, frozenset()) == "at rest"


def test_the_probe_is_cached_per_model(models):
    first = layers_read_by_model(models["gemma2"], [0, 1, 2, 3])
    assert layers_read_by_model(models["gemma2"], [0, 1, 2, 3]) is first


def test_mla_widths_calibrate_from_keys_when_queries_have_another_width():
    """Before: queries of the projected width (32) met latent keys (64) in the calibration:
    "[broadcast_shapes] Shapes (1,64) and (1,32) cannot be broadcast"."""
    cache = TurboQuantKVCache(plan_layer(parse_scheme("turbo4"), 1, 64, 32, mx.float32))
    cache.update_and_fetch(mx.random.normal((1, 1, 40, 64)), mx.random.normal((1, 1, 40, 32)))
    cache.observe_queries(mx.random.normal((1, 4, 40, 32)))
    cache.compress()
    keys, values = cache.dequantized()
    assert keys.shape == (1, 1, 40, 64) and values.shape == (1, 1, 40, 32)


def test_all_zero_keys_calibrate_to_nothing_and_decode_to_zero():
    """Before: all-zero keys gave NaN channel scales (0 / 0), and NaN keys after decode."""
    zeros = mx.zeros((1, 2, 40, 64))
    assert fit_key_calibration(zeros, Rotation.create(64, 0), CalibrationConfig(True, True, True)) is None
    for scheme in ("turbo4", "turbo8v3"):
        cache = TurboQuantKVCache(plan_layer(parse_scheme(scheme), 2, 64, 64, mx.float32))
        cache.update_and_fetch(zeros, zeros)
        cache.compress()
        keys, _ = cache.dequantized()
        assert mx.array_equal(keys, zeros).item()


def test_head_dims_below_16_stay_native():
    """Before: a layer with head dim 8 failed at compress ("lloyd_max_codebook needs an integer
    d >= 16")."""
    assert plan_layer(parse_scheme("turbo4"), 2, 8, 8, mx.float32) is None
    assert plan_layer(parse_scheme("turbo4"), 2, 16, 16, mx.float32) is not None


def test_at_rest_layers_export_to_mlx_lm_decoded(models, tmp_path):
    """Before: export refused them like TurboQuant layers ("mlx-lm has no cache class that reads it")."""
    from mlx_lm.models.cache import load_prompt_cache

    from tqstore.exchange.mlx_lm import export_prompt_cache

    model = models["deepseek_v3"]
    caches = _prefilled(model, "turbo4", 50)
    snap = snapshot(caches)
    export_prompt_cache(tmp_path / "c.safetensors", snap)
    loaded = load_prompt_cache(str(tmp_path / "c.safetensors"))
    for c, want in zip(loaded, restore(snap)):
        assert type(c) is KVCache and c.offset == 50
        assert mx.array_equal(c.keys[:, :, :50], want.keys[:, :, :50]).item()
        assert mx.array_equal(c.values[:, :, :50], want.values[:, :, :50]).item()


def test_residences_other_than_in_memory_are_stated_once_per_family(models, monkeypatch):
    from turboquant.adapter import making as integration

    monkeypatch.setattr(integration, "_notices", set())
    with pytest.warns(UserWarning) as record:
        make_prompt_cache(models["gpt_oss"], "turbo4")
        make_prompt_cache(models["deepseek_v3"], "turbo8v3")
        make_prompt_cache(models["deepseek_v3"], "turbo4")
    assert [str(w.message) for w in record] == [
        "layer kind RotatingKVCache (sliding window, overwritten in place) of family gpt_oss is stored uncompressed "
        "under turbo4",
        "layer kind KVCache of family deepseek_v3 is read by the model code: compressed at rest only"]


def test_at_rest_entries_share_prefix_blocks(tmp_path):
    """A stored at-rest (MLA) entry is a prefix of a longer context: its blocks are restored
    (decoded into the native cache) and shared, and only the new part is prefilled."""
    from model_folder import write_model_folder
    from tqstore import Store
    from tqstore.config import load_config
    from tqstore.engine.engine import Engine

    model = str(write_model_folder(tmp_path / "tiny-deepseek_v3", kind="deepseek_v3"))
    store = Store.open(tmp_path / "home", config=load_config(tmp_path / "home"))
    try:
        engine = Engine(store, prefill_chunk=128)
        document = "The contract says the seller pays for delays. Clause seven covers delivery. " * 40
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            base = engine.save("base", document, model=model)
            longer = engine.save("longer", document + " Extra terms follow here." * 10, model=model)
            answer = engine.ask("longer", "Who pays?", max_tokens=3)
        assert base.tokens > 512
        assert longer.reused_tokens == base.tokens and longer.reused_blocks == base.tokens // 256
        assert answer.cached_tokens == longer.tokens and len(answer.tokens) == 3
    finally:
        store.close()


def test_at_rest_can_be_forced_without_a_notice(models, monkeypatch):
    from turboquant.adapter import making as integration

    monkeypatch.setattr(integration, "_notices", set())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        caches = make_prompt_cache(models["llama"], "turbo4", at_rest=True)
    assert all(isinstance(c, AtRestKVCache) for c in caches)


@pytest.mark.parametrize("kind", ["deepseek_v3", "gemma2"])
def test_a_context_copy_holds_an_at_rest_layer_s_rows_not_its_codes(models, kind):
    """Before: the copy was restored from the layer's record, which is its codes, so a save's
    quality probe compared the codes with themselves: every at-rest entry's receipt read KL 0."""
    from turboquant import Context

    model = models[kind]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        context = Context.open(model, "turbo4")
    model(prompt_tokens(300)[None], cache=context.caches)
    copy = context.copy()
    rest = [i for i, c in enumerate(context.caches) if isinstance(c, AtRestKVCache)]
    assert rest
    for i in rest:
        held, copied = context.caches[i], copy[i]
        assert copied.offset == held.offset == 300
        assert mx.array_equal(copied.keys[:, :, :300], held.keys[:, :, :300]).item()
        assert mx.array_equal(copied.values[:, :, :300], held.values[:, :, :300]).item()
