"""Prefix reuse for hybrid models (issue 18, item 3): a stored entry of a model with recurrent
layers is reused at block granularity, exactly.

Through the engine and a real store: save an entry, ask for a prompt that shares only its first
k blocks, restore those (the recurrent states stored at the k-th block end), prefill the rest;
every cache array and the next logits equal a never-saved prefill of the whole prompt.
"""

from __future__ import annotations

import mlx.core as mx
import pytest

import arch_configs
from model_folder import write_model_folder
from test_arch_all import cache_arrays
from tqstore import Store
from tqstore.format import objects as fmt
from tqstore.format.blocks import BLOCK_SIZE, split_snapshot
from tqstore.config import load_config
from tqstore.engine.engine import Engine
from turboquant import make_prompt_cache
from turboquant.adapter.checkpoints import StateCheckpoints
from turboquant.records import Layout, state_boundaries

HYBRIDS = ("qwen3_5", "lfm2", "nemotron_h")
VOCAB = 512  # the folder's tokenizer needs the byte alphabet and more


@pytest.fixture(scope="module", params=HYBRIDS)
def folder(request, tmp_path_factory):
    family = request.param
    config = arch_configs.config(family, vocab_size=VOCAB)
    model = arch_configs.build(family, vocab_size=VOCAB)
    return write_model_folder(tmp_path_factory.mktemp(family) / family, model=model, config=config)


@pytest.fixture
def engine(tmp_path):
    store = Store.open(tmp_path / "home", config=load_config(tmp_path / "home"))
    yield Engine(store, prefill_chunk=192)  # chunks that do not divide the block: ends are cut at blocks
    store.close()


def _tokens(n: int, seed: int) -> list[int]:
    return mx.random.randint(3, VOCAB, (n,), key=mx.random.key(seed)).tolist()


@pytest.mark.parametrize("shared", [BLOCK_SIZE + 40, 2 * BLOCK_SIZE + 7])
def test_restore_at_a_block_boundary_then_continue_is_exact(engine, folder, shared):
    loaded = engine.model(str(folder))
    document = _tokens(2 * BLOCK_SIZE + 100, seed=1)
    engine.save_tokens("doc", loaded, document, scheme="raw")
    prompt = document[:shared] + _tokens(60, seed=2)
    started = engine.start(loaded, "raw", prompt)
    assert started.matched == shared // BLOCK_SIZE * BLOCK_SIZE
    engine.prefill(loaded, started.caches, prompt[started.matched:], at=started.matched,
                   checkpoints=started.checkpoints)
    fresh = make_prompt_cache(loaded.model, "raw")
    engine.prefill(loaded, fresh, prompt, checkpoints=StateCheckpoints(BLOCK_SIZE))
    before, after = cache_arrays(fresh), cache_arrays(started.caches)
    assert [k for k, _ in after] == [k for k, _ in before]
    for (name, a), (_, b) in zip(before, after):
        assert mx.array_equal(a, b), f"{name} differs"
    step = mx.array([[5]])
    assert mx.array_equal(loaded.model(step, cache=started.caches), loaded.model(step, cache=fresh))


def test_a_loaded_entry_keeps_its_block_checkpoints_as_one_object(engine, folder):
    """A whole entry read back (and written as one snapshot object, as bundles do) still holds
    the recurrent state of every block end, so that storing it again keeps prefix reuse."""
    loaded = engine.model(str(folder))
    engine.save_tokens("doc", loaded, _tokens(2 * BLOCK_SIZE + 10, seed=3), scheme="raw")
    snap, _ = engine.store.load("doc")
    again = fmt.loads(fmt.dumps(snap), expect=fmt.Expect(kind="snapshot"))
    states = [r for r in again.layers if r.layout is Layout.STATE]
    assert states and all(state_boundaries(r) == [BLOCK_SIZE, 2 * BLOCK_SIZE] for r in states)
    assert split_snapshot(again).reusable_as_prefix


def test_a_chat_turn_of_a_hybrid_keeps_the_checkpoints_of_its_prompt(engine, folder):
    """A chat child entry stores the recurrent states at the block ends its prompt's prefill
    passed, so the next turn reuses it by prefix when the answer crosses no block end."""
    loaded = engine.model(str(folder))
    text = " ".join(["The contract says the seller pays for delays."] * 60)
    engine.save("doc", text, model=str(folder), scheme="raw")
    engine.chat_turn("doc", "Who pays?", "turn1", max_tokens=2)
    tokens = engine.store.get("turn1").tokens
    snap, _ = engine.store.load("turn1")
    ends = list(range(BLOCK_SIZE, len(tokens), BLOCK_SIZE))
    states = [r for r in snap.layers if r.layout is Layout.STATE]
    assert ends and states and all(state_boundaries(r) == ends for r in states), (len(tokens), ends)
    assert split_snapshot(snap).reusable_as_prefix
    started = engine.start(loaded, "raw", list(tokens[:ends[-1] + 5]))
    assert started.matched == ends[-1]
