"""Document chunks: stored once, moved to any offset, composed in any order, never served to
another model, codec or tokenizer; a damaged chunk is a miss."""

from __future__ import annotations

import json
import shutil

import mlx.core as mx
import pytest
from mlx_lm.models.cache import ArraysCache, ChunkedKVCache, KVCache, RotatingKVCache

from lmdb_damage import flip_segment_byte
from model_folder import write_model_folder
from tiny_models import build_model
from turboquant import make_prompt_cache
from tqstore import Store
from tqstore.engine.chunks import Document, chunk_address, prefix_tokens
from tqstore.engine.compose import (ChunkKV, check_composable, compose, decoded_kv, rope_description, rope_shift,
                                    shift_keys, window_sizes)
from tqstore.config import load_config
from tqstore.engine.engine import Engine
from tqstore.errors import BadInput, IdentityMismatch

X = "The contract says the seller pays for delays, and clause seven covers delivery."
A = "What does the dictionary say? To abscond is to move in a mysterious way. " * 2
B = "Absent means peculiarly exposed to the tooth of detraction. Summarise the document. " * 2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_model_folder(tmp_path_factory.mktemp("model") / "tiny-qwen2", kind="qwen2")


def open_engine(home) -> Engine:
    return Engine(Store.open(home, config=load_config(home)), prefill_chunk=64)


@pytest.fixture
def engine(tmp_path):
    engine = open_engine(tmp_path / "home")
    yield engine
    engine.store.close()


class Shifted:
    """A KVCache whose positions start at `shift` (a prompt prefilled D positions later)."""

    def __init__(self, shift: int):
        self.inner, self.shift = KVCache(), shift

    @property
    def offset(self) -> int:
        return self.inner.offset + self.shift

    def update_and_fetch(self, keys, values):
        return self.inner.update_and_fetch(keys, values)

    def make_mask(self, *args, **kwargs):
        return self.inner.make_mask(*args, **kwargs)


def fresh_keys(loaded, tokens, shift: int = 0) -> list[mx.array]:
    caches = [Shifted(shift) for _ in loaded.model.layers]
    loaded.model(mx.array(tokens)[None], cache=caches)
    return [c.inner.keys[..., :c.inner.offset, :] for c in caches]


def composed_kv(context) -> tuple[list[mx.array], list[mx.array]]:
    pairs = [decoded_kv(c) for c in context.caches]
    return [k for k, _ in pairs], [v for _, v in pairs]


def norm(x: mx.array) -> float:
    return mx.sqrt(mx.sum(mx.square(x.astype(mx.float32)))).item()


@pytest.mark.parametrize("scheme", ["raw", "turbo4"])
def test_one_chunk_at_three_offsets_equals_a_fresh_prefill_there(engine, model_dir, scheme):
    loaded = engine.model(str(model_dir))
    prefix = prefix_tokens(loaded, None)
    x = loaded.prompt.document_tokens(loaded.tokenizer, X)
    stored = engine.add_chunk("x", X, model=str(model_dir), scheme=scheme)
    assert stored.stored and stored.tokens == len(x)
    canonical = fresh_keys(loaded, prefix + x)
    decoded = [k for k, _ in (decoded_kv(c) for c in engine.prompt_cache("x")[0])]
    P = len(prefix)
    codec_error = [norm(d[:, :, P:] - c[:, :, P:]) for d, c in zip(decoded, canonical)]
    for docs in ([Document(name="x"), A, B], [A, Document(name="x"), B], [A, B, Document(name="x")]):
        docs = [Document(text=d) if isinstance(d, str) else d for d in docs]
        context = engine.chunks.composed_caches(loaded, docs, scheme, recompute=0.0)
        names = [c.name for c in context.chunks]
        at = P + sum(c.tokens for c in context.chunks[:names.index("x")])
        assert context.recomputed == 0 and context.tokens[at:at + len(x)] == x
        assert not context.chunks[names.index("x")].stored  # the stored copy, moved
        keys, values = composed_kv(context)
        reference = fresh_keys(loaded, prefix + x, shift=at - P)
        for layer, (k, ref) in enumerate(zip(keys, reference)):
            moved, expected = k[:, :, at:at + len(x)], ref[:, :, P:]
            if scheme == "raw":
                assert mx.allclose(moved, expected, atol=1e-4, rtol=1e-4).item(), layer
            else:  # the shift is a rotation: it moves the codec's error, never adds to it
                assert norm(moved - expected) <= 1.01 * codec_error[layer] + 1e-4 * norm(expected), layer
    # Everything recomputed: exactly a fresh prefill of the composed prompt.
    context = engine.chunks.composed_caches(loaded, docs, scheme, recompute=1.0)
    caches = [KVCache() for _ in loaded.model.layers]
    engine.prefill(loaded, caches, context.tokens)
    keys, values = composed_kv(context)
    assert context.recomputed == len(context.tokens) - P
    for k, v, c in zip(keys, values, caches):
        assert mx.array_equal(k, c.keys[..., :c.offset, :]).item() and mx.array_equal(v, c.values[..., :c.offset, :]).item()


