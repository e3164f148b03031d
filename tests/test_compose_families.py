"""Which model families compose stored chunks, and how (compose.py's registry).

The recompute in context runs a decoder block's forward pass itself (the selected tokens only,
at their own positions), so it is allowed only for the families it reproduces: every family of
`RECOMPUTE_FAMILIES` is checked here against mlx-lm's own prefill of the composed prompt, every
layer. Every other family mlx-lm has (arch_configs discovers them) composes by plain
concatenation (recompute 0) or a full prefill (1), or is refused with a BadInput naming it; a
recompute between 0 and 1 on it is a BadInput naming it too, never an internal error or a
silently wrong cache.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache

from arch_configs import NOT_BUILDABLE, UNSAFE, build, config, families
from model_folder import write_model_folder
from server_process import ServerProcess, request
from test_cli import DOC, clean_env, cli, fails  # noqa: F401 (fixtures)
from turboquant import make_prompt_cache
from tqstore.engine.chunks import Document
from tqstore.engine.compose import ChunkKV, check_composable, compose, window_sizes
from tqstore.engine.compose_blocks import RECOMPUTE_FAMILIES
from tqstore.engine.compose_memory import ModelShape
from tqstore.engine.engine import Engine
from tqstore.errors import BadInput

# What a family's tiny config leaves at a value that would hide a difference: granite's
# multipliers at granite-3's values (the generic config gives 1.0), glm4_moe's q/k norms on.
OVERRIDES = {
    "granite": dict(embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.015625,
                    logits_scaling=8.0),
    "glm4_moe": dict(use_qk_norm=True),
    "solar_open": dict(use_qk_norm=True),
}
TOKENS = mx.random.randint(0, 128, (64,), key=mx.random.key(3)).tolist()


def prefill(model, n_caches: int, tokens: list[int]) -> tuple[list[mx.array], list[mx.array]]:
    """mlx-lm's own prefill of `tokens`: every layer's K and V, every token's row."""
    caches = [KVCache() for _ in range(n_caches)]
    model(mx.array(tokens)[None], cache=caches)
    return [c.keys[..., :c.offset, :] for c in caches], [c.values[..., :c.offset, :] for c in caches]


def chunks_of(model, n_caches: int) -> list[ChunkKV]:
    """Three chunks of TOKENS, each prefilled after the same 4-token prefix (longer than the tiny
    configs' 16-token windows, so window layers are crossed)."""
    prefix, parts = TOKENS[:4], [TOKENS[4:24], TOKENS[24:44], TOKENS[44:]]
    return [ChunkKV(prefix, part, *prefill(model, n_caches, prefix + part)) for part in parts]


def relative_error(a: mx.array, b: mx.array) -> float:
    return (mx.max(mx.abs(a - b)) / (mx.max(mx.abs(b)) + 1e-9)).item()


@pytest.mark.parametrize("family", sorted(RECOMPUTE_FAMILIES))
def test_the_recompute_gives_every_layer_the_kv_of_mlx_lms_own_prefill(family):
    # Was: gemma (embeddings x sqrt(hidden)), granite (its multipliers) and glm4 (norms after the
    # attention and the MLP) were run as llama blocks: relative errors of 0.3 to 1.4 from layer 1 on.
    model = build(family, **OVERRIDES.get(family, {}))
    caches = make_prompt_cache(model, "raw")
    check_composable(model, caches)
    composed = compose(model, chunks_of(model, len(caches)), 1.0, question=TOKENS[:6], windows=window_sizes(caches))
    assert composed.recomputed_at == set(range(24, 64))  # every token of the moved chunks
    keys, values = prefill(model, len(caches), TOKENS)
    for layer, (k, v, fk, fv) in enumerate(zip(composed.keys, composed.values, keys, values)):
        assert relative_error(k, fk) < 1e-5 and relative_error(v, fv) < 1e-5, (family, layer)


