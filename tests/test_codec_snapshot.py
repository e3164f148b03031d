"""The codec identity without building compressed caches (issue 32): `codec_snapshot` describes
a model's layers from their plans and mlx-lm's own empty caches, and must hash exactly as the
snapshot of fresh `make_prompt_cache` caches did, or every stored entry would stop matching."""

from __future__ import annotations

import warnings

import pytest

import arch_configs
from tqstore.models.identity import CodecIdentity
from turboquant import codec_snapshot, make_prompt_cache, snapshot

WINDOWS = {"sliding_window": 8, "attention_chunk_size": 8}
# one family per kind of layer: plain attention, sliding windows, chunked attention, recurrent
# states next to attention, CacheLists, a model's own cache class
FAMILIES = {"llama": {}, "gemma3": WINDOWS, "gpt_oss": WINDOWS, "llama4": WINDOWS, "qwen3_5": {},
            "falcon_h1": {}, "baichuan_m1": WINDOWS,
            "deepseek_v41": dict(compress_ratios=[0, 4, 3, 4], kv_source_layer_ids=[1, 2],
                                 index_source_layer_ids=[1, 3], index_n_heads=2, index_head_dim=16, index_topk=8)}
SCHEMES = ("raw", "turbo4", "turbo5v4", "affine8", "turbo8v3", "auto3.5")


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def model(request):
    return arch_configs.build(request.param, vocab_size=128, **FAMILIES[request.param])


@pytest.mark.parametrize("windows", ["whole", "token"])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_the_codec_snapshot_hashes_as_fresh_caches_do(model, scheme, windows):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the residence notices of the tiny families
        fresh = CodecIdentity.from_snapshot(snapshot(make_prompt_cache(model, scheme), windows=windows), scheme)
        described = CodecIdentity.from_snapshot(codec_snapshot(model, scheme, windows=windows), scheme)
    assert described.fields() == fresh.fields()
    assert described.digest == fresh.digest


def test_no_compressed_cache_is_built(monkeypatch):
    model = arch_configs.build("llama", vocab_size=128)
    make_prompt_cache(model, "turbo4")  # the plan's check runs once per model, and builds caches
    import turboquant.adapter.making as making

    def refuse(*args, **kwargs):
        raise AssertionError("a compressed cache was built")

    monkeypatch.setattr(making, "TurboQuantKVCache", refuse)
    monkeypatch.setattr(making, "AtRestKVCache", refuse)
    layers = codec_snapshot(model, "turbo4").layers
    assert layers and all(r.offset == 0 and not r.arrays for r in layers)