def test_chunks_compose_in_any_order_from_one_stored_copy(engine, model_dir):
    loaded = engine.model(str(model_dir))
    for text in (X, A, B):
        engine.add_chunk(None, text, model=str(model_dir), scheme="turbo4")
    entries = len(engine.store.ls())
    prefix = prefix_tokens(loaded, None)
    tokens = {t: loaded.prompt.document_tokens(loaded.tokenizer, t) for t in (X, A, B)}
    for order in ([X, A, B], [B, X, A], [A, B, X]):
        context = engine.chunks.composed_caches(loaded, [Document(text=t) for t in order], "turbo4", recompute=0.5)
        assert context.tokens == prefix + [t for text in order for t in tokens[text]]
        assert not any(c.stored for c in context.chunks) and len(engine.store.ls()) == entries
        assert 0 < context.recomputed <= len(context.tokens) - len(prefix) and context.caches[0].offset == len(context.tokens)
        assert all(c.name.startswith("chunk-") for c in context.chunks)


def test_another_model_codec_or_tokenizer_is_never_served(engine, model_dir, tmp_path):
    engine.add_chunk("x", X, model=str(model_dir), scheme="turbo4")
    loaded = engine.model(str(model_dir))
    other_weights = engine.model(str(write_model_folder(tmp_path / "other", kind="qwen2", seed=5)))
    retok_dir = tmp_path / "retok"
    shutil.copytree(model_dir, retok_dir)
    config = json.loads((retok_dir / "tokenizer_config.json").read_text())
    (retok_dir / "tokenizer_config.json").write_text(json.dumps({**config, "pad_token": "<|im_start|>"}))
    other_tokenizer = engine.model(str(retok_dir))
    assert other_tokenizer.identity.digest != loaded.identity.digest
    for other in (other_weights, other_tokenizer):
        with pytest.raises(IdentityMismatch, match="another model"):
            engine.chunks.composed_caches(other, [Document(name="x")], "turbo4", recompute=0.0)
        context = engine.chunks.composed_caches(other, [Document(text=X)], "turbo4", recompute=0.0)
        assert context.chunks[0].stored and context.chunks[0].name != "x"
    with pytest.raises(IdentityMismatch, match="scheme turbo4"):
        engine.chunks.composed_caches(loaded, [Document(name="x")], "raw", recompute=0.0)
    context = engine.chunks.composed_caches(loaded, [Document(text=X)], "raw", recompute=0.0)
    assert context.chunks[0].stored and engine.store.get(context.chunks[0].name).scheme == "raw"
    codec = engine.codec_identity(loaded, "turbo4").digest
    base = chunk_address(loaded.identity.digest, codec, [1, 2], [3, 4])
    assert len({base, chunk_address(other_weights.identity.digest, codec, [1, 2], [3, 4]),
                chunk_address(loaded.identity.digest, engine.codec_identity(loaded, "raw").digest, [1, 2], [3, 4]),
                chunk_address(loaded.identity.digest, codec, [1], [2, 3, 4]),
                chunk_address(loaded.identity.digest, codec, [1, 2], [3, 5])}) == 5


def test_a_damaged_chunk_is_a_miss_and_prefilled_again(engine, model_dir, tmp_path):
    loaded = engine.model(str(model_dir))
    docs = [Document(text=A), Document(text=X)]
    before = composed_kv(engine.chunks.composed_caches(loaded, docs, "turbo4", recompute=0.0))
    name = engine.store.get(next(e.name for e in engine.store.ls() if e.tokens > 0 and e.name.startswith("chunk-")))
    key = name.blocks[0].key
    path = str(engine.store.tiers.lmdb.path)
    engine.store.close()
    flip_segment_byte(path, key)
    engine = open_engine(tmp_path / "home")
    engine.use_model(loaded)
    context = engine.chunks.composed_caches(loaded, docs, "turbo4", recompute=0.0)
    assert [c.stored for c in context.chunks].count(True) == 1  # the damaged one, prefilled again
    after = composed_kv(context)
    for side_before, side_after in zip(before, after):
        assert all(mx.array_equal(b, a).item() for b, a in zip(side_before, side_after))
    engine.store.close()


