"""Model and codec identities (tqstore.models.identity)."""

from __future__ import annotations

import dataclasses
import json
import os

import mlx.core as mx
import pytest

from test_blocks import make_snapshot
from tiny_models import build_model
from tqstore.models import files as model_files
from tqstore.errors import ConfigError, NotFound
from tqstore.models.identity import CodecIdentity, ModelIdentity, describe_difference, legacy_identity
from turboquant import make_prompt_cache, snapshot
from turboquant.records import CodecRecord, LayerRecord, Snapshot

CONFIG = {"model_type": "qwen3", "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "hidden_size": 64, "rope_theta": 1000000.0, "max_position_embeddings": 2048, "torch_dtype": "bfloat16",
          "vocab_size": 10, "architectures": ["Qwen3ForCausalLM"]}


def write_model(root, config=CONFIG, template="{{ messages }}", weights=None):
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(config))
    mx.save_safetensors(str(root / "model.safetensors"), weights or {"w": mx.ones((4, 4), mx.bfloat16)})
    (root / "tokenizer.json").write_text('{"version": "1.0", "model": {"vocab": {"a": 0}}}')
    (root / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    return root


@pytest.fixture
def model_dir(tmp_path):
    return write_model(tmp_path / "Tiny-Model")


def test_from_path_is_stable_and_cached(model_dir, tmp_path, monkeypatch):
    a = ModelIdentity.from_path(model_dir, tmp_path / "cache")
    assert (tmp_path / "cache" / model_files.DIGEST_CACHE_FILE).is_file()
    assert a.kv_dtype == "bfloat16" and a.source == "Tiny-Model" and a.chat_template and a.tokenizer
    hashed = []
    real = model_files.file_sha256
    monkeypatch.setattr(model_files, "file_sha256", lambda p: hashed.append(p.name) or real(p))
    b = ModelIdentity.from_path(model_dir, tmp_path / "cache")
    assert "model.safetensors" in hashed  # written within the last 2 s: hashed again (racy)
    hashed.clear()
    monkeypatch.setattr(model_files.DigestCache, "RACY_NS", 0)
    assert ModelIdentity.from_path(model_dir, tmp_path / "cache") == a
    assert hashed.count("model.safetensors") == 0  # then cached: same inode, size, mtime and ctime
    assert a == b and a.digest == b.digest and len(a.digest) == 32 and a.hexdigest == a.digest.hex()


def test_weights_are_hashed_by_content(model_dir, tmp_path):
    a = ModelIdentity.from_path(model_dir, tmp_path / "cache")
    st = os.stat(model_dir / "model.safetensors")
    mx.save_safetensors(str(model_dir / "model.safetensors"), {"w": mx.full((4, 4), 2.0, mx.bfloat16)})
    os.utime(model_dir / "model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    b = ModelIdentity.from_path(model_dir, tmp_path / "cache")
    assert a.weights != b.weights and a.digest != b.digest
    assert describe_difference(a, b) == [f"weights: {a.weights[:12]}… vs {b.weights[:12]}…"]


@pytest.mark.parametrize("how", ["in place", "renamed over"])
def test_weights_replaced_with_the_same_size_and_mtime_are_hashed_again(model_dir, tmp_path, monkeypatch, how):
    """Before: the digest cache trusted path, size and mtime, so weights replaced as `cp -p`,
    `rsync -a` or `touch -r` leave them kept the old digest and a stale cache was served."""
    monkeypatch.setattr(model_files.DigestCache, "RACY_NS", 0)  # only inode and ctime may tell
    weights = model_dir / "model.safetensors"
    a = ModelIdentity.from_path(model_dir, tmp_path / "cache")
    st = os.stat(weights)
    other = tmp_path / "other.safetensors"
    mx.save_safetensors(str(other), {"w": mx.full((4, 4), 2.0, mx.bfloat16)})
    assert other.stat().st_size == st.st_size
    if how == "in place":
        weights.write_bytes(other.read_bytes())
    else:
        os.replace(other, weights)
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))  # touch -r the old file
    assert (os.stat(weights).st_size, os.stat(weights).st_mtime_ns) == (st.st_size, st.st_mtime_ns)
    b = ModelIdentity.from_path(model_dir, tmp_path / "cache")
    assert a.weights != b.weights


