import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache

from model_folder import write_model_folder
from tqstore import Store
from tqstore.config import load_config
from tqstore.engine.engine import Engine
from tqstore.errors import BadInput, IdentityMismatch, NotFound
from turboquant import TurboQuantKVCache, make_prompt_cache, snapshot

DOCUMENT = ("The contract says the seller pays for delays. Clause seven covers delivery, payment and "
            "penalties. ") * 12


# Four of tiny-qwen2's eight layers: what these tests check does not count layers (the fragile
# schemes' boundary rule still marks one at each end and leaves two), and prefills cost per layer.
LAYERS = 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_model_folder(tmp_path_factory.mktemp("model") / "tiny-qwen2", kind="qwen2", num_hidden_layers=LAYERS)


@pytest.fixture(scope="module")
def loaded_model(model_dir, tmp_path_factory):
    """The tiny model loaded once for the module (and checked once per scheme: the plan check is
    kept per model object); each test's engine takes it as another engine's (`use_model`)."""
    home = tmp_path_factory.mktemp("loader") / "home"
    with Store.open(home, config=load_config(home)) as store:
        return Engine(store).model(str(model_dir))


@pytest.fixture
def engine(tmp_path, loaded_model):
    store = Store.open(tmp_path / "home", config=load_config(tmp_path / "home"))
    engine = Engine(store, prefill_chunk=64)
    engine.use_model(loaded_model)
    yield engine
    store.close()


def _reference_caches(engine, loaded, scheme, tokens):
    """An in-memory run that compresses at the same point as save (same prefill chunks)."""
    caches = make_prompt_cache(loaded.model, scheme)
    engine.prefill(loaded, caches, tokens)
    for c in caches:
        if isinstance(c, TurboQuantKVCache):
            c.compress()
    return caches


# One scheme per layout family by default; turbo8v3 (turbo4's layout at other widths) with -m slow.
@pytest.mark.parametrize("scheme", ["turbo4", pytest.param("turbo8v3", marks=pytest.mark.slow), "turbo0v4", "raw",
                                    "auto5", "turbo5v4"])
def test_save_then_ask_decodes_exactly_like_an_in_memory_run(engine, model_dir, scheme):
    saved = engine.save("doc", DOCUMENT, model=str(model_dir), scheme=scheme)
    loaded = engine.model(str(model_dir))
    tokens = engine.store.get("doc").tokens
    assert saved.tokens == len(tokens) and saved.reused_tokens == 0
    question = loaded.prompt.question_tokens(loaded.tokenizer, "Who pays for delays?")
    prompt = list(tokens) + question
    started = engine.start(loaded, scheme, prompt[:-1])
    assert started.matched == len(tokens) and started.tier in ("memory", "lmdb")
    reference = _reference_caches(engine, loaded, scheme, tokens)
    if scheme == "raw":
        assert all(type(c) is KVCache for c in reference)
    q = mx.array(question)[None]
    assert mx.array_equal(loaded.model(q, cache=started.caches), loaded.model(q, cache=reference)).item()
    answer = engine.ask("doc", "Who pays for delays?", max_tokens=6)
    assert answer.cached_tokens == len(tokens) and answer.prompt_tokens == len(prompt)
    assert answer.tier in ("memory", "lmdb") and len(answer.tokens) == 6
    assert answer.recorded_prefill_seconds == pytest.approx(engine.store.get("doc").prefill_seconds)


def test_resave_with_a_shared_prefix_prefills_only_the_new_part(engine, model_dir):
    base = engine.save("base", DOCUMENT * 3, model=str(model_dir))
    assert base.tokens > 512
    longer = engine.save("longer", DOCUMENT * 3 + " Extra terms follow here. " * 20, model=str(model_dir))
    # The whole stored entry is a prefix: restored, and its full blocks shared.
    assert longer.reused_tokens == base.tokens and longer.reused_blocks == base.tokens // 256
    assert longer.tokens > longer.reused_tokens
    # The whole context's cost: the stored prefix's recorded seconds plus this save's own prefill
    # (it was the new tokens' seconds scaled up to every token, 20x too much for a short tail).
    assert longer.recorded_prefill_seconds == pytest.approx(base.recorded_prefill_seconds + longer.prefill_seconds)
    assert engine.store.get("longer").prefill_seconds == pytest.approx(longer.recorded_prefill_seconds)