def test_a_chunk_replaced_while_it_is_read_never_pairs_the_new_kv_with_the_old_tokens(engine, model_dir):
    """Before: load_chunk checked one version's tokens, then loaded the entry by name, so a
    `chunk add --name x` in between gave the new chunk's K/V with the old chunk's tokens (an
    answer over another document than the one reported)."""
    from tqstore.errors import ConflictError

    loaded = engine.model(str(model_dir))
    prefix = prefix_tokens(loaded, None)
    old_tokens = loaded.prompt.document_tokens(loaded.tokenizer, A)
    new_tokens = list(reversed(old_tokens))  # as many tokens, other ones
    engine.chunks.ensure_chunk(loaded, "turbo4", prefix, old_tokens, "x")
    checked = engine.store.get("x")
    before = engine.chunks.load_chunk(loaded, checked, prefix, old_tokens)
    engine.chunks.ensure_chunk(loaded, "turbo4", prefix, new_tokens, "x")  # another process, say
    assert list(engine.store.get("x").tokens) == prefix + new_tokens
    try:
        after = engine.chunks.load_chunk(loaded, checked, prefix, old_tokens)
    except ConflictError as exc:
        assert "was replaced" in str(exc)
    else:
        assert all(mx.array_equal(a, b).item() for a, b in zip(after.keys, before.keys))


def test_models_whose_caches_cannot_move_are_refused():
    with pytest.raises(BadInput, match="dynamic NTK.*base grows with the sequence length"):
        rope_description(build_model("llama", rope_scaling={"type": "dynamic", "factor": 2.0}))
    model = build_model("qwen2")
    assert rope_description(model) == "default base=1000000 scale=1.0 traditional=False dims=64"
    with pytest.raises(BadInput, match="recurrent"):
        check_composable(model, [ArraysCache(2)])
    check_composable(model, [RotatingKVCache(max_size=64), KVCache()])  # sliding windows compose
    with pytest.raises(BadInput, match="keeps its first 4 tokens"):
        check_composable(model, [RotatingKVCache(max_size=64, keep=4)])
    with pytest.raises(BadInput, match="attention chunks"):
        check_composable(model, [ChunkedKVCache(16)])


# RoPE variants (tiny llama with rope_scaling, and gemma3's per-layer bases): the name of the
# variant -> (tiny_models kind, overrides).
ROPES = {
    "default": ("qwen2", {}),
    "linear": ("llama", {"rope_scaling": {"type": "linear", "factor": 4.0}}),
    "llama3": ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}),
    "yarn": ("llama", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                                        "beta_fast": 32, "beta_slow": 1}}),
    "longrope": ("llama", {"rope_scaling": {"rope_type": "longrope", "factor": 2.0,
                                            "original_max_position_embeddings": 64,
                                            "short_factor": [1.0] * 64, "long_factor": [1.0 + i / 32 for i in range(64)]},
                           "max_position_embeddings": 4096}),
    "gemma3 local and global": ("gemma3_text", {"sliding_window": 16}),
}
U = 2.0 ** -24  # float32 unit roundoff


def shift_bound(shift, reference: mx.array, position: int) -> mx.array:
    """Per element, the float32 rounding bound of |R(D) R(p0) x - R(p0 + D) x| (p0 + D = position).

    Per rotated pair (a, b) of norm r, one RoPE application computes the angle p * w (relative
    error u), cos and sin (absolute error <= 1 ulp of 1, 2u each: a rotation off by <= 2u * sqrt(2) * r)
    and a*c - b*s (<= u (|a c| + |b s|) + u |out| <= 2.5 u r): <= (5.4 u + u p w) r. The shifted key
    takes two applications (angles p0 w and D w), the reference one (angle (p0 + D) w), so their
    difference is <= r (16.2 u + 2 u (p0 + D) w), with w the fastest angular speed. The magnitude
    factor (YaRN, LongRoPE) is multiplied in once, identically on both sides, before any rotation."""
    half = shift.dims // 2
    pairs = ((reference[..., 0:shift.dims:2], reference[..., 1:shift.dims:2]) if shift.traditional
             else (reference[..., :half], reference[..., half:shift.dims]))
    r = mx.sqrt(mx.square(pairs[0]) + mx.square(pairs[1]))
    r = mx.repeat(r, 2, axis=-1) if shift.traditional else mx.concatenate([r, r], axis=-1)
    w = shift.scale if shift.freqs is None else shift.scale / mx.min(shift.freqs).item()
    return r * (17 * U + 2 * U * position * w)