def test_families_the_recompute_does_not_reproduce_are_refused_not_miscomputed():
    """Every family mlx-lm has: refused with a BadInput naming it, or composed by concatenation
    with layer 0 exact (its K/V depend on the token and its position only, so a moved key that
    is not the key of its new position shows there), its shape read for the memory estimate, and
    a partial recompute either reproduced (the registry) or refused naming the family."""
    outcomes = {}
    for family in families():
        if family in NOT_BUILDABLE or family in UNSAFE:
            continue
        model = build(family)
        caches = make_prompt_cache(model, "raw")
        try:
            check_composable(model, caches)
        except BadInput as exc:
            assert family in str(exc) and "save whole prompts instead" in str(exc), (family, str(exc))
            outcomes[family] = "refused"
            continue
        shape = ModelShape.of(model)
        assert min(shape.layers, shape.heads, shape.kv_heads, shape.head_dim, shape.hidden) > 0, (family, shape)
        parts = chunks_of(model, len(caches))
        concatenated = compose(model, parts, 0.0, windows=window_sizes(caches))
        keys, values = prefill(model, len(caches), TOKENS)
        assert relative_error(concatenated.keys[0], keys[0]) < 1e-5, family
        assert relative_error(concatenated.values[0], values[0]) < 1e-5, family
        if family in RECOMPUTE_FAMILIES:
            compose(model, parts, 0.2, question=TOKENS[:6], windows=window_sizes(caches))
            outcomes[family] = "recomputed"
            continue
        with pytest.raises(BadInput) as caught:
            compose(model, parts, 0.2, question=TOKENS[:6], windows=window_sizes(caches))
        assert family in str(caught.value) and "--recompute 0" in str(caught.value), family
        outcomes[family] = "concatenated"
    # Families the hunt found wrong or crashing, each where it belongs now.
    assert {f: outcomes[f] for f in ("gemma", "granite", "glm4", "llama", "qwen3", "gemma3_text")} == dict.fromkeys(
        ("gemma", "granite", "glm4", "llama", "qwen3", "gemma3_text"), "recomputed")
    for family in ("laguna", "olmoe", "mistral3", "qwen2_vl", "qwen3_vl", "mixtral", "phi", "deepseek", "stablelm",
                   "minicpm", "olmo2", "olmo3", "gpt_oss", "minimax", "ministral3", "mimo_v2_flash", "nanbeige"):
        assert outcomes[family] == "concatenated", family
    for family in ("deepseek_v3", "minicpm3", "mistral4", "afm7", "iquestloopcoder", "plamo"):
        assert outcomes[family] == "refused", family  # keys that do not move, or layers run twice


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory) -> Path:
    """A tiny Mixtral folder: a family the recompute does not reproduce."""
    cfg = config("mixtral", vocab_size=512)
    return write_model_folder(tmp_path_factory.mktemp("model") / "tiny-mixtral", model=build("mixtral", vocab_size=512),
                              config=cfg)


def test_ask_over_documents_of_another_family_says_to_recompute_0_or_1(cli, mixtral, tmp_path):  # noqa: F811
    # Was: an internal error (AttributeError: 'MixtralAttention' object has no attribute 'n_heads')
    # at every --recompute.
    (tmp_path / "doc.txt").write_text(DOC)
    message = fails(cli("ask", "--model", str(mixtral), "--doc-file", str(tmp_path / "doc.txt"), "Who pays?",
                        "--max-tokens", "2"), "mixtral")
    assert "--recompute 0" in message and "--recompute 1" in message and "internal error" not in message
    assert cli("ls", "--json").json["entries"] == []  # refused before anything was stored
    for recompute in ("0", "1"):
        done = cli("ask", "--model", str(mixtral), "--doc-file", str(tmp_path / "doc.txt"), "Who pays?",
                   "--max-tokens", "2", "--recompute", recompute, "--json")
        assert done.code == 0, done.err
    engine = Engine.open(Path(cli.home))
    loaded = engine.model(str(mixtral))
    for recompute in (0.0, 1.0):  # two documents: one moved
        context = engine.chunks.composed_caches(loaded, [Document(text=DOC), Document(text=DOC[::-1])], "raw",
                                                recompute=recompute)
        assert context.recomputed == (0 if recompute == 0 else sum(c.tokens for c in context.chunks))


def test_a_server_refuses_a_partial_recompute_of_another_family_with_400(mixtral, tmp_path):
    server = ServerProcess(tmp_path / "home", mixtral, "--max-tokens", "2")
    try:
        body = {"messages": [{"role": "user", "content": "Who pays?"}], "documents": [DOC], "max_tokens": 2}
        status, _, refused = request(server, "POST", "/v1/chat/completions", {**body, "recompute": 0.3})
        assert status == 400, refused
        assert "mixtral" in refused["error"]["message"] and "recompute 0" in refused["error"]["message"]
        status, _, answered = request(server, "POST", "/v1/chat/completions", {**body, "recompute": 0})
        assert status == 200, json.dumps(answered)
    finally:
        assert server.stop() == 0, server.log()
