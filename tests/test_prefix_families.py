"""Prefix reuse for the families whose layers were stored whole (issue 29): sliding windows
(RotatingKVCache), chunked attention (ChunkedKVCache), CacheLists (each member by its own kind:
token rows, window rows, recurrent states at block ends), and llama as the control.

Through the engine and a real store, on tiny random-weight folders (windows and chunks of 64
tokens, so that a 256-token block crosses several): save a long document, then a shorter one
that shares its first blocks and branches. The second save restores the shared blocks, and the
restored caches equal the engine's own prefill of that prefix (array_equal on every cache array
and on the next logits), raw.
"""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import mlx.core as mx
import pytest

import arch_configs
from model_folder import write_model_folder
from test_arch_all import cache_arrays
from test_blocks import through_format
from tqstore import Store
from tqstore.config import load_config
from tqstore.engine.engine import Engine
from tqstore.errors import BadInput
from tqstore.format.blocks import BLOCK_SIZE, join_blocks, split_snapshot
from turboquant import make_prompt_cache, restore, snapshot
from turboquant.adapter.checkpoints import StateCheckpoints
from turboquant.adapter.making import compress_caches
from turboquant.records import Layout, leaf_records
from turboquant.adapter.windows import from_rows, leaves, settle_all

VOCAB = 512  # the folder's tokenizer needs the byte alphabet and more
# Windows and attention chunks of 64 tokens (each family names the field its own way), so that a
# 256-token block crosses several.
# gemma4's per-layer embeddings take every token id (out of range they read undefined memory).
WINDOWS = dict(sliding_window=64, attention_chunk_size=64, attention_window_size=64, vocab_size_per_layer_input=VOCAB)
SLIDING = ("afmoe", "cohere2", "exaone_moe", "gemma3", "gemma3_text", "gemma3n", "gemma4", "gemma4_text",
           "gpt_oss", "iquestloopcoder", "mellum", "mimo_v2_flash", "muse_glimmer", "olmo3", "plamo3", "spark2_5",
           "step3p5")
CHUNKED = ("llama4",)
WINDOWS_AND_STATES = ("recurrent_gemma",)  # recurrent layers next to sliding ones
# CacheLists: attention next to an indexer's keys (deepseek_v32, glm_moe_dsa), two attentions per
# layer (longcat_flash, with an n-gram state beside them in longcat_flash_ngram), a list of one
# (minimax_m3_vl), a recurrent state next to attention (falcon_h1) and next to a window (baichuan_m1).
LISTS = ("baichuan_m1", "deepseek_v32", "falcon_h1", "glm_moe_dsa", "longcat_flash", "longcat_flash_ngram",
         "minimax_m3_vl")
# A model's own cache class (deepseek_v41's LayerCache: a window, compressed groups of 4 and of 3
# tokens with index keys, and the open group's rows; the generic tiny config compresses nothing).
FIELDS = ("deepseek_v41",)
FAMILIES = ("llama", *SLIDING, *CHUNKED, *WINDOWS_AND_STATES, *LISTS, *FIELDS)
EXTRA = {"deepseek_v41": dict(compress_ratios=[0, 4, 3, 4], kv_source_layer_ids=[1, 2], index_source_layer_ids=[1, 3],
                              index_n_heads=2, index_head_dim=16, index_topk=8)}
# Families whose tiny folder does not load (transformers' config validation refuses what
# mlx-lm's ModelArgs need): checked on the model object and the block split, without a store.
NO_FOLDER = {"exaone4": "transformers reads sliding_window_pattern 'LG' as a number",
             "gear": "transformers refuses layer type 'conv_mixer'"}


def _folder(family: str, tmp_path_factory):
    config = arch_configs.config(family, vocab_size=VOCAB, **WINDOWS, **EXTRA.get(family, {}))
    model = arch_configs.build(family, vocab_size=VOCAB, **WINDOWS, **EXTRA.get(family, {}))
    return write_model_folder(tmp_path_factory.mktemp(family) / family, model=model, config=config)


# The default suite checks one family of each kind; `pytest -m slow` checks every family.
DEFAULT = ("llama", "gemma3_text", "gpt_oss", "llama4", "recurrent_gemma", "baichuan_m1", "deepseek_v32")


@pytest.fixture(scope="module", params=[f if f in DEFAULT else pytest.param(f, marks=pytest.mark.slow)
                                        for f in FAMILIES])
def folder(request, tmp_path_factory):
    return _folder(request.param, tmp_path_factory)


@pytest.fixture
def engine(tmp_path):
    store = Store.open(tmp_path / "home", config=load_config(tmp_path / "home"))
    yield Engine(store, prefill_chunk=192)  # chunks that do not divide the block
    store.close()