def test_a_damaged_digest_cache_is_rebuilt(model_dir, tmp_path):
    a = ModelIdentity.from_path(model_dir, tmp_path / "cache")
    (tmp_path / "cache" / model_files.DIGEST_CACHE_FILE).write_text("{not json")
    assert ModelIdentity.from_path(model_dir, tmp_path / "cache") == a


@pytest.mark.parametrize("change,field", [
    ({"rope_theta": 500000.0}, "config.rope_theta: 1000000.0 vs 500000.0"),
    ({"rope_scaling": {"factor": 4.0}}, "config.rope_scaling.factor: none vs 4.0"),
    ({"num_key_value_heads": 4}, "config.num_key_value_heads: 2 vs 4"),
    ({"sliding_window": 64}, "config.sliding_window: none vs 64"),
    ({"head_dim": 32}, "config.head_dim: none vs 32"),
    # Issue 27: fields that change the computation without shaping the KV cache count too.
    ({"rms_norm_eps": 0.5}, "config.rms_norm_eps: none vs 0.5"),
    ({"quantization": {"group_size": 64, "bits": 4}}, "config.quantization.bits: none vs 4"),
    ({"architectures": ["Other"]}, "config.architectures: [\"Qwen3ForCausalLM\"] vs [\"Other\"]"),
    ({"tie_word_embeddings": False}, "config.tie_word_embeddings: none vs false"),
    ({"vocab_size": 11}, "config.vocab_size: 10 vs 11"),
])
def test_config_changes_are_named(tmp_path, change, field):
    a = ModelIdentity.from_path(write_model(tmp_path / "a"), tmp_path / "cache")
    b = ModelIdentity.from_path(write_model(tmp_path / "b", {**CONFIG, **change}), tmp_path / "cache")
    assert a.digest != b.digest
    assert describe_difference(a, b)[0] == field


def test_cosmetic_config_fields_keep_the_identity(tmp_path):
    a = ModelIdentity.from_path(write_model(tmp_path / "a"), tmp_path / "cache")
    cosmetic = {"_name_or_path": "/elsewhere", "transformers_version": "9.9.9", "torch_dtype": "float16",
                "dtype": "float16", "use_cache": False, "eos_token_id": 3}
    b = ModelIdentity.from_path(write_model(tmp_path / "b", {**CONFIG, **cosmetic}), tmp_path / "cache", kv_dtype="bfloat16")
    assert b.digest == a.digest
    wrapped = {"model_type": "qwen3", "text_config": CONFIG}
    c = ModelIdentity.from_path(write_model(tmp_path / "c", wrapped), tmp_path / "cache")
    d = ModelIdentity.from_path(write_model(tmp_path / "d", {**wrapped, "text_config": {**CONFIG, **cosmetic}}),
                                tmp_path / "cache", kv_dtype="bfloat16")
    assert c.digest == d.digest


def test_an_identity_works_out_its_digest_once(tmp_path, monkeypatch):
    """The engine asks for the model's and the codec's digest on every request; an identity is
    immutable, so its canonical JSON is encoded once. A replaced identity has its own digest."""
    a = ModelIdentity.from_path(write_model(tmp_path / "a"), tmp_path / "cache")
    codec = CodecIdentity.from_snapshot(snapshot(make_prompt_cache(build_model("llama"), "turbo4")), "turbo4")
    first = (a.digest, codec.digest)
    calls = []
    monkeypatch.setattr(ModelIdentity, "fields", lambda self: calls.append(self) or {})
    monkeypatch.setattr(CodecIdentity, "fields", lambda self: calls.append(self) or {})
    assert (a.digest, codec.digest, a.hexdigest) == (*first, first[0].hex()) and calls == []
    other = dataclasses.replace(codec, scheme="turbo3")
    assert other.digest != codec.digest and calls == [other]


