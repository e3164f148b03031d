import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step, speculative_generate_step, stream_generate
from mlx_lm.models.cache import KVCache, RotatingKVCache
from mlx_lm.models.cache import make_prompt_cache as mlx_make_prompt_cache

from tiny_models import build_model, prompt_tokens
from turboquant import TurboQuantKVCache, make_prompt_cache, restore, snapshot
from turboquant.adapter.dispatch import compressed_sdpa
from turboquant.records import Layout

SCHEMES = ["raw", "affine8", "affine4", "turbo0v4", "turbo0v3", "turbo0v2", "turbo8v4", "turbo8v3", "turbo8v2",
           "turbo4", "turbo3", "turbo2", "turbo4v2"]


KINDS = ["llama", "qwen2", "qwen3", "gemma3_text"]


def _matrix(schemes, whole_kinds, whole_schemes=("turbo4",)):
    """(kind, scheme) cases: every scheme on `whole_kinds` and every kind under `whole_schemes` in the
    default run; the rest of the product (same code paths, other shapes) under -m slow."""
    return [pytest.param(kind, scheme, id=f"{scheme}-{kind}",
                         marks=() if kind in whole_kinds or scheme in whole_schemes else pytest.mark.slow)
            for kind in KINDS for scheme in schemes]


@pytest.fixture(scope="module")
def models():
    return {kind: build_model(kind) for kind in KINDS}


# Half the layers where a test's cost is its decode steps, every kind of layer kept: under the
# fragile schemes the boundary rule marks the first and last of four eligible layers and leaves
# the two between (of eight, two at each end and four), and gemma3_text keeps two sliding-window
# layers before a global one.
SHORT = {"llama": 4, "qwen2": 4, "qwen3": 4, "gemma3_text": 3}


@pytest.fixture(scope="module")
def short_models():
    return {kind: build_model(kind, num_hidden_layers=n) for kind, n in SHORT.items()}


def _expected_layouts(kind, scheme):
    n = 6 if kind == "gemma3_text" else 8
    rotating = {0, 1, 3, 4} if kind == "gemma3_text" else set()
    eligible = [i for i in range(n) if i not in rotating]
    compressed = {
        "raw": Layout.RAW, "affine8": Layout.AFFINE, "affine4": Layout.AFFINE,
        "turbo0v4": Layout.RAWK_TURBO, "turbo0v3": Layout.RAWK_TURBO, "turbo0v2": Layout.RAWK_TURBO,
        "turbo8v4": Layout.AFFINEK_TURBO, "turbo8v3": Layout.AFFINEK_TURBO, "turbo8v2": Layout.AFFINEK_TURBO,
    }.get(scheme, Layout.CALIBRATED)
    fragile = scheme in ("turbo0v2", "turbo8v2") or compressed is Layout.CALIBRATED
    protected = set(eligible[:2] + eligible[-2:]) if fragile and len(eligible) >= 8 else set()
    return [Layout.ROTATING if i in rotating else Layout.AFFINE if i in protected else compressed for i in range(n)]


def _decode(model, caches, tokens, steps):
    """Teacher-forced single-token steps; returns the logits of each step."""
    out = []
    for t in range(steps):
        logits = model(tokens[t:t + 1][None], cache=caches)
        mx.eval(logits)
        out.append(logits)
    return out


@pytest.mark.parametrize(("kind", "scheme"), _matrix(SCHEMES, ("qwen2", "gemma3_text")))
def test_every_scheme_generates_with_expected_layouts(models, kind, scheme):
    model = models[kind]
    caches = make_prompt_cache(model, scheme, protect="position")
    prompt = prompt_tokens(48)
    tokens = [t for t, _ in zip(generate_step(prompt, model, prompt_cache=caches, max_tokens=4), range(4))]
    assert len(tokens) == 4
    layouts = [r.layout for r in snapshot(caches).layers]
    assert layouts == _expected_layouts(kind, scheme)
    if scheme != "raw":
        assert any(isinstance(c, TurboQuantKVCache) for c in caches)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "gemma3_text"])
def test_raw_is_exactly_mlx_lm(short_models, kind):
    model = short_models[kind]
    prompt = prompt_tokens(40)
    ours = make_prompt_cache(model, "raw")
    theirs = mlx_make_prompt_cache(model)
    assert [type(c) for c in ours] == [type(c) for c in theirs]
    a = model(prompt[None], cache=ours)
    b = model(prompt[None], cache=theirs)
    assert mx.array_equal(a, b).item()
    follow = prompt_tokens(6, seed=4)
    for x, y in zip(_decode(model, ours, follow, 6), _decode(model, theirs, follow, 6)):
        assert mx.array_equal(x, y).item()