def _tokens(n: int, seed: int) -> list[int]:
    return mx.random.randint(3, VOCAB, (n,), key=mx.random.key(seed)).tolist()


def _assert_same_caches(expected, got) -> None:
    before, after = cache_arrays(expected), cache_arrays(got)
    assert [k for k, _ in after] == [k for k, _ in before]
    for (name, a), (_, b) in zip(before, after):
        assert a.shape == b.shape and mx.array_equal(a, b), f"{name} differs: {a.shape} vs {b.shape}"


def test_a_branching_document_reuses_the_shared_blocks(engine, folder):
    """The issue's experiment: a 990-token document, then a 588-token one that shares its first
    560 tokens and branches: the second save prefills only what follows the shared blocks."""
    loaded = engine.model(str(folder))
    document = _tokens(990, seed=1)
    engine.save_tokens("long", loaded, document, scheme="raw")
    branch = document[:560] + _tokens(28, seed=2)
    result = engine.save_tokens("branch", loaded, branch, scheme="raw")
    assert result.reused_tokens == 2 * BLOCK_SIZE


@pytest.mark.exact_blas
def test_a_restored_prefix_equals_a_prefill_of_it(engine, folder):
    """Restoring the first k blocks of a longer entry gives the caches the engine's prefill of
    those k blocks holds, and the next logits; continuing both gives the same again."""
    loaded = engine.model(str(folder))
    document = _tokens(3 * BLOCK_SIZE + 100, seed=3)
    engine.save_tokens("doc", loaded, document, scheme="raw")
    step = mx.array([[5]])
    for blocks in (1, 2, 3):
        shared = blocks * BLOCK_SIZE
        prompt = document[:shared + 20] + _tokens(50, seed=4)
        started = engine.start(loaded, "raw", prompt)
        assert started.matched == shared
        fresh = make_prompt_cache(loaded.model, "raw")
        # As the engine prefills what it saves: chunks also end at block ends when the caches
        # hold recurrent states (a scan's rounding depends on where its chunks end).
        engine.prefill(loaded, fresh, prompt[:shared], checkpoints=StateCheckpoints.for_caches(fresh, BLOCK_SIZE))
        _assert_same_caches(fresh, started.caches)
        assert mx.array_equal(loaded.model(step, cache=started.caches), loaded.model(step, cache=fresh))
        engine.prefill(loaded, fresh, prompt[shared:], at=shared)
        engine.prefill(loaded, started.caches, prompt[shared:], at=shared, checkpoints=started.checkpoints)
        _assert_same_caches(fresh, started.caches)
        assert mx.array_equal(loaded.model(step, cache=started.caches), loaded.model(step, cache=fresh))


@pytest.mark.exact_blas
@pytest.mark.parametrize("family", sorted(NO_FOLDER))
def test_blocks_restore_any_prefix_of_a_family_without_a_folder(engine, family):
    """The same check without a folder: the engine's prefill, the snapshot with the logged rows
    and states, its blocks joined at each boundary, against the engine's prefill of the prefix."""
    loaded = SimpleNamespace(model=arch_configs.build(family, vocab_size=VOCAB, **WINDOWS))
    document = _tokens(3 * BLOCK_SIZE + 100, seed=3)
    caches = make_prompt_cache(loaded.model, "raw")
    logged = StateCheckpoints.for_caches(caches, BLOCK_SIZE)
    engine.prefill(loaded, caches, document, checkpoints=logged)
    n = len(document)
    split = split_snapshot(snapshot(caches, tokens=n, checkpoints=logged.before(n), rows=logged.rows(n),
                                    windows="token"))
    assert split.reusable_as_prefix
    step = mx.array([[5]])
    for blocks in (1, 2, 3, 4):
        shared = min(blocks * BLOCK_SIZE, n)
        restored = restore(join_blocks(split, blocks))
        fresh = make_prompt_cache(loaded.model, "raw")
        engine.prefill(loaded, fresh, document[:shared], checkpoints=StateCheckpoints.for_caches(fresh, BLOCK_SIZE))
        _assert_same_caches(fresh, restored)
        assert mx.array_equal(loaded.model(step, cache=restored), loaded.model(step, cache=fresh))


