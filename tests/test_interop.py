"""mlx-lm prompt-cache files <-> Snapshots (tqstore.exchange.mlx_lm)."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import (ArraysCache, KVCache, QuantizedKVCache, load_prompt_cache, make_prompt_cache,
                                 save_prompt_cache)

from test_blocks import assert_same_snapshot, make_snapshot
from tiny_models import build_model, prompt_tokens
from tqstore.format import objects as F
from tqstore.errors import MalformedHeader, UnsupportedCache
from tqstore.exchange.mlx_lm import export_prompt_cache, import_prompt_cache
from turboquant import make_prompt_cache as tq_make_prompt_cache
from turboquant import restore, snapshot
from turboquant.adapter.snapshots import restore_as
from turboquant.records import LayerRecord, Layout, Snapshot


def _decode(model, caches, first, steps=8):
    y, out = first, []
    for _ in range(steps):
        logits = model(y[None], cache=caches)[0, -1]
        mx.eval(logits)
        out.append(logits)
        y = mx.argmax(logits)[None]
    return out


def _same_logits(a, b):
    return all(mx.array_equal(x, y).item() for x, y in zip(a, b))


@pytest.fixture(scope="module")
def llama():
    return build_model("llama")


@pytest.mark.parametrize("cache_kind", ["kv", "quantized"])
def test_mlx_lm_file_round_trip_decodes_identically(llama, tmp_path, cache_kind):
    prompt = prompt_tokens(21)
    caches = make_prompt_cache(llama) if cache_kind == "kv" else [QuantizedKVCache(64, 8) for _ in llama.layers]
    llama(prompt[None, :-1], cache=caches)
    save_prompt_cache(str(tmp_path / "mlx.safetensors"), caches, {"model": "tiny"})
    imported = import_prompt_cache(tmp_path / "mlx.safetensors")
    assert imported.metadata == {"model": "tiny"}
    assert {r.layout for r in imported.snapshot.layers} == {Layout.RAW if cache_kind == "kv" else Layout.AFFINE}
    assert all(r.offset == 20 for r in imported.snapshot.layers)
    # through tqstore's own format and back out to an mlx-lm file
    snap = F.loads(F.dumps(imported.snapshot), expect=F.Expect())
    export_prompt_cache(tmp_path / "out.safetensors", snap, {"model": "tiny"})
    loaded, meta = load_prompt_cache(str(tmp_path / "out.safetensors"), return_metadata=True)
    assert meta == {"model": "tiny"} and type(loaded[0]) is type(caches[0])
    assert _same_logits(_decode(llama, caches, prompt[-1:]), _decode(llama, loaded, prompt[-1:]))


@pytest.mark.filterwarnings("ignore:sliding-window")
def test_rotating_layers_export_and_import(tmp_path):
    gemma = build_model("gemma3_text")
    prompt = prompt_tokens(101)
    caches = make_prompt_cache(gemma)
    gemma(prompt[None, :-1], cache=caches)  # 100 tokens wrap the 64-token windows
    export_prompt_cache(tmp_path / "g.safetensors", snapshot(caches))
    imported = import_prompt_cache(tmp_path / "g.safetensors")
    assert_same_snapshot(imported.snapshot, snapshot(caches))
    loaded = load_prompt_cache(str(tmp_path / "g.safetensors"))
    assert _same_logits(_decode(gemma, caches, prompt[-1:]), _decode(gemma, loaded, prompt[-1:]))


def test_affine8_snapshot_exports_to_quantized_kv_cache(llama, tmp_path):
    prompt = prompt_tokens(21)
    caches = tq_make_prompt_cache(llama, "affine8")
    llama(prompt[None, :-1], cache=caches)
    for c in caches:
        c.compress()
    snap = snapshot(caches)
    export_prompt_cache(tmp_path / "a.safetensors", snap)
    loaded = load_prompt_cache(str(tmp_path / "a.safetensors"))
    assert all(type(c) is QuantizedKVCache and c.bits == 8 and c.offset == 20 for c in loaded)
    logits = _decode(llama, loaded, prompt[-1:])
    assert all(mx.all(mx.isfinite(x)).item() for x in logits)
    # and back: the same arrays under the affine8 plan's own config, so restore() accepts it
    back = import_prompt_cache(tmp_path / "a.safetensors").snapshot
    assert_same_snapshot(back, snap)
    assert _same_logits(_decode(llama, restore(back), prompt[-1:]), _decode(llama, caches, prompt[-1:]))


def test_import_compresses_to_a_scheme(llama, tmp_path):
    prompt = prompt_tokens(41)
    caches = make_prompt_cache(llama)
    llama(prompt[None, :-1], cache=caches)
    save_prompt_cache(str(tmp_path / "raw.safetensors"), caches)
    raw = import_prompt_cache(tmp_path / "raw.safetensors").snapshot
    for scheme in ("turbo8v3", "turbo4"):
        imported = import_prompt_cache(tmp_path / "raw.safetensors", model=llama, scheme=scheme).snapshot
        assert all(r.layout is not Layout.RAW and r.offset == 40 for r in imported.layers)
        # turboquant's own path for rows prefilled elsewhere (the file holds no queries)
        reference = restore_as(raw, tq_make_prompt_cache(llama, scheme))
        for c in reference:
            c.compress()
        assert_same_snapshot(imported, snapshot(reference))
        stored = F.loads(F.dumps(imported), expect=F.Expect())
        assert _same_logits(_decode(llama, restore(stored), prompt[-1:]), _decode(llama, reference, prompt[-1:]))
    with pytest.raises(ValueError, match="needs the model"):
        import_prompt_cache(tmp_path / "raw.safetensors", scheme="turbo4")
    quantized = [QuantizedKVCache(64, 8) for _ in llama.layers]
    llama(prompt[None, :-1], cache=quantized)
    save_prompt_cache(str(tmp_path / "q.safetensors"), quantized)
    with pytest.raises(UnsupportedCache, match="already quantized"):
        import_prompt_cache(tmp_path / "q.safetensors", model=llama, scheme="turbo4")


def test_turbo_layers_cannot_be_exported(tmp_path):
    snap = make_snapshot(4)
    with pytest.raises(UnsupportedCache, match="layer 0 is affine with different key and value"):
        export_prompt_cache(tmp_path / "x.safetensors", snap)
    r = make_snapshot(4, layouts=[Layout.AFFINE]).layers[0]
    plain = {**r.config, "value_bits": 8, "value_group_size": 64}
    calibrated = LayerRecord(r.layout, r.offset, r.arrays, plain, r.state, {"scale": mx.ones((2, 64))})
    with pytest.raises(UnsupportedCache, match="layer 0 is affine with calibrated keys"):
        export_prompt_cache(tmp_path / "x.safetensors", Snapshot([calibrated], {}))
    with pytest.raises(UnsupportedCache, match="layer 0 is turbo.*raw or affine8"):
        export_prompt_cache(tmp_path / "x.safetensors", make_snapshot(4, layouts=[Layout.TURBO]))
    with pytest.raises(ValueError, match=".safetensors"):
        export_prompt_cache(tmp_path / "x.cache", make_snapshot(4, layouts=[Layout.RAW]))
    assert not list(tmp_path.iterdir())


def test_unsupported_and_broken_files(tmp_path):
    cache = ArraysCache(1)
    cache[0] = mx.zeros((1, 4))
    save_prompt_cache(str(tmp_path / "arrays.safetensors"), [KVCache(), cache])
    with pytest.raises(UnsupportedCache, match="layer 1 is a ArraysCache"):
        import_prompt_cache(tmp_path / "arrays.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(MalformedHeader, match="not an mlx-lm prompt-cache file"):
        import_prompt_cache(tmp_path / "junk.safetensors")
