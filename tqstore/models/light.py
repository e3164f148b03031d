"""Loading a model without transformers: what a fresh CLI process needs, at a fraction of the imports.

`mlx_lm.load` imports transformers (1.0 s of CPU here, 1.9 s on the H200) to build the tokenizer,
and every fresh `tqstore ask` paid it. Two parts replace it where they give the very same result:

- **The weights**: a family module of mlx-lm (`mlx_lm.models.<type>`) built from config.json and
  loaded from the safetensors files as `mlx_lm.utils.load_model` does, for the families in
  `FAMILIES` without quantization, custom code or adapters; anything else goes through mlx-lm.
- **The tokenizer**: the first load through mlx-lm records what its tokenizer is (the
  `tokenizers` pipeline transformers built, which for some model types is not tokenizer.json's:
  transformers 5 rebuilds Qwen2's normalizer and pre-tokenizer; the special tokens, the chat
  template, the end-of-sequence ids, the streaming detokenizer's kind) in
  `HOME/cache/tokenizers/<key>.json`, keyed by the tokenizer files' digest and the mlx-lm and
  transformers versions. Later processes rebuild it with `tokenizers` and render the template
  with jinja2 in transformers' environment: the same token ids and the same prompts
  (tests/test_light_load.py compares them). A tokenizer that mlx-lm wraps in ways this does not
  reproduce (its own chat renderers, thinking modes, structural markers, transformers' clean-up
  of spaces) is not recorded, and keeps loading through mlx-lm. It parses no tool calls: the server, which
  does, loads through mlx-lm.
"""

from __future__ import annotations

import functools
import glob
import hashlib
import importlib
import importlib.metadata as metadata
import json
from datetime import datetime
from pathlib import Path
from typing import Any

# Imported with the module, not in the load: import time is start-up, not the model load's phase.
import jinja2
import jinja2.ext
import mlx.core as mx
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from tqstore.durable import write_cache_file
from tqstore.models.detokenize import BPEDetokenizer, NaiveDetokenizer, SPMDetokenizer
from tqstore.models.lazy_mlx_lm import PACKAGE

FORMAT = "tqstore-tokenizer"
VERSION = 1
# Families whose module name is their model_type in every mlx-lm this supports (none is remapped).
FAMILIES = frozenset({"llama", "qwen2", "qwen3"})
# Keys of config.json that make mlx-lm's loader do more than build and load (quantization, custom code).
_FULL_LOAD_KEYS = ("quantization", "quantization_config", "model_file", "quantize_activations")
_THINK_TOKENS = ("<think>", "<longcat_think>", "<|think:start|>", "<|channel>", "<|open|>")


def load_light(path: Path, cache_dir: Path) -> tuple[Any, FastTokenizer] | None:
    """(model, tokenizer) of the model folder `path` without transformers, or None when this
    folder needs mlx-lm's loader (see the module docstring; nothing is loaded then)."""
    record = _record_path(path, cache_dir)
    if record is None or not record.exists():
        return None
    config = _config(path)
    if config is None:
        return None
    try:
        saved = json.loads(record.read_text())
        tokenizer = FastTokenizer.from_record(saved)
    except (OSError, ValueError, KeyError, TypeError):
        return None  # unreadable: the next load through mlx-lm writes it again
    tokenizer.add_eos_ids(config.get("eos_token_id"))
    return _model(path, config), tokenizer


def remember(path: Path, cache_dir: Path, tokenizer: Any) -> None:
    """Record mlx-lm's `tokenizer` (a TokenizerWrapper) of folder `path` for `load_light`, when
    `FastTokenizer` reproduces it; a full disk skips it (it only saves time)."""
    target = _record_path(path, cache_dir)
    if target is None or target.exists() or _config(path) is None:
        return
    saved = FastTokenizer.record_of(tokenizer)
    if saved is None:
        return
    write_cache_file(target, json.dumps(saved).encode())  # skipped on a full disk: the next load records it


# Every file of a model folder transformers reads to build its tokenizer: a record is keyed on
# them all (added_tokens.json and special_tokens_map.json change token ids too).
_TOKENIZER_FILES = ("tokenizer*", "*chat_template*", "added_tokens.json", "special_tokens_map.json", "vocab.*",
                    "merges.txt", "*.model", "generation_config.json")


