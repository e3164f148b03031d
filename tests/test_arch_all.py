"""Every mlx-lm model family: `raw` snapshots round-trip bit-exactly (issue 18, item 1).

Parametrized over `arch_configs.families()` (discovered from the installed mlx-lm): prefill a
short prompt into mlx-lm's own caches, snapshot, format dumps/loads, restore; every state array
equals the original and the next token's logits equal those of the never-saved caches.
"""

from __future__ import annotations

import functools

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.cache import CacheList, make_prompt_cache

import arch_configs
from tqstore.format import objects as fmt
from turboquant import restore, snapshot
from turboquant.records import split_children

PROMPT = 40


@functools.lru_cache(maxsize=2)  # one family's model for all its tests; families run in order
def _model(family: str):
    return arch_configs.build(family)


def _prompt(n: int = PROMPT + 1) -> mx.array:
    return mx.random.randint(0, arch_configs.VOCAB, (1, n), key=mx.random.key(7))


def cache_arrays(caches, prefix: str = "") -> list[tuple[str, mx.array]]:
    """Every valid array a list of caches holds, by path (whatever their class, nested lists too)."""
    out = []
    for i, c in enumerate(caches):
        if isinstance(c, CacheList):
            out += cache_arrays(c.caches, f"{prefix}{i}.")
            continue
        # Growing buffers hand out their valid rows here; `state` may include spare capacity.
        state = c.keys_and_values() if hasattr(c, "keys_and_values") and not c.empty() else c.state
        out += [(f"{prefix}{i}.{k}", v) for k, v in tree_flatten(state) if isinstance(v, mx.array)]
    return out


def test_discovery_is_complete():
    found = set(arch_configs.families())
    assert len(found) > 100, "mlx-lm's model modules were not discovered"
    stale = set(arch_configs.NOT_BUILDABLE) - found
    assert not stale, f"NOT_BUILDABLE lists families mlx-lm no longer has: {sorted(stale)}"


@pytest.mark.parametrize("family", arch_configs.families())
def test_raw_round_trip(family):
    if family in arch_configs.NOT_BUILDABLE:
        pytest.skip(arch_configs.NOT_BUILDABLE[family])
    model = _model(family)
    tokens = _prompt()
    caches = make_prompt_cache(model)
    assert caches, f"{family}: the tiny config has no layers that cache anything"
    mx.eval(model(tokens[:, :PROMPT], cache=caches))
    snap = snapshot(caches, tokens=PROMPT)
    loaded = fmt.loads(fmt.dumps(snap), expect=fmt.Expect(kind="snapshot"))
    restored = restore(loaded)
    before, after = cache_arrays(caches), cache_arrays(restored)
    assert [k for k, _ in after] == [k for k, _ in before]
    for (name, a), (_, b) in zip(before, after):
        assert a.dtype == b.dtype and mx.array_equal(a, b), f"{family}: {name} differs after the round trip"
    expected = model(tokens[:, PROMPT:], cache=caches)
    assert mx.all(mx.isfinite(expected)), f"{family}: the tiny config gives non-finite logits"
    assert mx.array_equal(model(tokens[:, PROMPT:], cache=restored), expected), f"{family}: next token differs"


@pytest.mark.parametrize("family", sorted(arch_configs.NOT_BUILDABLE))
def test_families_listed_as_not_buildable_still_fail(family):
    if family in arch_configs.UNSAFE:
        pytest.skip(arch_configs.NOT_BUILDABLE[family])
    try:
        model = arch_configs.build(family)
        caches = make_prompt_cache(model)
        logits = model(_prompt(8), cache=caches)
        finite = bool(mx.all(mx.isfinite(logits)))
    except (Exception, SystemExit):  # any failure is what the list says; olmo exits on import
        return
    assert not finite, f"{family} now builds with finite logits: remove it from NOT_BUILDABLE"


def test_a_cache_list_model_counts_its_tokens_without_being_told():
    model = _model("falcon_h1")
    caches = make_prompt_cache(model)
    mx.eval(model(_prompt(12), cache=caches))
    snap = snapshot(caches)
    assert snap.offset == 12 and all(c.offset == 12 for c in split_children(snap.layers[0]))
