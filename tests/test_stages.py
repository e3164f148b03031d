"""A model's TurboQuant layers compressed in lockstep (`Context.compress`, turboquant/codec/stages.py):
the same bytes as each layer compressed on its own, with one evaluation per decision for all
the layers instead of several per layer (on a GPU each one waited for the device)."""

import mlx.core as mx
import pytest

from kv_data import kv_rows
from model_folder import write_model_folder
from tqstore.engine.engine import Engine
from turboquant import Context, make_prompt_cache, parse_scheme
from turboquant.adapter.snapshots import snapshot
from turboquant.cache.compressed import TurboQuantKVCache
from turboquant.codec import stages
from turboquant.codec.plan import plan_layer

LAYERS = 6


def _layers(scheme: str, tokens: int) -> list[TurboQuantKVCache]:
    """Prefilled layers, each with its own keys and observed queries; the queries of the odd
    layers are loud enough for the guard to protect them (affine8 keys)."""
    caches = []
    for layer in range(LAYERS):
        cache = TurboQuantKVCache(plan_layer(parse_scheme(scheme), 2, 64, 64, mx.float32, guard=3.6))
        k, v = kv_rows(1, 2, tokens, 64, seed=layer)
        cache.update_and_fetch(k, v)
        gain = 100.0 if layer % 2 else 0.01
        cache.observe_queries(mx.random.normal((1, 4, tokens, 64), key=mx.random.key(layer)) * gain, scale=0.125)
        caches.append(cache)
    return caches


def _counting_evals(monkeypatch) -> list[int]:
    calls = []
    real = stages.mx.eval
    monkeypatch.setattr(stages.mx, "eval", lambda *a: calls.append(1) or real(*a))
    return calls


@pytest.mark.parametrize("scheme, tokens", [("turbo4", 300), ("turbo5v4", 300), ("turbo4", 20)])
def test_layers_compressed_in_lockstep_store_what_each_stores_alone(monkeypatch, scheme, tokens):
    alone = _layers(scheme, tokens)
    together = _layers(scheme, tokens)
    for cache in alone:
        cache.compress()
    calls = _counting_evals(monkeypatch)
    Context(together, "whole", 256, None).compress()
    # a calibration's two flatness checks and its scales, the guard's verdict, a protected
    # layer's refit (two more), the encoded rows: at most 7 evaluations for any number of layers
    assert 1 <= len(calls) <= 7
    if tokens >= 32:
        assert {c.guarded for c in together} == {True, False}
    a, b = snapshot(alone), snapshot(together)
    for ra, rb in zip(a.layers, b.layers):
        assert (ra.layout, ra.offset, ra.state) == (rb.layout, rb.offset, rb.state)
        for part in ("arrays", "calibration"):
            x, y = getattr(ra, part), getattr(rb, part)
            assert set(x) == set(y)
            assert all(mx.array_equal(x[n], y[n]).item() for n in x), part


def test_each_layer_alone_evaluates_at_every_decision(monkeypatch):
    calls = _counting_evals(monkeypatch)
    (cache,) = _layers("turbo4", 300)[:1]
    cache.compress()
    assert len(calls) >= 3  # what lockstep spares: this many per layer


@pytest.mark.parametrize("scheme", ["auto4", "turbo5v4"])
def test_a_models_layers_compressed_in_lockstep_match_one_by_one(tmp_path, scheme):
    """Through a tiny llama's own caches: autoB's allocation (decided for every layer by the
    first one to compress) and the guard give the same layouts and bytes either way."""
    loaded = Engine.open(tmp_path / "home").model(str(write_model_folder(tmp_path / "m", kind="llama")))
    tokens = loaded.tokenizer.encode("The contract says the seller pays for every delay. " * 30)[:300]
    snaps = []
    for lockstep in (False, True):
        caches = make_prompt_cache(loaded.model, scheme)
        loaded.model(mx.array(tokens)[None], cache=caches)
        mx.eval([c.state for c in caches])
        if lockstep:
            Context(caches, "whole", 256, None).compress()
        else:
            for cache in caches:
                cache.compress()
        snaps.append(snapshot(caches))
    for ra, rb in zip(*(s.layers for s in snaps)):
        assert (ra.layout, ra.state) == (rb.layout, rb.state)
        assert all(mx.array_equal(ra.arrays[n], rb.arrays[n]).item() for n in ra.arrays)
        assert all(mx.array_equal(ra.calibration[n], rb.calibration[n]).item() for n in ra.calibration)