def test_ask_refuses_another_model(engine, model_dir, tmp_path):
    engine.save("doc", DOCUMENT, model=str(model_dir))
    other = write_model_folder(tmp_path / "other", kind="qwen2", seed=5, num_hidden_layers=LAYERS)
    with pytest.raises(IdentityMismatch, match="weights"):
        engine.ask("doc", "Who pays?", model=str(other), max_tokens=2)


def test_a_moved_model_is_found_through_the_registry_or_named(engine, model_dir, tmp_path):
    import shutil

    moved = tmp_path / "moved"
    shutil.copytree(model_dir, moved)
    engine.save("doc", DOCUMENT, model=str(moved))
    fresh = Engine(engine.store)
    assert fresh.model_for("doc").path == moved.resolve()  # recorded path
    shutil.rmtree(moved)
    fresh = Engine(engine.store)
    with pytest.raises(NotFound, match="pass --model"):
        fresh.model_for("doc")
    fresh.model(str(model_dir))  # registering the same weights elsewhere makes it findable again
    assert Engine(engine.store).model_for("doc").path == model_dir.resolve()


def test_chat_turns_are_child_entries_sharing_blocks(engine, model_dir):
    engine.save("doc", DOCUMENT * 3, model=str(model_dir))
    first = engine.chat_turn("doc", "Who pays for delays?", "doc.chat-1", max_tokens=4)
    second = engine.chat_turn("doc.chat-1", "And clause seven?", "doc.chat-2", max_tokens=4)
    parent, child = engine.store.get("doc"), engine.store.get("doc.chat-2")
    assert child.tokens[: len(parent.tokens)] == parent.tokens
    shared = set(ref.key for ref in parent.blocks[:-1]) & set(ref.key for ref in child.blocks)
    assert len(shared) == len(parent.blocks) - 1 >= 1
    assert first.cached_tokens >= len(parent.tokens) - 1
    assert second.cached_tokens >= len(engine.store.get("doc.chat-1").tokens) - 1
    assert child.metadata["chat.parent"] == "doc.chat-1"


def test_prompt_cache_api_gives_mlx_lm_ready_caches(engine, model_dir):
    from mlx_lm import stream_generate

    engine.save("doc", DOCUMENT, model=str(model_dir))
    caches, tokens, loaded = engine.prompt_cache("doc")
    assert caches[0].offset == len(tokens)
    question = loaded.prompt.question_tokens(loaded.tokenizer, "Who pays?")
    out = [r.token for r in stream_generate(loaded.model, loaded.tokenizer, question, max_tokens=3,
                                            prompt_cache=caches)]
    assert len(out) == 3


def test_empty_document_is_refused(engine, model_dir):
    with pytest.raises(BadInput, match="empty"):
        engine.save("doc", "  \n", model=str(model_dir))


def test_no_tokens_and_bad_sampling_options_are_bad_input(engine, model_dir):
    """Before: an entry of 0 tokens was stored (a tokenizer that encodes everything to nothing),
    and asking it, or an empty prompt, failed inside MLX's gather; max_tokens=-1 generated without
    end and a NaN temperature always gave the last token id."""
    loaded = engine.model(str(model_dir))
    with pytest.raises(BadInput, match="no tokens"):
        engine.save_tokens("empty", loaded, [])
    with pytest.raises(BadInput, match="no tokens"):
        engine.generate(loaded, "raw", [], max_tokens=2)
    assert engine.store.ls() == []
    engine.save("doc", DOCUMENT, model=str(model_dir), scheme="raw")
    for bad, match in (({"max_tokens": -1}, "max_tokens"), ({"max_tokens": 2.5}, "max_tokens"),
                       ({"temp": float("nan")}, "temp"), ({"temp": -1.0}, "temp"), ({"top_p": 2.0}, "top_p")):
        with pytest.raises(BadInput, match=match):
            engine.ask("doc", "Who pays?", **bad)


