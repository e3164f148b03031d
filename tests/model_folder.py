"""A tiny random-weight model written as an mlx-lm model folder (config, weights, tokenizer).

CLI, engine and server tests load models the way users do (`mlx_lm.load` on a folder); the
weights are random (tiny_models.py) and the tokenizer is a word-level one trained here.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten
from tokenizers import Tokenizer, models, pre_tokenizers, trainers, decoders

from tiny_models import CONFIGS, build_model

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = """The Devil's Dictionary defines words with wit. To abscond is to move in a mysterious way,
commonly with the property of another. Absent means peculiarly exposed to the tooth of detraction.
What does the dictionary say? Who pays for delays? The contract says the seller pays.
Clause seven covers delivery, payment and penalties. Summarise the document in one sentence.
""" * 3


def train_tokenizer(vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([CORPUS], trainer)
    return tok


def write_model_folder(path: Path, kind: str = "qwen2", seed: int = 0, chat: bool = True, *, model=None,
                       config: dict | None = None, **overrides) -> Path:
    """Write a loadable model folder at `path` and return it (`model` and its `config` instead
    of a tiny_models kind: any family, e.g. from arch_configs)."""
    path.mkdir(parents=True, exist_ok=True)
    cfg = dict(config) if config is not None else {**CONFIGS[kind], **overrides}
    tok = train_tokenizer(cfg["vocab_size"])
    tok.save(str(path / "tokenizer.json"))
    eos = tok.token_to_id("<|im_end|>")
    cfg.update(eos_token_id=eos, bos_token_id=tok.token_to_id("<|endoftext|>"), torch_dtype="float32")
    (path / "config.json").write_text(json.dumps(cfg))
    tok_cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": "<|im_end|>",
               "pad_token": "<|endoftext|>", "unk_token": None}
    if chat:
        tok_cfg["chat_template"] = CHAT_TEMPLATE
    (path / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    model = model if model is not None else build_model(kind, seed=seed, **overrides)
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    return path


def write_mlx_lm_cache(path: Path, model_dir: Path | str, text: str, adapter_path: str | None = None,
                       metadata: dict[str, str] | None = None) -> list[int]:
    """What `mlx_lm.cache_prompt` writes for `text` (the user turn left open, prefilled into
    plain caches, `save_prompt_cache`) at `path`; returns the token ids."""
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache, save_prompt_cache

    lm, tokenizer = load(str(model_dir), adapter_path=adapter_path)
    tokens = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=False,
                                           continue_final_message=True)
    caches = make_prompt_cache(lm)
    mx.eval(lm(mx.array(tokens)[None], cache=caches))
    save_prompt_cache(str(path), caches, metadata or {})
    return tokens
