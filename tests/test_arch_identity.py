"""Identity covers the layer kinds and their configuration (issue 18, item 4): an entry of one
family, or of the same weights under another layer layout, is never restored into another.

The model identity hashes the config fields that say which layers are recurrent and how big
their states are; the codec identity (part of every block key) lists every layer's cache class
and configuration, so two families whose tokenizer and attention shapes agree still differ.
"""

from __future__ import annotations

import pytest
from mlx_lm.models.cache import make_prompt_cache

import arch_configs
from test_identity import write_model
from tqstore.models.identity import CodecIdentity, ModelIdentity, describe_difference
from turboquant import snapshot

HYBRID = {"model_type": "qwen3_5", "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
          "hidden_size": 64, "head_dim": 16, "full_attention_interval": 4, "linear_num_value_heads": 4,
          "linear_num_key_heads": 2, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
          "linear_conv_kernel_dim": 4}


@pytest.mark.parametrize("change", [
    {"full_attention_interval": 2}, {"linear_num_value_heads": 8}, {"linear_conv_kernel_dim": 3},
    {"hybrid_override_pattern": ["M", "*", "M", "*"]}, {"ssm_state_size": 32}, {"conv_L_cache": 4},
])
def test_layer_layout_changes_the_model_identity(tmp_path, change):
    a = ModelIdentity.from_path(write_model(tmp_path / "a", HYBRID), tmp_path / "cache")
    b = ModelIdentity.from_path(write_model(tmp_path / "b", {**HYBRID, **change}), tmp_path / "cache")
    assert a.digest != b.digest
    (field,) = change
    assert [d.split(":")[0] for d in describe_difference(a, b)] == [f"config.{field}"]


def test_a_layer_layout_in_a_wrapper_text_config_counts(tmp_path):
    wrapped = {"model_type": "qwen3_5", "text_config": HYBRID}
    a = ModelIdentity.from_path(write_model(tmp_path / "a", wrapped), tmp_path / "cache")
    b = ModelIdentity.from_path(write_model(tmp_path / "b", {**wrapped, "text_config": {**HYBRID, "full_attention_interval": 2}}),
                                tmp_path / "cache")
    assert a.digest != b.digest


def _codec(family: str, scheme: str = "raw") -> CodecIdentity:
    return CodecIdentity.from_snapshot(snapshot(make_prompt_cache(arch_configs.build(family))), scheme)


@pytest.mark.parametrize("a,b", [("qwen3_5", "lfm2"), ("lfm2", "llama"), ("nemotron_h", "jamba"),
                                 ("falcon_h1", "llama"), ("deepseek_v32", "deepseek_v3")])
def test_families_with_other_layer_kinds_have_other_codec_identities(a, b):
    x, y = _codec(a), _codec(b)
    assert x.digest != y.digest
    assert any(".class:" in d or ".size:" in d or "layers." in d for d in describe_difference(x, y))


def test_layer_kinds_are_listed_per_layer():
    layers = _codec("lfm2").layers
    assert [layer["class"] for layer in layers] == ["ArraysCache", "KVCache", "ArraysCache", "KVCache"]
    assert layers[0]["size"] == 1