def test_an_unknown_scheme_is_bad_input(engine, model_dir):
    """Before: a plain ValueError from the codec, which callers catching TqstoreError missed."""
    with pytest.raises(BadInput, match="turbo9"):
        engine.save("doc", DOCUMENT, model=str(model_dir), scheme="turbo9")
    with pytest.raises(BadInput, match="turbo9"):
        engine.add_chunk(None, DOCUMENT, model=str(model_dir), scheme="turbo9")
    assert engine.store.ls() == []


def test_store_caches_trims_the_answer_off(engine, model_dir):
    engine.save("doc", DOCUMENT, model=str(model_dir))
    loaded = engine.model(str(model_dir))
    prompt = list(engine.store.get("doc").tokens) + loaded.prompt.question_tokens(loaded.tokenizer, "Who pays?")
    result, caches = engine.generate_with_caches(loaded, "turbo4", prompt, max_tokens=5)
    assert caches[0].offset == len(prompt) + 5
    # All but the last prompt token: the next identical request must run one token for logits.
    engine.store_caches("prompt-only", loaded, "turbo4", caches, prompt[:-1], prefill_seconds=1.0, ttl=60)
    stored = engine.store.get("prompt-only")
    assert list(stored.tokens) == prompt[:-1] and stored.expires is not None
    again = engine.generate(loaded, "turbo4", prompt, max_tokens=5)
    assert again.cached_tokens == len(prompt) - 1 and again.tokens == result.tokens


def test_store_caches_through_a_background_writer(engine, model_dir):
    from tqstore.engine.background import BackgroundWriter

    loaded = engine.model(str(model_dir))
    prompt = loaded.tokenizer.encode(DOCUMENT)[:300]
    result, caches = engine.generate_with_caches(loaded, "turbo4", prompt, max_tokens=3)
    writer = BackgroundWriter()
    try:
        future = engine.store_caches("bg", loaded, "turbo4", caches, prompt[:-1], prefill_seconds=1.0, writer=writer)
        assert writer.wait_for(prompt, timeout=60) and future.result().name == "bg"
    finally:
        writer.close(60)
    again = engine.generate(loaded, "turbo4", prompt, max_tokens=3)
    assert again.cached_tokens == len(prompt) - 1 and again.tokens == result.tokens


def test_resaving_a_stored_context_keeps_its_recorded_prefill_time(engine, model_dir):
    first = engine.save("doc", DOCUMENT, model=str(model_dir))
    again = engine.save("doc-copy", DOCUMENT, model=str(model_dir))
    assert again.reused_tokens == again.tokens and again.prefill_seconds < first.prefill_seconds
    assert engine.store.get("doc-copy").prefill_seconds == pytest.approx(first.recorded_prefill_seconds)


def test_started_takes_no_token_count_its_caches_contradict():
    """Issue 27: a count that is not what the caches hold (a lookup's, after a shorter restore)
    would prefill the prompt's rest after a hole; Started refuses it."""
    from tqstore.engine.prefill import Started
    from tqstore.errors import CorruptBlock

    caches = [KVCache(), KVCache()]
    for c in caches:
        c.update_and_fetch(mx.zeros((1, 2, 256, 8)), mx.zeros((1, 2, 256, 8)))
    assert Started(caches, 256, "lmdb", 0.0).matched == 256
    with pytest.raises(CorruptBlock, match="hold 256 tokens, not the 565"):
        Started(caches, 565, "lmdb", 0.0)
    with pytest.raises(CorruptBlock, match="hold 0 tokens, not the 3"):
        Started([KVCache()], 3, "none", 0.0)