@pytest.mark.parametrize(("kind", "scheme"), _matrix(["turbo0v4", "turbo8v3", "turbo4", "affine8", "turbo2"], ("qwen2",)))
@pytest.mark.parametrize("compress_first", [True, False])
def test_restored_cache_decodes_exactly_like_the_original(short_models, kind, scheme, compress_first):
    model = short_models[kind]
    prompt = prompt_tokens(70)
    caches = make_prompt_cache(model, scheme)
    model(prompt[None], cache=caches)
    if compress_first:
        for c in caches:
            if isinstance(c, TurboQuantKVCache):
                c.compress()
    snap = snapshot(caches)
    mx.eval(snap.arrays())
    before = {i: {n: mx.array(a) for n, a in r.arrays.items()} for i, r in enumerate(snap.layers)}
    restored = restore(snap)
    follow = prompt_tokens(8, seed=7)
    for x, y in zip(_decode(model, caches, follow, 8), _decode(model, restored, follow, 8)):
        assert mx.array_equal(x, y).item()
    # A multi-token follow-up turn through the compressed path, then more decode steps.
    turn = prompt_tokens(5, seed=8)
    assert mx.array_equal(model(turn[None], cache=caches), model(turn[None], cache=restored)).item()
    # The snapshot did not change while both caches moved on (MLX in-place writes alias objects).
    for i, r in enumerate(snap.layers):
        for n, a in r.arrays.items():
            assert mx.array_equal(a, before[i][n]).item(), (i, n)


def test_stream_generate_with_prompt_cache(models):
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    model = models["llama"]
    caches = make_prompt_cache(model, "turbo8v3")
    prompt = prompt_tokens(30)
    steps = list(generate_step(prompt, model, prompt_cache=caches, max_tokens=5))
    assert len(steps) == 5 and all(isinstance(c, TurboQuantKVCache) and c.compressed for c in caches)
    assert callable(stream_generate) and TokenizerWrapper  # generate_step is what stream_generate drives


def test_speculative_decoding_with_a_turbo_scheme(short_models):
    model = short_models["llama"]
    draft = build_model("llama", seed=3, num_hidden_layers=2)
    caches = make_prompt_cache(model, "turbo0v4") + make_prompt_cache(draft, "turbo0v4")
    prompt = prompt_tokens(40)
    out = list(speculative_generate_step(prompt, model, draft, prompt_cache=caches, num_draft_tokens=3,
                                         max_tokens=12))
    greedy = list(generate_step(prompt, model, prompt_cache=make_prompt_cache(model, "turbo0v4"), max_tokens=12))
    assert [t for t, *_ in out] == [t for t, _ in greedy]


def test_dispatch_is_installed_on_the_model_module(models):
    import sys

    model = models["qwen2"]
    make_prompt_cache(model, "turbo4")
    assert sys.modules[type(model).__module__].scaled_dot_product_attention is compressed_sdpa


def test_native_layers_keep_mlx_lm_classes(models):
    caches = make_prompt_cache(models["gemma3_text"], "turbo4")
    assert sum(isinstance(c, RotatingKVCache) for c in caches) == 4
    caches = make_prompt_cache(models["llama"], "raw")
    assert all(type(c) is KVCache for c in caches)


def test_snapshot_of_a_ring_buffer_does_not_change_when_decoding_continues(short_models):
    """RotatingKVCache writes its ring buffer in place once full; a snapshot must not see that."""
    model = short_models["gemma3_text"]
    caches = make_prompt_cache(model, "turbo0v4")
    model(prompt_tokens(70)[None], cache=caches)
    follow = prompt_tokens(6, seed=2)
    _decode(model, caches, follow, 2)
    snap = snapshot(caches)
    mx.eval(snap.arrays())
    before = [{n: mx.array(a) for n, a in r.arrays.items()} for r in snap.layers]
    restored = restore(snap)
    _decode(model, caches, follow[2:], 3)
    _decode(model, restored, follow[2:], 3)
    for r, b in zip(snap.layers, before):
        for n, a in r.arrays.items():
            assert mx.array_equal(a, b[n]).item()