@pytest.mark.parametrize("variant", list(ROPES))
def test_a_key_moved_from_position_0_equals_the_key_computed_at_the_new_position(variant):
    kind, overrides = ROPES[variant]
    model = build_model(kind, **overrides)
    layers = model.layers
    shifts = [rope_shift(model, i) for i in range(len(layers))]
    if variant.startswith("gemma3"):  # each layer moved with its own base: local 10000, global 1e6
        assert {s.base for s in shifts} == {10000.0, 1000000.0}
        assert rope_description(model).endswith("layers 2,5: default base=1000000.0 scale=1.0 traditional=False dims=256")
    x = mx.random.normal((1, 2, 12, layers[0].self_attn.rope.dims if hasattr(layers[0].self_attn.rope, "dims")
                          else shifts[0].dims), key=mx.random.key(1))
    for p in (1, 37, 513, 4000):
        for i in sorted({0, len(layers) - 1, *(j for j, s in enumerate(shifts) if s.describe() != shifts[0].describe())}):
            rope = layers[i].self_attn.rope
            at_zero, at_p = rope(x, offset=0), rope(x, offset=p)
            moved = shifts[i].shift(at_zero, p)
            error = mx.abs(moved - at_p)
            assert mx.all(error <= shift_bound(shifts[i], at_p, p)).item(), (variant, i, p, mx.max(error).item())
            if shifts[i].magnitude != 1.0 and p == 37:
                # The module itself multiplies by the magnitude again: far outside the bound.
                twice = rope(at_zero, offset=p)
                assert not mx.all(mx.abs(twice - at_p) <= shift_bound(shifts[i], at_p, p)).item()
    # Through the model: layer 0's keys of tokens prefilled at 0, moved to 300, against the same
    # tokens prefilled at 300 (layer 0's keys before RoPE depend on the tokens only).
    tokens = list(range(3, 40))
    at_zero, at_300 = fresh_keys_of(model, tokens, 0)[0], fresh_keys_of(model, tokens, 300)[0]
    moved = shift_keys(model, at_zero, 300)
    assert mx.all(mx.abs(moved - at_300) <= shift_bound(shifts[0], at_300, 300 + len(tokens))).item()


def fresh_keys_of(model, tokens, shift: int) -> list[mx.array]:
    caches = [Shifted(shift) for _ in model.layers]
    model(mx.array(tokens)[None], cache=caches)
    return [c.inner.keys[..., :c.inner.offset, :] for c in caches]