def test_a_spelled_out_default_is_another_identity(tmp_path):
    """Defaults are family-specific (gemma3's head_dim is 256 whatever hidden / heads is): filling
    them in could make two configs that compute differently one identity; a miss is the safe side."""
    a = ModelIdentity.from_path(write_model(tmp_path / "a"), tmp_path / "cache")
    b = ModelIdentity.from_path(write_model(tmp_path / "b", {**CONFIG, "head_dim": 16}), tmp_path / "cache")
    assert describe_difference(a, b) == ["config.head_dim: none vs 16"]


def test_the_identity_of_an_entry_stored_before_issue_27_is_recognised(tmp_path):
    """The digest the previous tqstore computed for this folder (pinned): `legacy_identity`
    gives it back, so `check_identity` can say "saved by an older tqstore: save it again"."""
    new = ModelIdentity.from_path(write_model(tmp_path / "m"), tmp_path / "cache")
    old = "e21ec84c683e6d7649cfb7040ac5775ffd5f41a48a70c68765bb5ff6221b11ac"
    assert new.hexdigest != old and legacy_identity(new).hexdigest == old


def test_tokenizer_template_adapter_and_dtype_count(model_dir, tmp_path):
    cache = tmp_path / "cache"
    base = ModelIdentity.from_path(model_dir, cache)
    other = ModelIdentity.from_path(write_model(tmp_path / "t", template="{{ other }}"), cache)
    assert describe_difference(base, other)[0].startswith("chat_template:")
    (model_dir / "tokenizer.json").write_text('{"version": "1.0", "model": {"vocab": {"b": 0}}}')
    assert describe_difference(base, ModelIdentity.from_path(model_dir, cache))[0].startswith("tokenizer:")
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    mx.save_safetensors(str(adapter / "adapters.safetensors"), {"lora_a": mx.ones((2, 2))})
    with_adapter = ModelIdentity.from_path(model_dir, cache, adapter_path=adapter)
    assert with_adapter.adapter is not None and with_adapter.digest != ModelIdentity.from_path(model_dir, cache).digest
    assert ModelIdentity.from_path(model_dir, cache, kv_dtype="float32").kv_dtype == "float32"


def test_kv_dtype_falls_back_to_the_weights(tmp_path):
    config = {k: v for k, v in CONFIG.items() if k != "torch_dtype"}
    weights = {"a": mx.ones((64,), mx.float16), "b": mx.ones((4,), mx.float32)}
    ident = ModelIdentity.from_path(write_model(tmp_path / "m", config, weights=weights), tmp_path / "cache")
    assert ident.kv_dtype == "float16"


def test_missing_or_broken_model_folders(tmp_path):
    with pytest.raises(NotFound, match="config.json"):
        ModelIdentity.from_path(tmp_path, tmp_path / "cache")
    (tmp_path / "config.json").write_text("{")
    with pytest.raises(ConfigError, match="config.json"):
        ModelIdentity.from_path(tmp_path, tmp_path / "cache")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(NotFound, match="no weight files"):
        ModelIdentity.from_path(tmp_path, tmp_path / "cache")


def test_from_model_hashes_parameters_and_args():
    a, b = build_model("llama", seed=0), build_model("llama", seed=0)
    ia = ModelIdentity.from_model(a)
    assert ia == ModelIdentity.from_model(b) and ia.kv_dtype == "float32" and ia.config["head_dim"] == 128
    b.layers[0].self_attn.k_proj.weight[0, 0] += 1
    assert ModelIdentity.from_model(b).weights != ia.weights
    c = build_model("llama", seed=0, rope_theta=5000.0)
    assert "config.rope_theta: 10000 vs 5000.0" in describe_difference(ia, ModelIdentity.from_model(c))
    half = build_model("llama", seed=0, dtype=mx.bfloat16)
    assert ModelIdentity.from_model(half).kv_dtype == "bfloat16"


