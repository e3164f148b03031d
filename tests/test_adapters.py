"""Entries saved with a LoRA adapter (mlx-lm's adapter folder: adapters.safetensors and
adapter_config.json), through the command line in-process."""

from __future__ import annotations

import json

import pytest

from model_folder import write_mlx_lm_cache, write_model_folder
from test_cli import DOC, cli, clean_env  # noqa: F401 - fixtures


@pytest.fixture(scope="module")
def model_and_adapter(tmp_path_factory):
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm import load
    from mlx_lm.tuner.utils import linear_to_lora_layers

    root = tmp_path_factory.mktemp("adapter")
    model = write_model_folder(root / "tiny", num_hidden_layers=2)
    lm, _ = load(str(model))
    params = {"rank": 4, "scale": 4.0, "dropout": 0.0}
    linear_to_lora_layers(lm, len(lm.layers), params)
    mx.random.seed(3)
    weights = {k: mx.random.normal(v.shape) * 0.3 for k, v in tree_flatten(lm.parameters())
               if k.rsplit(".", 1)[-1] in ("lora_a", "lora_b")}
    (root / "work" / "adapters").mkdir(parents=True)
    mx.save_safetensors(str(root / "work" / "adapters" / "adapters.safetensors"), weights)
    (root / "work" / "adapters" / "adapter_config.json").write_text(json.dumps(
        {"fine_tune_type": "lora", "num_layers": len(lm.layers), "lora_parameters": params}))
    return model, root / "work"


def test_an_entry_saved_with_a_relative_adapter_path_is_asked_from_anywhere(cli, model_and_adapter, monkeypatch,
                                                                            tmp_path):
    """The adapter path was recorded as typed, so ask from another directory said the adapter
    was not found (and ask has no option to name it)."""
    model, work = model_and_adapter
    monkeypatch.chdir(work)
    saved = cli("save", "doc", "--model", str(model), "--adapter-path", "adapters", "--prompt", DOC, "-q")
    assert saved.code == 0, saved.err
    monkeypatch.chdir(tmp_path)
    asked = cli("ask", "doc", "Who pays?", "--max-tokens", "2", "--json")
    assert asked.code == 0, asked.err
    assert asked.json["cached_tokens"] > 0


def test_an_mlx_lm_file_made_with_an_adapter_is_imported_with_it(cli, model_and_adapter, tmp_path):
    """import had no --adapter-path: a cache made with an adapter could only be stored as the
    base model's, whose later prompts then reused it."""
    model, work = model_and_adapter
    adapter = str(work / "adapters")
    file = tmp_path / "lora.safetensors"
    tokens = write_mlx_lm_cache(file, model, DOC, adapter_path=adapter)
    imported = cli("import", str(file), "doc", "--model", str(model), "--adapter-path", adapter, "--prompt", DOC)
    assert imported.code == 0, imported.err
    base = cli("save", "longer", "--model", str(model), "--prompt", DOC + " And more.", "--json")
    assert base.code == 0 and base.json["reused_tokens"] == 0  # the base model's prefix is not the adapter's
    with_adapter = cli("ask", "doc", "Who pays?", "--max-tokens", "2", "--json")
    assert with_adapter.code == 0 and with_adapter.json["cached_tokens"] == len(tokens)
