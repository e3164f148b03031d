"""Document chunks: stored once, moved to any offset, composed in any order, never served to
another model, codec or tokenizer; a damaged chunk is a miss."""

from __future__ import annotations

import json
import shutil

import mlx.core as mx
import pytest
from mlx_lm.models.cache import ArraysCache, KVCache

from lmdb_damage import flip_segment_byte
from model_folder import write_model_folder
from tiny_models import build_model
from tqstore import Store
from tqstore.engine.chunks import Document, chunk_address, composed_caches, prefix_tokens
from tqstore.engine.compose import ChunkKV, check_composable, compose, decoded_kv, rope_description
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
        context = composed_caches(engine, loaded, docs, scheme, recompute=0.0)
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
    context = composed_caches(engine, loaded, docs, scheme, recompute=1.0)
    caches = [KVCache() for _ in loaded.model.layers]
    engine.prefill(loaded, caches, context.tokens)
    keys, values = composed_kv(context)
    assert context.recomputed == len(context.tokens) - P
    for k, v, c in zip(keys, values, caches):
        assert mx.array_equal(k, c.keys[..., :c.offset, :]).item() and mx.array_equal(v, c.values[..., :c.offset, :]).item()


def test_chunks_compose_in_any_order_from_one_stored_copy(engine, model_dir):
    loaded = engine.model(str(model_dir))
    for text in (X, A, B):
        engine.add_chunk(None, text, model=str(model_dir))
    entries = len(engine.store.ls())
    prefix = prefix_tokens(loaded, None)
    tokens = {t: loaded.prompt.document_tokens(loaded.tokenizer, t) for t in (X, A, B)}
    for order in ([X, A, B], [B, X, A], [A, B, X]):
        context = composed_caches(engine, loaded, [Document(text=t) for t in order], "turbo5v4", recompute=0.5)
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
            composed_caches(engine, other, [Document(name="x")], "turbo4", recompute=0.0)
        context = composed_caches(engine, other, [Document(text=X)], "turbo4", recompute=0.0)
        assert context.chunks[0].stored and context.chunks[0].name != "x"
    with pytest.raises(IdentityMismatch, match="scheme turbo4"):
        composed_caches(engine, loaded, [Document(name="x")], "raw", recompute=0.0)
    context = composed_caches(engine, loaded, [Document(text=X)], "raw", recompute=0.0)
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
    before = composed_kv(composed_caches(engine, loaded, docs, "turbo4", recompute=0.0))
    name = engine.store.get(next(e.name for e in engine.store.ls() if e.tokens > 0 and e.name.startswith("chunk-")))
    key = name.blocks[0].key
    path = str(engine.store.tiers.lmdb.path)
    engine.store.close()
    flip_segment_byte(path, key)
    engine = open_engine(tmp_path / "home")
    engine.use_model(loaded)
    context = composed_caches(engine, loaded, docs, "turbo4", recompute=0.0)
    assert [c.stored for c in context.chunks].count(True) == 1  # the damaged one, prefilled again
    after = composed_kv(context)
    for side_before, side_after in zip(before, after):
        assert all(mx.array_equal(b, a).item() for b, a in zip(side_before, side_after))
    engine.store.close()


def test_models_whose_caches_cannot_move_are_refused():
    with pytest.raises(BadInput, match="dynamic NTK"):
        rope_description(build_model("llama", rope_scaling={"type": "dynamic", "factor": 2.0}))
    model = build_model("qwen2")
    assert rope_description(model).startswith("default base=1000000")
    with pytest.raises(BadInput, match="recurrent"):
        check_composable(model, [ArraysCache(2)])
    with pytest.raises(BadInput, match="sliding window"):
        from mlx_lm.models.cache import RotatingKVCache
        check_composable(model, [RotatingKVCache(max_size=64)])


@pytest.mark.parametrize("kind", ["qwen2", "qwen3"])
def test_recomputing_every_moved_token_layer_by_layer_equals_a_full_prefill(kind):
    model = build_model(kind)
    tokens = mx.random.randint(0, 512, (150,), key=mx.random.key(3)).tolist()
    prefix, chunks = tokens[:6], [tokens[6:50], tokens[50:100], tokens[100:150]]

    def prefill(ts):
        caches = [KVCache() for _ in model.layers]
        model(mx.array(ts)[None], cache=caches)
        return [c.keys[..., :c.offset, :] for c in caches], [c.values[..., :c.offset, :] for c in caches]

    parts = [ChunkKV(prefix, c, *prefill(prefix + c)) for c in chunks]
    full_k, full_v = prefill(tokens)
    for full_layers in (0, 2):
        composed = compose(model, parts, 1.0, full_layers=full_layers)
        assert composed.tokens == tokens and composed.recomputed == 100  # every token of the moved chunks
        for k, v, fk, fv in zip(composed.keys, composed.values, full_k, full_v):
            assert mx.allclose(k, fk, atol=1e-4, rtol=1e-4).item() and mx.allclose(v, fv, atol=1e-4, rtol=1e-4).item()
    for select in ("attention", "deviation", "product"):
        composed = compose(model, parts, 0.2, question=tokens[:8], select=select)
        assert composed.recomputed == round(0.2 * 144) and composed.reused == 144 - composed.recomputed
        # The first chunk sits where it was prefilled: its stored K/V stay in the layers after the full ones.
        assert all(mx.array_equal(k[:, :, :50], p[:, :, :50]).item() for k, p in zip(composed.keys[2:], parts[0].keys[2:]))
    with pytest.raises(BadInput, match="unknown recompute selection"):
        compose(model, parts, 0.2, select="random")