@pytest.mark.parametrize("family", ["gemma3_text", "llama4"])
def test_a_settled_window_continues_like_the_one_it_was_settled_from(family):
    """What a restore rebuilds (the settled window) continues exactly like mlx-lm's own cache
    after a prefill in uneven chunks: the same logits for a chunk and for single steps, and the
    same arrays from the first update on."""
    model = arch_configs.build(family, vocab_size=VOCAB, **WINDOWS)
    tokens = _tokens(300, seed=5)
    natural, settled = make_prompt_cache(model, "raw"), make_prompt_cache(model, "raw")
    for caches in (natural, settled):
        for start, stop in ((0, 192), (192, 300)):
            mx.eval(model(mx.array(tokens[start:stop])[None], cache=caches))
    settle_all(settled)
    assert any(a.shape != b.shape for (_, a), (_, b) in zip(cache_arrays(natural), cache_arrays(settled)))
    for step in (mx.array(_tokens(40, seed=6))[None], mx.array([[7]]), mx.array([[8]])):
        assert mx.array_equal(model(step, cache=natural), model(step, cache=settled))
        _assert_same_caches(natural, settled)



@pytest.mark.parametrize("family", ["gemma3_text", "llama4", "recurrent_gemma", "baichuan_m1"])
def test_a_chat_answer_keeps_its_window_rows(engine, tmp_path_factory, family):
    """A chat child entry stores the window rows of its answer too (logged as it is generated;
    baichuan_m1: window members of CacheLists, next to recurrent members), so it shares its
    parent's blocks and a branch inside the answer reuses it by prefix. Before: storing the child
    conflicted with the parent's blocks (the child's windows were whole)."""
    loaded = engine.model(str(_folder(family, tmp_path_factory)))
    engine.save_tokens("doc", loaded, _tokens(2 * BLOCK_SIZE - 30, seed=7), scheme="raw")
    engine.chat_turn("doc", "Who pays?", "turn", max_tokens=60)
    tokens = list(engine.store.get("turn").tokens)
    assert len(tokens) > 2 * BLOCK_SIZE + 5, "the answer must cross a block end"
    snap, _ = engine.store.load("turn")
    windows = [r for _, r in leaf_records(snap.layers) if r.config.get("class") in ("RotatingKVCache", "ChunkedKVCache")]
    assert windows and all(r.layout is Layout.RAW and r.offset == len(tokens) for r in windows)
    started = engine.start(loaded, "raw", tokens[:2 * BLOCK_SIZE + 5])
    assert started.matched == 2 * BLOCK_SIZE
    whole = restore(snap)
    for (_, r), (_, restored) in zip(leaf_records(snap.layers), leaves(started.caches)):
        if r in windows:  # the window of the first 512 tokens out of the answer's logged rows
            expected = from_rows(replace(r, offset=2 * BLOCK_SIZE,
                                         arrays={k: a[..., :2 * BLOCK_SIZE, :] for k, a in r.arrays.items()}))
            _assert_same_caches([expected], [restored])
    assert len(whole) == len(started.caches)


def test_an_entry_can_keep_its_windows_whole(engine, tmp_path_factory):
    """windows="whole" stores the window alone (fewer bytes; what every entry did before), and
    the entry is then reused only whole; its blocks never share a key with an entry that keeps
    its windows by token, and an engine of either mode answers from both."""
    loaded = engine.model(str(_folder("gemma3_text", tmp_path_factory)))
    document = _tokens(990, seed=1)
    whole = engine.save_tokens("whole", loaded, document, scheme="raw", windows="whole")
    by_token = engine.save_tokens("token", loaded, document[:-1] + [7], scheme="raw")
    assert by_token.reused_tokens == 0 and whole.bytes_written < by_token.bytes_written
    assert engine.store.get("whole").sliding and not engine.store.get("token").sliding
    branch = engine.save_tokens("branch", loaded, document[:600], scheme="raw", windows="whole")
    assert branch.reused_tokens == 0  # a whole entry is not cut
    for name in ("whole", "token"):
        answer = engine.ask(name, "Who pays?", max_tokens=2)
        assert answer.cached_tokens == len(engine.store.get(name).tokens)
    with pytest.raises(BadInput, match="windows must be one of token, whole"):
        engine.save_tokens("bad", loaded, document, scheme="raw", windows="rows")