@pytest.mark.parametrize("kind", ["qwen2", "qwen3", "gemma3_text"])
def test_recomputing_every_moved_token_layer_by_layer_equals_a_full_prefill(kind):
    # gemma3: windows of 16 tokens in 4 of 6 layers, so chunks of 44-50 tokens cross them.
    model = build_model(kind, **({"sliding_window": 16} if kind == "gemma3_text" else {}))
    windows = window_sizes(model.make_cache()) if hasattr(model, "make_cache") else None
    tokens = mx.random.randint(0, 512, (150,), key=mx.random.key(3)).tolist()
    prefix, chunks = tokens[:6], [tokens[6:50], tokens[50:100], tokens[100:150]]

    def prefill(ts):
        caches = [KVCache() for _ in model.layers]
        model(mx.array(ts)[None], cache=caches)
        return [c.keys[..., :c.offset, :] for c in caches], [c.values[..., :c.offset, :] for c in caches]

    parts = [ChunkKV(prefix, c, *prefill(prefix + c)) for c in chunks]
    full_k, full_v = prefill(tokens)
    for full_layers in (0, 2):
        composed = compose(model, parts, 1.0, full_layers=full_layers, windows=windows)
        assert composed.tokens == tokens and composed.recomputed == 100  # every token of the moved chunks
        assert composed.recomputed_at == set(range(50, 150))
        for k, v, fk, fv in zip(composed.keys, composed.values, full_k, full_v):
            assert mx.allclose(k, fk, atol=1e-4, rtol=1e-4).item() and mx.allclose(v, fv, atol=1e-4, rtol=1e-4).item()
    for select in ("attention", "deviation", "product"):
        composed = compose(model, parts, 0.2, question=tokens[:8], select=select, windows=windows)
        assert composed.recomputed == round(0.2 * 144) and composed.reused == 144 - composed.recomputed
        assert len(composed.recomputed_at) == composed.recomputed and min(composed.recomputed_at) >= 50
        # The first chunk sits where it was prefilled: its stored K/V stay in the layers after the full ones.
        assert all(mx.array_equal(k[:, :, :50], p[:, :, :50]).item() for k, p in zip(composed.keys[2:], parts[0].keys[2:]))
    # Full layers over the whole model run every token: before, this counted the sinks alone.
    everything = compose(model, parts, 0.2, full_layers=len(model.layers), windows=windows)
    assert (everything.recomputed, everything.reused, everything.recomputed_at) == (144, 0, set(range(6, 150)))
    with pytest.raises(BadInput, match="unknown recompute selection"):
        compose(model, parts, 0.2, select="random")


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory):
    """A tiny gemma3: windows of 16 tokens in 4 of 6 layers, local base 10000, global 1e6."""
    return write_model_folder(tmp_path_factory.mktemp("model") / "tiny-gemma3", kind="gemma3_text", sliding_window=16)


def test_a_sliding_window_family_composes_its_chunks(engine, gemma_dir):
    loaded = engine.model(str(gemma_dir))
    prefix = prefix_tokens(loaded, None)
    x = loaded.prompt.document_tokens(loaded.tokenizer, X)
    assert len(x) > 16  # longer than the window
    # One chunk alone, stored raw: the composed caches are the caches of a prefill of it, exactly
    # (the window layers' last 16 rows, settled), and the next logits are equal.
    engine.add_chunk("x", X, model=str(gemma_dir), scheme="raw")
    context = engine.chunks.composed_caches(loaded, [Document(name="x")], "raw", recompute=0.0)
    caches = make_prompt_cache(loaded.model, "raw")
    engine.prefill(loaded, caches, prefix + x)
    assert sum(type(c) is RotatingKVCache for c in context.caches) == 4
    for mine, theirs in zip(context.caches, caches):
        assert type(mine) is type(theirs) and mine.offset == theirs.offset == len(prefix) + len(x)
        assert all(mx.array_equal(a, b).item() for a, b in zip(mine.state, theirs.state))
    question = mx.array(loaded.prompt.after_documents_tokens(loaded.tokenizer, "Who pays?"))[None]
    assert mx.array_equal(loaded.model(question, cache=context.caches), loaded.model(question, cache=caches)).item()
    # Three chunks, the named one moved: each layer holds the composed context's rows, window
    # layers the last 16 of them; at recompute 1 it is a prefill of the composed prompt.
    docs = [Document(text=A), Document(name="x"), Document(text=B)]
    for recompute in (0.0, 0.3):
        context = engine.chunks.composed_caches(loaded, docs, "raw", recompute=recompute)
        assert context.recomputed == round(recompute * (len(context.tokens) - len(prefix)))
        for cache in context.caches:
            assert cache.offset == len(context.tokens)
            if type(cache) is RotatingKVCache:
                assert cache.keys.shape[2] == 16
    full = engine.chunks.composed_caches(loaded, docs, "raw", recompute=1.0)
    caches = make_prompt_cache(loaded.model, "raw")
    engine.prefill(loaded, caches, full.tokens)
    for mine, theirs in zip(full.caches, caches):
        assert all(mx.array_equal(a, b).item() for a, b in zip(mine.state, theirs.state))
    # The moved chunk at recompute 0: its rows in every layer are those of a prefill of the same
    # tokens at that position (RoPE moved per layer, windows within the chunk as in a prefill).
    a = loaded.prompt.document_tokens(loaded.tokenizer, A)
    at = len(prefix) + len(a)
    first = engine.chunks.ensure_chunk(loaded, "raw", prefix, a, None)[1]
    moved = compose(loaded.model, [first, engine.chunks.load_chunk(loaded, engine.store.get("x"), prefix, x)], 0.0)
    reference = fresh_keys(loaded, prefix + x, shift=at - len(prefix))
    for layer, (k, ref) in enumerate(zip(moved.keys, reference)):
        assert mx.allclose(k[:, :, at:], ref[:, :, len(prefix):], atol=1e-4, rtol=1e-4).item(), layer
    texts = [Document(text=t) for t in (A, X, B)]  # stored again under turbo4 (global layers compressed)
    answer = engine.ask_documents(texts, "Who pays?", model=str(gemma_dir), scheme="turbo4", max_tokens=4)
    assert answer.reused_tokens == 0  # each text prefilled and stored by this request
    assert answer.recomputed_tokens + answer.prefilled_tokens == len(context.tokens) - len(prefix) + question.shape[1]
    assert len(answer.answer.tokens) == 4