def test_an_answers_last_prompt_chunk_is_queued_and_the_answer_unchanged(engine, model_dir, monkeypatch):
    """The prompt's last prefill chunk before its last token is queued (`mx.async_eval`), so the
    first token's step is built while the device runs it; earlier chunks, and a save's, are
    waited for. The tokens are those of a run that waits for every chunk."""
    from tqstore.engine import prefill as prefill_module

    loaded = engine.model(str(model_dir))
    prompt = loaded.tokenizer.encode(DOCUMENT)[:150]
    waited = engine.generate(loaded, "turbo4", prompt, max_tokens=4)
    calls = []

    class Recorded:
        """The prefill module's `mx`, its evaluations recorded."""

        def __getattr__(self, name):
            return getattr(mx, name)

        def eval(self, *a):
            calls.append("eval")
            return mx.eval(*a)

        def async_eval(self, *a):
            calls.append("async")
            return mx.async_eval(*a)

    monkeypatch.setattr(prefill_module, "mx", Recorded())
    queued = engine.generate(loaded, "turbo4", prompt, max_tokens=4)
    assert calls == ["eval", "eval", "async"]  # 149 tokens in chunks of 64
    assert queued.tokens == waited.tokens and mx.array_equal(queued.first_logprobs, waited.first_logprobs).item()
    calls.clear()
    engine.save("doc", DOCUMENT, model=str(model_dir), scheme="turbo4")
    assert calls and "async" not in calls


def test_an_autosaved_prompt_records_what_computing_it_cost(engine, model_dir):
    """The server's autosave records what computing the prompt cost: its prefill and the step
    of its last token, which also waits for the prefill's last chunk now that it is queued (the
    prefill seconds alone would leave that chunk's device time out)."""
    from tqstore.engine.background import BackgroundWriter
    from tqstore.serve.autosave import SavePolicy, autosave
    from tqstore.serve.metrics import Metrics

    loaded = engine.model(str(model_dir))
    prompt = loaded.tokenizer.encode(DOCUMENT)[:300]
    result, caches = engine.generate_with_caches(loaded, "turbo4", prompt, max_tokens=2)
    writer = BackgroundWriter()
    try:
        autosave(engine, SavePolicy(min_tokens=64), Metrics(), writer, loaded, "turbo4", prompt, result, caches)
        assert writer.wait_for(prompt, timeout=60)
    finally:
        writer.close(60)
    spent = result.first_token_seconds - result.restore_seconds
    assert spent > result.prefill_seconds > 0
    stored = engine.store.get(SavePolicy.name_for(loaded.identity.digest, "turbo4", prompt[:-1]))
    assert stored.prefill_seconds == pytest.approx(spent)

    # A longer prompt over that stored prefix: the prefix's recorded cost plus what computing
    # the rest took (it was the rest's seconds scaled up to every token: 11 computed tokens after
    # 228 restored recorded 20x their time).
    longer = prompt + prompt[:10]
    starts = []
    result, caches = engine.generate_with_caches(loaded, "turbo4", longer, max_tokens=2, on_start=starts.append)
    assert result.cached_tokens == len(prompt) - 1 and starts[0].recorded == pytest.approx(stored.prefill_seconds)
    writer = BackgroundWriter()
    try:
        autosave(engine, SavePolicy(min_tokens=64), Metrics(), writer, loaded, "turbo4", longer, result, caches,
                 prefix_seconds=starts[0].recorded)
        assert writer.wait_for(longer, timeout=60)
    finally:
        writer.close(60)
    again = engine.store.get(SavePolicy.name_for(loaded.identity.digest, "turbo4", longer[:-1]))
    rest = result.first_token_seconds - result.restore_seconds
    assert again.prefill_seconds == pytest.approx(stored.prefill_seconds + rest)


