"""turbo4 and turbo8v3 over every mlx-lm family that builds from a tiny config (issue 18): make
the caches, prefill, compress, snapshot, format dumps/loads, restore, decode. The restored caches
snapshot to exactly what was saved (array_equal), decode to finite logits, and every layer is
stored in the residence the support table states (`layer_residences`)."""

import functools
import warnings

import mlx.core as mx
import pytest

from arch_configs import NOT_BUILDABLE, build, families
from tqstore.format import objects as F
from turboquant.adapter.making import compress_caches, layer_residences, make_prompt_cache
from turboquant.adapter.snapshots import restore, snapshot
from turboquant.adapter.residence import Residence, residence_of

FAMILIES = [f for f in families() if f not in NOT_BUILDABLE]
CLASSES = {Residence.IN_MEMORY: {"TurboQuantKVCache"}, Residence.AT_REST: {"AtRestKVCache"}}


@functools.lru_cache(maxsize=None)
def _model(family: str):
    return build(family)


def _equal(a, b) -> bool:
    if a.layout is not b.layout or a.offset != b.offset or set(a.arrays) != set(b.arrays):
        return False
    return all(mx.array_equal(a.arrays[n], b.arrays[n]).item() for n in a.arrays)


@pytest.mark.parametrize("scheme", ["turbo4", "turbo8v3"])
@pytest.mark.parametrize("family", FAMILIES)
def test_compressed_save_restore_decode(family, scheme):
    model = _model(family)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        caches = make_prompt_cache(model, scheme)
        stated = [r for _, r in layer_residences(model, scheme)]
    assert [residence_of(c) for c in caches] == stated
    model(mx.arange(1, 41)[None], cache=caches)
    compress_caches(caches)
    snap = snapshot(caches)
    for residence, record in zip(stated, snap.layers):
        cls = record.config.get("class")
        assert cls in CLASSES[residence] if residence in CLASSES else cls not in ("TurboQuantKVCache", "AtRestKVCache")
    loaded = F.loads(F.dumps(snap), expect=F.Expect("snapshot"))
    restored = restore(loaded)
    again = snapshot(restored)
    assert all(_equal(a, b) for a, b in zip(snap.layers, again.layers))
    logits = model(mx.array([[5]]), cache=restored)
    assert mx.all(mx.isfinite(logits)).item()


def test_the_support_table_does_not_use_up_a_layer_kind_s_notice(monkeypatch):
    # layer_residences silenced the notice and still recorded it as shown, so the next
    # make_prompt_cache of that model said nothing of its uncompressed layers.
    from turboquant.adapter import making

    monkeypatch.setattr(making, "_notices", set())
    model = _model("gemma3_text")
    layer_residences(model, "turbo4")
    with pytest.warns(UserWarning, match="stored uncompressed"):
        make_prompt_cache(model, "turbo4")