def _record_path(path: Path, cache_dir: Path) -> Path | None:
    files = [path / "tokenizer.json", path / "tokenizer_config.json"]
    if not all(f.is_file() for f in files):
        return None
    digest = hashlib.sha256()
    for f in [p for pattern in _TOKENIZER_FILES for p in sorted(path.glob(pattern))] + [path / "config.json"]:
        if f.is_file():
            digest.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    try:
        versions = f"{metadata.version('mlx-lm')}-{metadata.version('transformers')}"
    except metadata.PackageNotFoundError:
        return None
    digest.update(f"{PACKAGE} {versions} {VERSION}".encode())
    return cache_dir / "tokenizers" / f"{digest.hexdigest()}.json"


def _config(path: Path) -> dict | None:
    """config.json when mlx-lm's loader would only build and load this model (see FAMILIES)."""
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if (not isinstance(config, dict) or config.get("model_type") not in FAMILIES
            or any(k in config for k in _FULL_LOAD_KEYS) or "__float__" in json.dumps(config)
            or "quantization_config" in config.get("text_config", {}) or (path / "hf_quant_config.json").exists()
            or config.get("architectures") and not isinstance(config["architectures"], list)):
        return None
    generation = path / "generation_config.json"
    if generation.exists():
        try:
            eos = json.loads(generation.read_text()).get("eos_token_id", False)
        except ValueError:
            eos = False
        if eos:
            config["eos_token_id"] = eos
    return config


def _model(path: Path, config: dict) -> Any:
    """The model as `mlx_lm.utils.load_model` builds an unquantized one of FAMILIES."""
    weights: dict = {}
    for file in glob.glob(str(path / "model*.safetensors")):
        weights.update(mx.load(file))
    if not weights:
        raise FileNotFoundError(f"No safetensors found in {path}")
    family = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    model = family.Model(family.ModelArgs.from_dict(config))
    if hasattr(model, "sanitize"):
        weights = model.sanitize(weights)
    model.eval()
    model.load_weights(list(weights.items()), strict=True)
    mx.eval(model.parameters())
    return model