@pytest.mark.parametrize("family", ["deepseek_v32", pytest.param("falcon_h1", marks=pytest.mark.slow)])
def test_generation_restores_the_shared_blocks_of_a_list_family(engine, tmp_path_factory, family):
    """What `tqstore serve` does with a prompt (Engine.generation: the longest stored prefix, then
    the rest) restores the blocks a CacheList family's prompt shares with a stored entry, and
    answers as a cold run does; `ask` on the entry itself restores all of it."""
    loaded = engine.model(str(_folder(family, tmp_path_factory)))
    document = _tokens(2 * BLOCK_SIZE + 40, seed=8)
    engine.save_tokens("doc", loaded, document, scheme="raw")
    prompt = document[:BLOCK_SIZE + 30] + _tokens(20, seed=9)
    warm = engine.generate(loaded, "raw", prompt, max_tokens=4)
    assert warm.cached_tokens == BLOCK_SIZE
    home = tmp_path_factory.mktemp("cold")
    cold_store = Store.open(home, config=load_config(home))
    try:
        cold = Engine(cold_store, prefill_chunk=192).generate(loaded, "raw", prompt, max_tokens=4)
    finally:
        cold_store.close()
    assert cold.cached_tokens == 0 and cold.tokens == warm.tokens
    assert engine.ask("doc", "Who pays?", max_tokens=2).cached_tokens == len(document)


@pytest.mark.parametrize("family", ["baichuan_m1", "deepseek_v41"])
def test_under_a_compressed_scheme_a_restore_gives_the_saved_caches(engine, family):
    """Under turbo4 (list members and a model's own cache class stay native): the blocks, written
    and read through the format, join into exactly the caches that were saved, and a prefix of
    them into the caches of the engine's turbo4 prefill of that prefix."""
    model = arch_configs.build(family, vocab_size=VOCAB, **WINDOWS, **EXTRA.get(family, {}))
    loaded = SimpleNamespace(model=model)
    document = _tokens(2 * BLOCK_SIZE + 40, seed=10)
    caches = make_prompt_cache(model, "turbo4")
    logged = StateCheckpoints.for_caches(caches, BLOCK_SIZE)
    engine.prefill(loaded, caches, document, checkpoints=logged)
    compress_caches(caches)
    n = len(document)
    split = split_snapshot(snapshot(caches, tokens=n, checkpoints=logged.before(n), rows=logged.rows(n),
                                    windows="token"))
    assert split.reusable_as_prefix
    read = through_format(split, document)
    _assert_same_caches(caches, restore(join_blocks(read)))
    fresh = make_prompt_cache(model, "turbo4")
    engine.prefill(loaded, fresh, document[:BLOCK_SIZE], checkpoints=StateCheckpoints.for_caches(fresh, BLOCK_SIZE))
    compress_caches(fresh)
    _assert_same_caches(fresh, restore(join_blocks(read, 1)))


def test_a_list_entry_kept_whole_stays_readable(engine, tmp_path_factory):
    """windows="whole" keeps CacheLists whole, as every entry of these families was stored before
    (same codec digest): such an entry is reused only whole, never shares a block key with a
    by-member entry of the same tokens, and `ask` answers from both."""
    loaded = engine.model(str(_folder("deepseek_v32", tmp_path_factory)))
    document = _tokens(600, seed=11)
    engine.save_tokens("whole", loaded, document, scheme="raw", windows="whole")
    by_member = engine.save_tokens("members", loaded, document, scheme="raw")
    assert by_member.reused_tokens == 0
    assert engine.store.get("whole").sliding and not engine.store.get("members").sliding
    assert engine.save_tokens("branch", loaded, document[:520], scheme="raw", windows="whole").reused_tokens == 0
    assert engine.save_tokens("branch2", loaded, document[:520], scheme="raw").reused_tokens == 2 * BLOCK_SIZE
    for name in ("whole", "members"):
        assert engine.ask(name, "Who pays?", max_tokens=2).cached_tokens == len(engine.store.get(name).tokens)


def test_caches_that_cannot_drop_tokens_for_their_recurrent_states_say_so(engine):
    """Before: every such refusal blamed "a full sliding window", also for hybrid models, whose
    prompts the server then never stored for reasons its log misnamed."""
    model = arch_configs.build("falcon_h1", vocab_size=VOCAB, **WINDOWS)
    caches = make_prompt_cache(model, "raw")
    tokens = _tokens(40, seed=1)
    model(mx.array(tokens)[None], cache=caches)
    with pytest.raises(BadInput, match=r"cannot drop their last 8 tokens \(recurrent states\)"):
        engine.store_caches("x", SimpleNamespace(model=model), "raw", caches, tokens[:32], prefill_seconds=0.0)


def test_a_raw_entry_with_recurrent_states_is_refused_for_mlx_lm_with_the_bundle_as_the_way(
        engine, tmp_path_factory, tmp_path):
    """Before: "re-save it with --scheme raw" for an entry saved raw, a loop with no way out."""
    from tqstore.errors import UnsupportedCache
    from tqstore.exchange.portable import export_mlx_lm

    folder = _folder("recurrent_gemma", tmp_path_factory)
    loaded = engine.model(str(folder))
    engine.save_tokens("doc", loaded, _tokens(300, seed=4), scheme="raw")
    with pytest.raises(UnsupportedCache, match=r"recurrent state \(ArraysCache\).*tqstore export doc FILE\.tqb") as exc:
        export_mlx_lm(engine.store, "doc", tmp_path / "doc.safetensors")
    assert "re-save" not in str(exc.value) and not (tmp_path / "doc.safetensors").exists()