@pytest.mark.filterwarnings("ignore:sliding-window")
@pytest.mark.parametrize("kind,scheme", [("llama", "turbo4"), ("gemma3_text", "turbo8v3"), ("qwen3", "raw")])
def test_codec_identity_is_data_independent(kind, scheme):
    model = build_model(kind)
    fresh = CodecIdentity.from_snapshot(snapshot(make_prompt_cache(model, scheme)), scheme)
    caches = make_prompt_cache(model, scheme)
    model(mx.arange(40)[None], cache=caches)
    for c in caches:
        if hasattr(c, "compress"):
            c.compress()
    full = CodecIdentity.from_snapshot(snapshot(caches), scheme)
    assert fresh == full and fresh.digest == full.digest


def test_codec_identity_changes_with_every_field():
    snap = make_snapshot(3)
    base = CodecIdentity.from_snapshot(snap, "turbo4")
    assert CodecIdentity.from_snapshot(snap, "TURBO4v4").digest == base.digest  # canonical scheme name
    assert describe_difference(base, CodecIdentity.from_snapshot(snap, "turbo3")) == ["scheme: turbo4 vs turbo3"]
    layers = list(snap.layers)
    r = layers[2]
    layers[2] = LayerRecord(r.layout, r.offset, r.arrays, {**r.config, "key_bits": 3}, r.state, r.calibration)
    changed = CodecIdentity.from_snapshot(Snapshot(layers, snap.codecs), "turbo4")
    assert describe_difference(base, changed) == ["layers.2.key_bits: 4 vs 3"]
    name, codec = next(iter(snap.codecs.items()))
    arrays = {**codec.arrays, "centroids": codec.arrays["centroids"] * 1.0001}
    for other in (CodecRecord(codec.rotation_kind, codec.norm_mode, arrays),
                  CodecRecord(codec.rotation_kind, "matched", codec.arrays),
                  CodecRecord("dense", codec.norm_mode, codec.arrays)):
        changed = CodecIdentity.from_snapshot(Snapshot(snap.layers, {**snap.codecs, name: other}), "turbo4")
        assert changed.digest != base.digest and len(describe_difference(base, changed)) == 1
    newer = CodecIdentity(base.scheme, base.layers, base.codecs, format_version=base.format_version + 1)
    assert describe_difference(base, newer) == [f"format_version: {base.format_version} vs {base.format_version + 1}"]


def test_codec_identity_ignores_data():
    a = CodecIdentity.from_snapshot(make_snapshot(3, seed=1), "turbo4")
    assert a.digest == CodecIdentity.from_snapshot(make_snapshot(300, seed=7), "turbo4").digest


def _tokenizer(vocab: dict[str, int], template: str | None):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")
    tok.chat_template = template
    return tok


def test_from_model_fingerprints_the_tokenizer_and_template():
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    model = build_model("qwen3")
    vocab = {"a": 0, "b": 1, "[UNK]": 2}
    base = ModelIdentity.from_model(model, _tokenizer(vocab, "{{ messages }}"))
    assert base.tokenizer and base.chat_template
    assert ModelIdentity.from_model(model, TokenizerWrapper(_tokenizer(vocab, "{{ messages }}"))) == base
    assert describe_difference(base, ModelIdentity.from_model(model, _tokenizer(vocab, "{{ other }}")))[0] \
        .startswith("chat_template:")
    other_vocab = ModelIdentity.from_model(model, _tokenizer({"a": 0, "c": 1, "[UNK]": 2}, "{{ messages }}"))
    assert describe_difference(base, other_vocab)[0].startswith("tokenizer:")


def test_a_dtype_alone_is_named_as_the_difference(model_dir, tmp_path):
    # A float16 entry asked from a float32 engine said "saved with another model ... pass the
    # model it was saved with", though the model was the same.
    from types import SimpleNamespace

    from tqstore.errors import IdentityMismatch
    from tqstore.models.loading import check_identity

    cache = tmp_path / "cache"
    saved = ModelIdentity.from_path(model_dir, cache, kv_dtype="float16")
    loaded = SimpleNamespace(identity=ModelIdentity.from_path(model_dir, cache, kv_dtype="float32"), ref="tiny")
    with pytest.raises(IdentityMismatch, match="saved with this model computing in float16, and tiny is loaded in float32") as caught:
        check_identity(loaded, saved, "doc")
    assert "another model" not in str(caught.value)
