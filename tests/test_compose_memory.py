"""Composing many documents within memory (issue 27, finding 4): a document given many times is
restored once, the recompute holds one bounded step of attention scores at a time, the estimate
made before any work bounds the measured peak, and a composition over the budget is refused
before it starts, by `ask --doc` (exit 1) and by the server (400)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache

from server_process import ServerProcess, request
from test_cli import DOC, clean_env, cli, fails, model  # noqa: F401 (fixtures)
from tiny_models import build_model
from tqstore import Store
from tqstore.config import load_config
from tqstore.engine import compose as compose_module
from tqstore.engine.chunks import Document, prefix_tokens
from tqstore.engine.compose import ChunkKV, compose
from tqstore.engine.compose_memory import OVERHEAD, ModelShape, composition_bytes
from tqstore.engine.defaults import PREFILL_CHUNK
from tqstore.engine.engine import Engine

REPO = Path(__file__).resolve().parent.parent
A = "What does the dictionary say? To abscond is to move in a mysterious way. " * 2


@pytest.fixture
def engine(tmp_path):
    engine = Engine(Store.open(tmp_path / "home", config=load_config(tmp_path / "home")), prefill_chunk=64)
    yield engine
    engine.store.close()


def tier_hits(engine: Engine) -> int:
    return sum(t.hits or 0 for t in engine.store.stats().tiers.values())


def test_a_document_given_many_times_is_restored_once(engine, model):
    loaded = engine.model(model)
    engine.add_chunk("a", A, model=model, scheme="turbo4")
    before = tier_hits(engine)
    once = engine.chunks.composed_caches(loaded, [Document(name="a")], "turbo4", recompute=0)
    one_restore = tier_hits(engine) - before
    assert one_restore > 0
    before = tier_hits(engine)
    many = engine.chunks.composed_caches(loaded, [Document(name="a")] * 5, "turbo4", recompute=0)
    assert tier_hits(engine) - before == one_restore  # was 5 restores, every one held at once
    chunk = len(once.tokens) - len(prefix_tokens(loaded, None))
    assert len(many.tokens) == len(once.tokens) + 4 * chunk and many.reused == 5 * once.reused == 5 * chunk


def test_the_estimate_follows_the_engines_prefill_step(engine, model):
    # compose_memory kept its own copy of the engine's 512-token step: an engine prefilling in
    # steps of 64 was estimated as if it held 512 rows of scores at once.
    loaded = engine.model(model)
    engine.add_chunk("a", A, model=model, scheme="turbo4")
    context = engine.chunks.composed_caches(loaded, [Document(name="a")] * 3, "turbo4", recompute=1.0)
    prefix = len(prefix_tokens(loaded, None))
    chunk = (len(context.tokens) - prefix) // 3
    assert len(context.tokens) > engine.prefill_chunk == 64
    shape = ModelShape.of(loaded.model)
    at = {step: composition_bytes(shape, prefix, [chunk] * 3, [chunk], question=0, recompute=1.0, step=step)
          for step in (64, PREFILL_CHUNK)}
    assert context.estimated_bytes == at[64] < at[PREFILL_CHUNK]


def test_the_recompute_holds_one_bounded_step_of_attention_scores(monkeypatch):
    # Two small layers, 4k tokens of context, 0.8k of them recomputed: all their scores at once
    # are 4 heads x 0.8k x 4k float32 = 51 MB; one bounded step is SCORE_BYTES (1 MiB here).
    model = build_model("llama", num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                        num_key_value_heads=1, head_dim=16, intermediate_size=128)
    monkeypatch.setattr(compose_module, "SCORE_BYTES", 1 << 20)
    prefix, tokens = [1, 2, 3], [int(t) for t in mx.random.randint(4, 500, (250,), key=mx.random.key(0))]
    caches = [KVCache() for _ in model.layers]
    model(mx.array(prefix + tokens)[None], cache=caches)
    chunk = ChunkKV(prefix, tokens, [c.keys[..., :c.offset, :] for c in caches],
                    [c.values[..., :c.offset, :] for c in caches])
    mx.eval(chunk.keys, chunk.values)
    mx.clear_cache()
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    composed = compose(model, [chunk] * 16, 0.2, question=[7, 8, 9])
    peak = mx.get_peak_memory() - base
    all_scores = 4 * composed.recomputed * len(composed.tokens) * 4
    assert composed.recomputed > 700 and all_scores > 50e6
    assert peak < 20e6, f"peak {peak / 1e6:.0f} MB while composing {len(composed.tokens)} tokens"


def measured_peaks(home: Path, model: str, *specs: str) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")])}
    run = subprocess.run([sys.executable, str(REPO / "tests" / "compose_peak.py"), str(home), model, *specs],
                         capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr
    return [json.loads(line) for line in run.stdout.splitlines()]


def check_bounds(results: list[dict]) -> None:
    for r in results:
        measured = max(r["peak_mlx"], r["peak_rss"] or 0)
        assert r["estimate"] >= measured, r
        # And not a bound that says nothing: within 3x the measure (plus the fixed part).
        assert r["estimate"] <= 3 * measured + OVERHEAD, r


def test_the_estimate_bounds_the_measured_peak(tmp_path, model):
    results = measured_peaks(tmp_path / "home", model, "2:1", "5:0.2")
    assert [r["copies"] for r in results] == [2, 5]
    check_bounds(results)


@pytest.mark.slow
def test_the_estimate_bounds_the_measured_peak_of_long_compositions(tmp_path, model):
    check_bounds(measured_peaks(tmp_path / "home", model, "4:1", "16:0", "16:0.2", "32:0.2"))


def test_ask_over_the_budget_is_refused_before_any_work(cli, model, tmp_path, monkeypatch):
    (tmp_path / "a.txt").write_text(DOC)
    (tmp_path / "new.txt").write_text(A)
    assert cli("chunk", "add", str(tmp_path / "a.txt"), "--model", model).code == 0
    two = cli("ask", "--doc", "a", "--doc", "a", "Who pays?", "--max-tokens", "1", "--json")
    assert two.code == 0, two.err
    budget = two.json["estimated_bytes"] + (1 << 20)
    monkeypatch.setenv("TQSTORE_COMPOSE_BUDGET", str(budget))
    assert cli("ask", "--doc", "a", "--doc", "a", "Who pays?", "--max-tokens", "1").code == 0
    many = ["--doc", "a"] * 100
    line = fails(cli("ask", *many, "--doc-file", str(tmp_path / "new.txt"), "Who pays?"), "store.compose_budget")
    assert "composing 101 documents" in line and "fewer or shorter documents" in line
    refused = cli("ask", *many, "Who pays?", "--json")
    assert refused.code == 1 and refused.json["error"]["type"] == "OverMemoryBudget"
    entries = {e["name"] for e in cli("ls", "--json").json["entries"]}
    assert entries == {"a"}  # the new document was not prefilled: refused before any work


def test_the_server_refuses_a_composition_over_its_budget_with_a_400(tmp_path, model, monkeypatch):
    monkeypatch.setenv("TQSTORE_COMPOSE_BUDGET", "8MiB")
    server = ServerProcess(tmp_path / "home", Path(model), "--max-tokens", "2")
    try:
        for documents in ([A], [A] * 100):  # 100: over the old count cap of 64, within the new sanity bound
            status, _, body = request(server, "POST", "/v1/completions", {"prompt": "Who pays?",
                                                                          "documents": documents})
            assert status == 400 and body["error"]["code"] == "over_memory_budget", body
            assert "store.compose_budget" in body["error"]["message"]
        status, _, caches = request(server, "GET", "/v1/caches")
        assert caches["data"] == []  # nothing prefilled or stored for the refused requests
        status, _, plain = request(server, "POST", "/v1/completions", {"prompt": "Who pays?", "max_tokens": 1})
        assert status == 200, plain
    finally:
        assert server.stop() == 0, server.log()