@pytest.mark.parametrize("family", ["recurrent_gemma", "falcon_h1"])
def test_a_prompt_answered_into_recurrent_states_stores_its_last_kept_block_end(engine, tmp_path_factory, family):
    """What the server's autosave does after an answer: before, caches with recurrent states
    could not drop the answer's tokens, so no prompt of such a model was ever stored (every
    repeat recomputed it). Now the prompt is stored up to the last block end at which the
    prefill kept the states, and restores as a prefill of those tokens does."""
    folder = _folder(family, tmp_path_factory)
    loaded = engine.model(str(folder))
    prompt = _tokens(2 * BLOCK_SIZE + 90, seed=6)
    starts = []
    _, caches = engine.generate_with_caches(loaded, "raw", prompt, max_tokens=3, on_start=starts.append)
    stored = prompt[:-1]
    n = engine.storable_tokens(caches, len(stored), starts[0].checkpoints)
    assert n == 2 * BLOCK_SIZE
    # As the server's autosave passes them: already cut to that block end, while the caches'
    # live states are past the answer (the entry must take the kept ones all the same).
    engine.store_caches("auto", loaded, "raw", caches, stored[:n], prefill_seconds=1.0,
                        checkpoints=starts[0].checkpoints)
    assert list(engine.store.get("auto").tokens) == prompt[:2 * BLOCK_SIZE]
    again = engine.start(loaded, "raw", prompt)
    assert again.matched == 2 * BLOCK_SIZE
    fresh = make_prompt_cache(loaded.model, "raw")
    engine.prefill(loaded, fresh, prompt[:2 * BLOCK_SIZE], checkpoints=StateCheckpoints.for_caches(fresh, BLOCK_SIZE))
    _assert_same_caches(fresh, again.caches)
    step = mx.array([[5]])
    assert mx.array_equal(loaded.model(step, cache=again.caches), loaded.model(step, cache=fresh))


def test_the_server_stores_a_hybrid_model_s_prompts_and_answers_the_same_from_them(tmp_path_factory, tmp_path):
    """Before: every autosave of a model with recurrent states was refused (its states hold the
    answer), so a repeated prompt was always recomputed. Through the server's worker, the second
    identical request now restores the prompt's first blocks and answers as the first did."""
    from test_server_batch import Collect
    from tqstore.serve.autosave import SavePolicy
    from tqstore.serve.metrics import Metrics
    from tqstore.serve.openai_schema import GenerationRequest, Sampling
    from tqstore.serve.worker import ModelWorker

    folder = _folder("falcon_h1", tmp_path_factory)
    engine = Engine.open(tmp_path / "home")
    worker = ModelWorker(engine, str(folder), scheme="raw", policy=SavePolicy(min_tokens=256), metrics=Metrics())
    prompt = " ".join(f"w{i % 37}" for i in range(300))
    request = GenerationRequest(chat=False, model=None, sampling=Sampling(8, 0.0, 1.0, None, ()), stream=True,
                                include_usage=False, prompt=prompt)
    worker.start()
    try:
        answers = []
        for _ in range(2):
            sink = Collect()
            worker.generate(request, sink)
            assert sink.done.wait(120)
            answers.append(sink.events[-1].value)
            worker.writer.wait_for(engine.model(str(folder)).tokenizer.encode(prompt))
    finally:
        worker.stop()
    first, second = answers
    assert first.prompt_tokens > 2 * BLOCK_SIZE and first.cached_tokens == 0
    assert second.cached_tokens == first.prompt_tokens // BLOCK_SIZE * BLOCK_SIZE
    assert second.text == first.text


def test_an_at_rest_entry_s_receipt_measures_its_compression(engine, tmp_path_factory):
    """What the user reads in `tqstore info`: before, every at-rest entry (gemma2, the MLA
    families) showed KL 0 and top-1 1.0, its reference being the entry itself."""
    from tqstore.engine.receipts import Receipt

    loaded = engine.model(str(_folder("gemma2", tmp_path_factory)))
    engine.save_tokens("doc", loaded, _tokens(300, seed=8), scheme="turbo5v4")
    receipt = Receipt.from_metadata(engine.store.get("doc").metadata)
    assert receipt is not None and receipt.kl > 0
