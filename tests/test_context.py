"""`turboquant.Context`: a context's caches and what their prefill logs, opened fresh or from a
snapshot, and given back as a snapshot (the store's two ways into turboquant, with codec_snapshot)."""

from __future__ import annotations

import mlx.core as mx

import arch_configs
from turboquant import Context

BLOCK = 8


def _prefill(model, context: Context, tokens: list[int], at: int = 0, size: int = 5) -> list[int]:
    ends, done = [], at
    while done < at + len(tokens):
        end = context.chunk_end(done, at + len(tokens), size)
        model(mx.array(tokens[done - at:end - at])[None], cache=context.caches)
        context.prefilled(end)
        ends.append(end)
        done = end
    context.settle()
    return ends


def _same(a, b) -> bool:
    return [(r.layout, r.offset, dict(r.config), dict(r.state)) for r in a.layers] == \
        [(r.layout, r.offset, dict(r.config), dict(r.state)) for r in b.layers] and \
        all(x.dtype == y.dtype and mx.array_equal(x, y).item() for x, y in zip(a.arrays(), b.arrays()))


def test_a_snapshot_reopens_into_the_same_caches():
    model = arch_configs.build("llama", vocab_size=128)
    tokens = list(range(1, 40))
    context = Context.open(model, "turbo4", block=BLOCK)
    assert context.counts_tokens and context.tokens == 0
    _prefill(model, context, tokens)
    snap = context.snapshot(len(tokens))
    again = Context.open(model, "turbo4", block=BLOCK, restored=snap)
    assert again.tokens == len(tokens)
    assert _same(again.snapshot(len(tokens)), snap)


def test_recurrent_states_end_chunks_at_block_ends_and_are_kept_there():
    model = arch_configs.build("qwen3_5", vocab_size=128)
    tokens = list(range(1, 30))
    context = Context.open(model, "raw", block=BLOCK)
    ends = _prefill(model, context, tokens)
    assert ends == [5, 8, 13, 16, 21, 24, 29]  # chunks of 5 that also stop at every block end
    assert sorted(context.checkpoints.before(len(tokens))[next(iter(context.checkpoints.layers))]) == [8, 16, 24]
    # a prefix of it restored: the states kept at block ends come back with it, so a prefill
    # continuing from there stores them again
    prefix = context.snapshot(24, compress=False)
    reopened = Context.open(model, "raw", block=BLOCK, restored=prefix)
    assert sorted(next(iter(reopened.checkpoints.layers.values()))) == [8, 16, 24]  # its own end too


def test_copy_shares_nothing_it_could_change():
    model = arch_configs.build("llama", vocab_size=128)
    context = Context.open(model, "raw", block=BLOCK)
    _prefill(model, context, list(range(1, 20)))
    copy = context.copy()
    model(mx.array([[3, 4]]), cache=copy)
    assert context.tokens == 19 and copy[0].offset == 21


def test_start_decoding_compresses_a_block_defers_less_and_leaves_a_restored_question_raw():
    """Before the first decode step: a fresh prefill of a block (256 tokens) or more is
    compressed, every row stored; a shorter one decodes raw until a block is held and compresses
    at the update that finds it held, its calibration from the prefill's queries alone (the
    decode's never reach a batched row's cache); a restored context's question rows stay raw in
    the tail, as a decode step's rows do until their block fills (encoding them cost a restored
    entry's first token 12-26 ms on an H100)."""
    from turboquant import TurboQuantKVCache

    model = arch_configs.build("llama", vocab_size=128)
    long = Context.open(model, "turbo4", block=BLOCK)
    _prefill(model, long, [i % 120 + 1 for i in range(300)], size=64)
    long.start_decoding()
    layers = [c for c in long.caches if isinstance(c, TurboQuantKVCache)]
    assert layers and all(c.compressed and c.stored == c.offset == 300 for c in layers)

    tokens = list(range(1, 40))
    fresh = Context.open(model, "turbo4", block=BLOCK)
    _prefill(model, fresh, tokens)
    fresh.start_decoding()
    layers = [c for c in fresh.caches if isinstance(c, TurboQuantKVCache)]
    power = [(c._query_power, c._query_rows) for c in layers]
    assert all(not c.compressed and c.offset == len(tokens) for c in layers)
    for t in range(256 - len(tokens)):
        model(mx.array([[t % 120 + 1]]), cache=fresh.caches)
    assert all(not c.compressed and c.offset == 256 for c in layers)
    assert all(c._query_rows == rows and mx.array_equal(c._query_power, p) for c, (p, rows) in zip(layers, power))
    model(mx.array([[7]]), cache=fresh.caches)
    assert all(c.compressed and c.stored == 256 and c.offset == 257 for c in layers)

    prefix = Context.open(model, "turbo4", block=BLOCK)
    _prefill(model, prefix, tokens)
    restored = Context.open(model, "turbo4", block=BLOCK, restored=prefix.snapshot(len(tokens)))
    model(mx.array([[50, 51, 52]]), cache=restored.caches)
    restored.start_decoding()
    layers = [c for c in restored.caches if isinstance(c, TurboQuantKVCache)]
    assert all(c.stored == len(tokens) and c.offset == len(tokens) + 3 for c in layers)
