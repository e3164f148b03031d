"""A question's tokens after a stored context are those of the whole conversation encoded at
once, also for sentencepiece tokenizers (Llama-2, Mistral), which put a space ('▁') before the
start of whatever they encode. The tokenizers are built here, offline, in both forms those
models ship: a Metaspace pre-tokenizer that prepends only at the start ("first"), and the older
Prepend normalizer.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from model_folder import CORPUS, train_tokenizer
from tqstore.models.prompting import prompt_format

BYTES = [f"<0x{i:02X}>" for i in range(256)]  # sentencepiece's byte fallback: "\n" is <0x0A>
TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
            "{% else %}{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}")
DOC = "The contract says the seller pays."
QUESTION = "Who pays for delays?"


def sentencepiece_like(style: str) -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    if style == "metaspace":  # Mistral, Llama-2 as transformers converts it now
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    else:  # Llama-2's original tokenizer.json
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    text = (CORPUS + " [INST] [/INST]").replace("\n", " ")
    if style == "prepend":
        text = text.replace(" ", "▁")  # what the normalizer feeds the model
    tok.train_from_iterator([text], trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>", *BYTES]))
    return tok


def load_tokenizer(folder: Path, tok: Tokenizer, config: dict):
    from mlx_lm.tokenizer_utils import load as load_wrapper

    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", **config}))
    return load_wrapper(folder)


@pytest.mark.parametrize("style", ["metaspace", "prepend"])
@pytest.mark.parametrize("chat", [True, False])
def test_question_tokens_follow_the_context_as_the_whole_conversation_encodes(tmp_path, style, chat):
    config = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "add_bos_token": True}
    tokenizer = load_tokenizer(tmp_path / style, sentencepiece_like(style),
                               config | ({"chat_template": TEMPLATE} if chat else {}))
    fmt = prompt_format(tokenizer)
    assert fmt.chat is chat
    ours = fmt.context_tokens(tokenizer, DOC) + fmt.question_tokens(tokenizer, QUESTION)
    if chat:
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": f"{DOC}\n\n{QUESTION}"}], tokenize=False,
                                                 add_generation_prompt=True)
        whole = tokenizer.encode(rendered, add_special_tokens=False)
    else:
        whole = tokenizer.encode(f"{DOC}\n\nQuestion: {QUESTION}\nAnswer:")
    assert ours == whole, (tokenizer.convert_ids_to_tokens(ours), tokenizer.convert_ids_to_tokens(whole))


def test_a_tokenizer_without_a_leading_space_keeps_the_question_as_encoded_alone(tmp_path):
    tokenizer = load_tokenizer(tmp_path / "bytelevel", train_tokenizer(300),
                               {"eos_token": "<|im_end|>", "chat_template": "{% for m in messages %}<|im_start|>"
                                "{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}<|im_start|>assistant\n"})
    fmt = prompt_format(tokenizer)
    for question in (QUESTION, " leading space", "\n\nnewlines first"):
        alone = tokenizer.encode("\n\n" + question + fmt.suffix, add_special_tokens=False)
        assert fmt.question_tokens(tokenizer, question) == alone