def test_an_expired_entry_does_not_block_a_save_of_its_first_tokens(engine, model_dir):
    """Before: a lookup skips an expired entry, so a save of the same first block prefilled it
    afresh, calibrated on other rows, and met the expired entry's block 0 (its key does not cover
    the calibration): ConflictError, for the CLI and for every server autosave, until a gc."""
    import time

    loaded = engine.model(str(model_dir))
    words = loaded.tokenizer.encode(DOCUMENT * 8)
    first, second = words[:600], words[:300] + words[-300:]
    # Another prefill chunk (the server's and the CLI's differ) rounds block 0's later layers apart.
    engine.prefiller.chunk = 256
    engine.save_tokens("old", loaded, first, scheme="turbo5v4", ttl=0.2)
    engine.prefiller.chunk = 64
    time.sleep(0.3)
    assert engine.store.lookup(second, model=loaded.identity.digest,
                               codec=engine.models.codec_identity(loaded, "turbo5v4", "whole").digest) is None
    saved = engine.save_tokens("new", loaded, second, scheme="turbo5v4")
    assert saved.tokens == 600 and saved.reused_tokens == 0
    assert [e.name for e in engine.store.ls()] == ["new"]  # the expired entry went with its block
    assert engine.ask("new", "Who pays?", max_tokens=2).cached_tokens == 600


def test_put_refuses_a_snapshot_under_another_scheme_s_codec_identity(engine, model_dir):
    # It was stored, listed under the other scheme, and refused only at its first restore.
    loaded = engine.model(str(model_dir))
    tokens = loaded.tokenizer.encode(DOCUMENT)[:300]
    caches = _reference_caches(engine, loaded, "turbo4", tokens)
    snap = snapshot(caches)
    with pytest.raises(ValueError, match="encoded with turbo4, but the codec identity given says raw"):
        engine.store.put("b", snap, tokens, model=loaded.identity, codec=engine.models.codec_identity(loaded, "raw"),
                         model_ref=str(model_dir), prefill_seconds=1.0)
    assert engine.store.ls() == []
    engine.store.put("b", snap, tokens, model=loaded.identity, codec=engine.models.codec_identity(loaded, "turbo4"),
                     model_ref=str(model_dir), prefill_seconds=1.0)


def test_an_autosave_that_meets_another_save_of_its_first_block_counts_a_conflict(engine, model_dir):
    """A prefix restored from another save than the store's (the bucket's, say) cannot be stored
    here: an expected outcome, counted as such (it was an ERROR with a traceback per request)."""
    from types import SimpleNamespace

    from tqstore.engine.background import BackgroundWriter
    from tqstore.serve.autosave import SavePolicy, autosave
    from tqstore.serve.metrics import Metrics

    loaded = engine.model(str(model_dir))
    words = loaded.tokenizer.encode(DOCUMENT * 8)
    engine.prefiller.chunk = 256
    engine.save_tokens("held", loaded, words[:600], scheme="turbo5v4")
    engine.prefiller.chunk = 64
    prompt = words[:300] + words[-301:]
    caches = make_prompt_cache(loaded.model, "turbo5v4")
    engine.prefill(loaded, caches, prompt)  # not through the store: block 0 rounded otherwise
    result = SimpleNamespace(cached_tokens=0, tokens=[], prefill_seconds=0.1, first_token_seconds=0.1,
                             restore_seconds=0.0)
    metrics, writer = Metrics(), BackgroundWriter()
    try:
        autosave(engine, SavePolicy(min_tokens=64), metrics, writer, loaded, "turbo5v4", prompt, result, caches)
        assert writer.wait_for(prompt, timeout=60)
    finally:
        writer.close(60)
    outcome = {o: metrics.registry.get_sample_value("tqstore_autosaves_total", {"outcome": o})
               for o in ("saved", "conflict", "failed")}
    assert outcome == {"saved": 0.0, "conflict": 1.0, "failed": 0.0}, outcome