@pytest.mark.parametrize("meanwhile", ["replaced", "removed"])
def test_a_named_chunk_replaced_or_removed_during_a_request_is_never_stored_again_from_its_old_tokens(
        engine, model_dir, monkeypatch, meanwhile):
    """Before: the request read chunk x's tokens, then looked x up again by name; finding another
    version (or none) it stored the old tokens as x, undoing the `chunk add --name x` or `rm x`
    that ran in between."""
    from tqstore.engine import chunks
    from tqstore.errors import ConflictError

    model = str(model_dir)
    loaded = engine.model(model)
    engine.add_chunk("x", A, model=model, scheme="turbo4")
    check = chunks.check_budget

    def another_process_meanwhile(*args, **kwargs):  # runs between the two reads of x
        if meanwhile == "replaced":
            engine.add_chunk("x", B, model=model, scheme="turbo4")
        else:
            engine.store.rm("x")
        return check(*args, **kwargs)

    monkeypatch.setattr(chunks, "check_budget", another_process_meanwhile)
    try:
        answer = engine.ask_documents([Document(name="x"), Document(text=X)], "Who pays?", model=model, max_tokens=2)
    except ConflictError as exc:
        assert "was replaced" in str(exc)
    else:  # served from the version read, whose objects outlived the replacement
        assert not answer.chunks[0].stored
    if meanwhile == "replaced":
        b = loaded.prompt.document_tokens(loaded.tokenizer, B)
        assert list(engine.store.get("x").tokens) == prefix_tokens(loaded, None) + b
    else:
        assert "x" not in {e.name for e in engine.store.ls()}


def test_the_counts_say_which_tokens_were_reused_recomputed_and_prefilled_by_this_request(engine, model_dir):
    """Before: the tokens of documents this request prefilled and stored were counted as reused,
    and at recompute 1 every document token was both recomputed and prefilled."""
    model, question = str(model_dir), "Who pays?"
    loaded = engine.model(model)
    asked = len(loaded.prompt.after_documents_tokens(loaded.tokenizer, question))
    size = {t: len(loaded.prompt.document_tokens(loaded.tokenizer, t)) for t in (X, A, B)}
    C = "The buyer pays for the delivery, the seller for the delays. " * 2
    size[C] = len(loaded.prompt.document_tokens(loaded.tokenizer, C))

    def ask(docs, recompute=0.5):
        return engine.ask_documents(docs, question, model=model, recompute=recompute, max_tokens=1)

    new = ask([Document(text=A), Document(text=B)])
    assert all(c.stored for c in new.chunks) and new.reused_tokens == 0 and new.recomputed_tokens > 0
    assert new.recomputed_tokens + new.prefilled_tokens == size[A] + size[B] + asked
    engine.add_chunk("x", X, model=model)
    # The first document sits where it was prefilled and is never recomputed.
    old_first = ask([Document(name="x"), Document(text=C)])
    assert old_first.reused_tokens == size[X] and old_first.recomputed_tokens > 0
    assert old_first.prefilled_tokens == asked + size[C] - old_first.recomputed_tokens
    engine.store.rm(old_first.chunks[1].name)
    new_first = ask([Document(text=C), Document(name="x")])
    assert new_first.prefilled_tokens == asked + size[C] and new_first.recomputed_tokens > 0
    assert new_first.reused_tokens == size[X] - new_first.recomputed_tokens
    full = ask([Document(text=B), Document(name="x")], recompute=1.0)
    assert (full.reused_tokens, full.recomputed_tokens, full.prefilled_tokens) == (0, 0, full.answer.prompt_tokens)
