"""The model side of tqstore in one object: `Engine` over a Store, each of its jobs done by a part
in a module of its own.

`Engine` holds no logic of its own: the command line, the server, the benchmarks and the tests
call its methods, and each method hands the call to the part that does that job:

- `models.py` `LoadedModels`: loading models once, codec identities, an entry's model and scheme;
- `prefill.py` `Prefiller`: a prompt's longest stored prefix restored, the rest prefilled;
- `saving.py` `Saver`: contexts and caches stored as entries;
- `generation.py` `Answerer`: answers, chat turns, an entry's caches for mlx-lm;
- `chunks.py` `DocumentChunks`: document chunks stored once and composed at any position.

Each part is given the parts below it, so no module of the engine imports one above it.
"""

from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path
from typing import Any, Callable, Generator, Sequence

from turboquant import StateCheckpoints

from tqstore.engine.background import BackgroundWriter
from tqstore.engine.chunks import ChunkInfo, Document, DocumentChunks, DocumentsAnswer
from tqstore.engine.defaults import PREFILL_CHUNK
from tqstore.engine.generation import Answerer, AskResult
from tqstore.engine.models import LoadedModels
from tqstore.engine.prefill import Prefiller, Progress, Started
from tqstore.engine.saving import SaveResult, Saver
from tqstore.errors import BadInput
from tqstore.format.manifest import Manifest
from tqstore.models.identity import CodecIdentity
from tqstore.models.loading import LoadedModel
from tqstore.store.store import Store