class FastTokenizer:
    """The parts of mlx-lm's TokenizerWrapper the engine uses, over a `tokenizers` pipeline:
    encode, the chat template, the end-of-sequence ids and a streaming detokenizer."""

    def __init__(self, backend: Any, special: dict[str, Any], template: str | None, eos_ids: set[int],
                 detokenizer: str) -> None:
        self._backend = backend
        self.special_tokens_map = special
        self.bos_token = special.get("bos_token")  # a str or None, as transformers gives it
        self.chat_template = template
        self.has_chat_template = template is not None
        self.eos_token_ids = eos_ids
        self._detokenizer_kind = detokenizer

    @classmethod
    def record_of(cls, wrapper: Any) -> dict | None:
        """What `from_record` needs of mlx-lm's TokenizerWrapper `wrapper`, or None when it
        does something this class does not reproduce."""
        hf = getattr(wrapper, "_tokenizer", None)
        backend = getattr(hf, "backend_tokenizer", None)
        if backend is None or getattr(wrapper, "_chat_template", None) is not None:
            return None
        if getattr(wrapper, "_thinking_kwarg", None) != "enable_thinking" or wrapper.has_thinking:
            return None
        if getattr(wrapper, "_structural_markers", ()):
            return None
        kind = type(wrapper.detokenizer).__name__
        if kind == "SPMStreamingDetokenizer":
            kind = "spm" if wrapper.detokenizer.trim_space else "spm-keep-space"
        elif kind == "BPEStreamingDetokenizer":
            kind = "bpe"
        elif kind == "NaiveStreamingDetokenizer" and not hf.clean_up_tokenization_spaces:
            kind = "naive"  # decoding is the backend's alone (no transformers clean-up of spaces)
        else:
            return None
        template = hf.chat_template
        if template is not None and not isinstance(template, str):
            return None
        special = dict(hf.special_tokens_map)
        plain = all(isinstance(v, str) or isinstance(v, list) and all(isinstance(x, str) for x in v)
                    for v in special.values())
        if not plain or len(hf) != backend.get_vocab_size(with_added_tokens=True):
            return None
        if template is not None:
            try:
                _compiled(template)
            except jinja2.TemplateError:  # e.g. {% generation %}, an extension of transformers'
                return None
        return {"format": FORMAT, "version": VERSION, "backend": backend.to_str(), "special": special,
                "chat_template": template, "eos_token_ids": sorted(wrapper.eos_token_ids), "detokenizer": kind}

    @classmethod
    def from_record(cls, saved: dict) -> FastTokenizer:
        """The tokenizer `record_of` described; ValueError if `saved` is not such a record."""
        if saved.get("format") != FORMAT or saved.get("version") != VERSION:
            raise ValueError("not a tqstore tokenizer record")
        return cls(Tokenizer.from_str(saved["backend"]), dict(saved["special"]), saved["chat_template"],
                   set(saved["eos_token_ids"]), saved["detokenizer"])

    def add_eos_ids(self, ids: int | list[int] | None) -> None:
        """The model config's end-of-sequence ids, as mlx-lm adds them."""
        if ids is not None:
            self.eos_token_ids |= {ids} if isinstance(ids, int) else set(ids)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`, as the Hugging Face tokenizer encodes it."""
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int]) -> str:
        """The text of `ids`, special tokens included (transformers' decode without clean-up)."""
        return self._backend.decode(ids, skip_special_tokens=False)

    def apply_chat_template(self, messages: list[dict], tokenize: bool = True, add_generation_prompt: bool = False,
                            tools: list | None = None, **kwargs: Any) -> str | list[int]:
        """The chat template rendered as transformers renders it (with mlx-lm's
        enable_thinking=False); its tokens when `tokenize`."""
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template")
        kwargs.setdefault("enable_thinking", False)
        chat = [{k: v for k, v in m.items() if v is not None} for m in messages]
        text = _compiled(self.chat_template).render(messages=chat, tools=tools, documents=None,
                                                    add_generation_prompt=add_generation_prompt,
                                                    **{**self.special_tokens_map, **kwargs})
        return self.encode(text, add_special_tokens=False) if tokenize else text

    @property
    def detokenizer(self) -> Any:
        """A fresh streaming detokenizer of mlx-lm's kind for this tokenizer (one per caller)."""
        if self._detokenizer_kind == "bpe":
            return BPEDetokenizer(self._tokens)
        if self._detokenizer_kind == "naive":
            return NaiveDetokenizer(self.decode, " ," not in self.decode(self.encode("a ,b", add_special_tokens=False)))
        return SPMDetokenizer(self._tokens, trim_space=self._detokenizer_kind == "spm")

    @functools.cached_property
    def _tokens(self) -> list[str]:
        """Every token's string, by id (what transformers' convert_ids_to_tokens gives)."""
        return [self._backend.id_to_token(i) for i in range(self._backend.get_vocab_size(with_added_tokens=True))]


@functools.lru_cache(maxsize=8)
def _compiled(template: str) -> Any:
    """`template` compiled in transformers' chat-template environment (utils/chat_template_utils.py:
    a sandbox with trim_blocks and lstrip_blocks, loop controls, its tojson, raise_exception,
    strftime_now, dict and a namespace that refuses underscore names)."""
    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    class TemplateDict:
        def __call__(self, *args: Any, **kwargs: Any) -> dict:
            return dict(*args, **kwargs)

        def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        def __init__(*args: Any, **kwargs: Any) -> None:
            self, args = args[0], args[1:]
            for name in dict(*args, **kwargs):
                TemplateNamespace.check(name)
            jinja2.utils.Namespace.__init__(self, dict(*args, **kwargs))

        def __setitem__(self, name: str, value: Any) -> None:
            TemplateNamespace.check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def check(name: Any) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"chat templates cannot store underscore names ({name!r})")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda f: datetime.now().strftime(f),
                       dict=TemplateDict(), namespace=TemplateNamespace)
    return env.from_string(template)