def _same_records(a, b) -> None:
    for ra, rb in zip(snapshot(a).layers, snapshot(b).layers):
        assert (ra.layout, ra.offset, ra.state) == (rb.layout, rb.offset, rb.state)
        for part in ("arrays", "calibration"):
            x, y = getattr(ra, part), getattr(rb, part)
            assert set(x) == set(y)
            assert all(mx.array_equal(x[n], y[n]).item() for n in x), part


@pytest.mark.parametrize("scheme", ["turbo4", "turbo5v4", "turbo0v4"])
def test_a_prompt_compressed_in_pieces_stores_what_one_encoding_stores(scheme):
    """`starting(caches, rows)`, the server's compression of a new request: about `rows` rows
    per evaluation over all layers (here 256 per layer), the layers in lockstep, every cache
    whole at each step (the rows not yet encoded in its tail), and in the end the bytes of one
    encoding, block means included (1,000 rows: the last block partial)."""
    from turboquant.adapter.making import start_decoding, starting

    whole, pieces = _layers(scheme, 1000), _layers(scheme, 1000)
    start_decoding(whole)
    steps, seen = starting(pieces, rows=256 * LAYERS), []
    for _ in steps:
        for c in pieces:
            held = c._tail.view(c.offset - c.stored)["keys"].shape[2] if c.offset > c.stored else 0
            assert c.offset == 1000 and c.stored + held == 1000
        seen.append([c.stored for c in pieces])
    for i in range(LAYERS):  # (the guarded layers decide more, so they encode a step or more later)
        assert sorted({step[i] for step in seen} - {0}) == [256, 512, 768, 1000]
    assert len(seen) >= 4  # a step per piece at least (after the decisions of calibrated keys)
    assert all(c.compressed and c.stored == 1000 for c in pieces)
    _same_records(whole, pieces)


def test_rows_after_an_open_block_are_encoded_in_pieces_that_close_it_first():
    """A compressed layer whose last block was left open (300 rows stored) and 700 more rows in
    its tail: the first piece ends at a block boundary, so the open block is finished with its
    own mean, as one encoding does."""
    whole, pieces = _layers("turbo5v4", 300), _layers("turbo5v4", 300)
    more = kv_rows(1, 2, 700, 64, seed=9)
    for caches in (whole, pieces):
        for c in caches:
            c.compress()
            c.update_and_fetch(*more)
            assert c.stored == 300 and c.offset == 1000
    for c in whole:
        c.compress()
    stored = []
    for c in pieces:
        work = c.compressing(piece=256)
        for arrays in work:
            mx.eval(arrays)
            stored.append(c.stored)
    assert stored[:3] == [768, 1000, 768]  # 300 -> 768 (the open block, then one more), -> 1000
    _same_records(whole, pieces)


def test_a_piece_must_be_whole_blocks():
    (cache,) = _layers("turbo4", 300)[:1]
    with pytest.raises(ValueError, match="multiple of 256"):
        stages.run(cache.compressing(piece=100))


def test_stepping_yields_once_per_evaluation_and_fills_the_results():
    def work(n):
        for i in range(n):
            yield [mx.array(i)]
        return n * 10

    results = [None, None]
    assert len(list(stages.stepping([work(2), work(3)], results))) == 3
    assert results == [20, 30]
    assert stages.run_all([work(1), work(2)]) == [10, 20]