class Engine:
    """Save contexts and answer questions with mlx-lm models over a Store."""

    def __init__(self, store: Store, *, dtype: str = "auto", prefill_chunk: int = PREFILL_CHUNK,
                 windows: str = "token", light: bool = False):
        """`windows`: how new entries keep sliding-window and chunked layers, "token" (every
        token's row in the blocks: reused by prefix) or "whole" (the window alone, once per entry:
        fewer bytes, reused only whole; docs/models.md). Entries of either are read whatever it is.
        `light`: load models without transformers where they allow it (models/light.py: the
        tokenizer as recorded by an earlier load; no tool-call parsing), as the CLI does."""
        self.models = LoadedModels(store, dtype=dtype, light=light, windows=windows)
        self.prefiller = Prefiller(store, self.models, prefill_chunk)
        self.saver = Saver(store, self.models, self.prefiller)
        self.answerer = Answerer(store, self.models, self.prefiller, self.saver)
        self.chunks = DocumentChunks(store, self.models, self.prefiller, self.saver, self.answerer)

    @classmethod
    def open(cls, home: str | Path | None = None, **options) -> "Engine":
        """An engine over the store at `home` ($TQSTORE_HOME or ~/.cache/tqstore)."""
        return cls(Store.open(home), **options)

    @property
    def store(self) -> Store:
        """The store every part works on (one for the engine's life: the parts hold it)."""
        return self.models.store

    @property
    def prefill_chunk(self) -> int:
        """Tokens per prefill step."""
        return self.prefiller.chunk

    # -- models (models.py) ---------------------------------------------------------------

    def model(self, ref: str, adapter_path: str | None = None) -> LoadedModel:
        """Load (once per process) a model folder or repo id, and remember where it lives."""
        return self.models.model(ref, adapter_path)

    def use_model(self, loaded: LoadedModel) -> None:
        """Share a model another engine (or the caller) already loaded."""
        self.models.use_model(loaded)

    def model_for(self, name: str, ref: str | None = None) -> LoadedModel:
        """The model entry `name` was saved with (`LoadedModels.model_for`)."""
        return self.models.model_for(name, ref)

    def codec_identity(self, loaded: LoadedModel, scheme: str, windows: str | None = None) -> CodecIdentity:
        """The codec identity of `scheme` on this model (`LoadedModels.codec_identity`)."""
        return self.models.codec_identity(loaded, scheme, windows)

    def entry_scheme(self, manifest: Manifest, loaded: LoadedModel) -> tuple[str, str]:
        """(scheme, windows) of an entry, checked against its codec digest (`LoadedModels.entry_scheme`)."""
        return self.models.entry_scheme(manifest, loaded)

    # -- a prompt into caches (prefill.py) ------------------------------------------------

    def start(self, loaded: LoadedModel, scheme: str, tokens: Sequence[int], windows: str | None = None) -> Started:
        """Caches holding the longest stored prefix of `tokens` (`Prefiller.start`)."""
        return self.prefiller.start(loaded, scheme, tokens, windows)

    def prefill(self, loaded: LoadedModel, caches: list[Any], tokens: Sequence[int],
                progress: Progress | None = None, cancelled: Callable[[], bool] | None = None, *,
                at: int = 0, checkpoints: StateCheckpoints | None = None) -> float:
        """Run `tokens` through the model into `caches` in chunks (`Prefiller.prefill`)."""
        return self.prefiller.prefill(loaded, caches, tokens, progress, cancelled, at=at, checkpoints=checkpoints)

    def prefill_steps(self, loaded: LoadedModel, caches: list[Any], tokens: Sequence[int],
                      progress: Progress | None = None, cancelled: Callable[[], bool] | None = None, *,
                      at: int = 0, checkpoints: StateCheckpoints | None = None,
                      chunk: Callable[[int], int] | None = None) -> Generator[None, None, float]:
        """`prefill`, yielding after each chunk (`Prefiller.prefill_steps`)."""
        return self.prefiller.prefill_steps(loaded, caches, tokens, progress, cancelled, at=at,
                                            checkpoints=checkpoints, chunk=chunk)

    # -- saving (saving.py) ---------------------------------------------------------------

    def save(self, name: str, document: str, *, model: str, scheme: str | None = None, system: str | None = None,
             adapter_path: str | None = None, progress: Progress | None = None, pin: bool = False,
             ttl: float | None = None, metadata: dict[str, str] | None = None,
             windows: str | None = None) -> SaveResult:
        """Prefill `document` (what the store lacks of it), compress and store it as `name` (`Saver.save`)."""
        return self.saver.save(name, document, model=model, scheme=scheme, system=system, adapter_path=adapter_path,
                               progress=progress, pin=pin, ttl=ttl, metadata=metadata, windows=windows)

    def save_tokens(self, name: str, loaded: LoadedModel, tokens: Sequence[int], **options) -> SaveResult:
        """`save` for tokens already framed (chat turns, the server). Options as `saving`."""
        return self.saver.save_tokens(name, loaded, tokens, **options)

    def saving(self, name: str, loaded: LoadedModel, tokens: Sequence[int], **options
               ) -> Generator[None, None, SaveResult]:
        """`save_tokens`, yielding between prefill chunks (`Saver.saving`: scheme, progress, pin,
        ttl, metadata, windows)."""
        return self.saver.saving(name, loaded, tokens, **options)

    def store_caches(self, name: str, loaded: LoadedModel, scheme: str, caches: list[Any], tokens: Sequence[int],
                     *, prefill_seconds: float, ttl: float | None = None,
                     metadata: dict[str, str] | None = None, checkpoints: StateCheckpoints | None = None,
                     writer: BackgroundWriter | None = None, windows: str | None = None) -> Future | None:
        """Store caches that hold (at least) `tokens` as entry `name` (`Saver.store_caches`)."""
        return self.saver.store_caches(name, loaded, scheme, caches, tokens, prefill_seconds=prefill_seconds, ttl=ttl,
                                       metadata=metadata, checkpoints=checkpoints, writer=writer, windows=windows)

    def storable_tokens(self, caches: list[Any], tokens: int, checkpoints: StateCheckpoints | None = None,
                        windows: str | None = None) -> int:
        """How many of the first `tokens` tokens `store_caches` would store (`Saver.storable_tokens`)."""
        return self.saver.storable_tokens(caches, tokens, checkpoints, windows)

    # -- answering (generation.py) --------------------------------------------------------

    def ask(self, name: str, question: str, *, model: str | None = None, max_tokens: int = 256,
            temp: float = 0.0, top_p: float = 1.0, seed: int | None = None,
            on_text: Callable[[str], None] | None = None) -> AskResult:
        """Answer `question` about entry `name`, restoring its context instead of prefilling it."""
        return self.answerer.ask(name, question, model=model, max_tokens=max_tokens, temp=temp, top_p=top_p,
                                 seed=seed, on_text=on_text)

    def generate(self, loaded: LoadedModel, scheme: str, prompt: Sequence[int], **options) -> AskResult:
        """Generate after `prompt`, restoring its longest stored prefix (`Answerer.generate`)."""
        return self.answerer.generate(loaded, scheme, prompt, **options)

    def generate_with_caches(self, loaded: LoadedModel, scheme: str, prompt: Sequence[int], **options
                             ) -> tuple[AskResult, list[Any]]:
        """`generate`, also returning the caches (`Answerer.generate_with_caches`)."""
        return self.answerer.generate_with_caches(loaded, scheme, prompt, **options)

    def generation(self, loaded: LoadedModel, scheme: str, prompt: Sequence[int], **options
                   ) -> Generator[None, None, tuple[AskResult, list[Any]]]:
        """`generate_with_caches` one step at a time (`Answerer.generation` lists the options)."""
        return self.answerer.generation(loaded, scheme, prompt, **options)

    def prompt_steps(self, loaded: LoadedModel, scheme: str, prompt: Sequence[int], **options
                     ) -> Generator[None, None, tuple[Started, list[int], float, Callable[[], bool]]]:
        """What a generation does before its first token (`Answerer.prompt_steps`)."""
        return self.answerer.prompt_steps(loaded, scheme, prompt, **options)

    def generate_composed(self, loaded: LoadedModel, scheme: str, caches: list[Any], context: Sequence[int],
                          question: Sequence[int], compose_seconds: float, **options) -> AskResult:
        """Generate after `context + question`, where `caches` already hold `context`."""
        return self.answerer.generate_composed(loaded, scheme, caches, context, question, compose_seconds, **options)

    def chat_turn(self, name: str, question: str, child: str, *, model: str | None = None,
                  **options) -> AskResult:
        """One chat turn on entry `name`, saved as entry `child` (`Answerer.chat_turn`)."""
        return self.answerer.chat_turn(name, question, child, model=model, **options)

    def prompt_cache(self, name: str, *, model: str | None = None) -> tuple[list[Any], list[int], LoadedModel]:
        """mlx-lm caches holding entry `name` (ready for `prompt_cache=`), its tokens and model."""
        return self.answerer.prompt_cache(name, model=model)

    # -- document chunks (chunks.py) ------------------------------------------------------

    def add_chunk(self, name: str | None, text: str, *, model: str, scheme: str | None = None,
                  system: str | None = None, adapter_path: str | None = None, pin: bool = False) -> ChunkInfo:
        """Store `text` as a document chunk under `name` (None: its content address), prefilled
        after the prompt's prefix, to be reused at any place in `ask_documents`."""
        return self.chunks.add_chunk(self.model(model, adapter_path), text, name=name, scheme=scheme, system=system,
                                     pin=pin)

    def ask_documents(self, documents: Sequence[Document | str], question: str, *, model: str | None = None,
                      adapter_path: str | None = None, **options) -> DocumentsAnswer:
        """Answer `question` over documents in order (stored chunk names as Document(name=...),
        texts as str or Document(text=...)), reusing stored chunks wherever they sit. The model is
        `model`, else the first named chunk's. Options as `DocumentChunks.ask_documents` (scheme,
        system, recompute) and `generation`."""
        docs = [Document(text=d) if isinstance(d, str) else d for d in documents]
        named = next((d.name for d in docs if d.name is not None), None)
        if model is None and named is None:
            raise BadInput("pass a model: no stored chunk among the documents says which one")
        loaded = self.model(model, adapter_path) if model is not None else self.model_for(named)
        return self.chunks.ask_documents(loaded, docs, question, **options)
