"""Document chunks: stored once, reused at any place in a prompt of several documents.

A chunk entry is an ordinary entry (listed, pinned, pushed and pulled like any other) holding
the tokens `[prefix][chunk]`, where the prefix is what the prompt frames documents with (the
chat template's system turn and the start of the user turn). Its name is either the user's or
`chunk-<address>`, the address being a digest of the model, the codec, the prefix and the chunk
tokens and never of what precedes the chunk in a prompt: the same text is stored once however
many prompts use it, and a chunk of another model, codec or tokenizer has another address.
A named chunk is checked against the model and codec before use; a damaged one is a miss
(prefilled again from its tokens), never a wrong cache.

`ask_documents` composes `[prefix][doc_1]...[doc_k][question]` from chunk entries (compose.py)
and generates; documents not stored yet are prefilled and stored on the way.
"""

from __future__ import annotations

import hashlib
import struct
import time
from dataclasses import dataclass
from typing import Sequence

import mlx.core as mx

from turboquant import WINDOW_CLASSES, is_window_record, make_prompt_cache, restore, settle

from tqstore.engine.compose import (ChunkKV, Composed, check_composable, compose, decoded_kv,
                                    rope_description, window_sizes)
from tqstore.engine.compose_blocks import check_recompute
from tqstore.engine.compose_memory import ModelShape, check_budget, composition_bytes
from tqstore.engine.defaults import DEFAULT_RECOMPUTE
from tqstore.engine.generation import Answerer, AskResult
from tqstore.engine.models import LoadedModels, scheme_name
from tqstore.engine.prefill import Prefiller
from tqstore.engine.saving import Saver
from tqstore.errors import (BadInput, ConflictError, CorruptBlock, FormatError, IdentityMismatch, NotFound,
                            TokenMismatch)
from tqstore.format.manifest import Manifest
from tqstore.models.loading import LoadedModel
from tqstore.store.store import Store

CHUNK_KEY = "chunk.address"  # metadata: the chunk's content address (hex)
PREFIX_KEY = "chunk.prefix"  # metadata: how many of the entry's tokens are the prefix
ROPE_KEY = "chunk.rope"  # metadata: the RoPE the keys were rotated with
NAME_PREFIX = "chunk-"
# A chunk keeps every token's row of its sliding-window layers (turboquant.adapter.windows), whatever the
# engine keeps for other entries: the composed context needs all of them.
WINDOWS = "token"


@dataclass(frozen=True)
class Document:
    """One document of a composed prompt: a stored chunk's `name`, or a `text` (stored as a chunk
    the first time it is seen)."""

    text: str | None = None
    name: str | None = None

    def __post_init__(self) -> None:
        if (self.text is None) == (self.name is None):
            raise BadInput("a document is either a text or the name of a stored chunk")


@dataclass(frozen=True)
class ChunkInfo:
    """A stored chunk: its entry name, tokens (without the prefix) and whether it was new."""

    name: str
    tokens: int
    prefix_tokens: int
    stored: bool  # prefilled and stored now (False: it was stored already)
    seconds: float
    pinned: bool = False


@dataclass(frozen=True)
class DocumentsAnswer:
    """An answer over composed documents and what the composition reused."""

    answer: AskResult
    chunks: list[ChunkInfo]
    reused_tokens: int  # chunk tokens whose K/V, stored before this request, were kept
    recomputed_tokens: int  # chunk tokens recomputed in the composed context
    # Tokens whose K/V this request's prefills computed: the question and the tokens of the chunks
    # it stored, less those recomputed (all of the prompt at budget 1, where nothing is reused or
    # recomputed).
    prefilled_tokens: int
    compose_seconds: float  # restore, move and recompute (time to the composed cache)
    estimated_bytes: int  # the composition's peak memory as estimated before it started


def chunk_address(model_digest: bytes, codec_digest: bytes, prefix: Sequence[int], tokens: Sequence[int]) -> str:
    """The content address of a chunk: sha256 over model, codec, prefix and chunk tokens (u32 LE,
    each list preceded by its length)."""
    h = hashlib.sha256(b"tqstore-chunk-v1")
    h.update(model_digest)
    h.update(codec_digest)
    for part in (prefix, tokens):
        h.update(struct.pack(f"<I{len(part)}I", len(part), *part))
    return h.hexdigest()


def prefix_tokens(loaded: LoadedModel, system: str | None) -> list[int]:
    """The tokens documents follow: the template up to where the user's text starts."""
    return loaded.prompt.context_tokens(loaded.tokenizer, "", system)


@dataclass
class ComposedContext:
    """Caches holding `[prefix][documents...]`, ready for the question."""

    caches: list
    tokens: list[int]
    chunks: list[ChunkInfo]
    reused: int  # chunk tokens whose K/V, stored before this request, were kept
    recomputed: int
    seconds: float
    estimated_bytes: int  # the peak memory the composition was estimated to need
    fresh: int = 0  # chunk tokens whose K/V this request's own prefill computed, kept as computed


def fresh_tokens(composed: Composed, chunks: Sequence[ChunkKV], stored_now: Sequence[bool]) -> int:
    """How many of the composed chunk tokens kept the K/V that this request's own prefill gave
    them: the tokens of the `chunks` it stored (`stored_now`), less those recomputed in context."""
    fresh, at = 0, chunks[0].start
    for chunk, new in zip(chunks, stored_now):
        n = len(chunk.tokens)
        if new:
            fresh += n - sum(1 for p in range(at, at + n) if p in composed.recomputed_at)
        at += n
    return fresh


def fill_caches(caches: list, composed: Composed) -> None:
    """Put a composition into fresh caches; a sliding-window cache keeps the last rows of the
    composed context, as a prefill of it would. Layer by layer, each composed layer dropped once
    its cache holds the copy, so the composed context is never held twice."""
    for layer, cache in enumerate(caches):
        mx.eval(cache.update_and_fetch(composed.keys[layer], composed.values[layer]))
        if type(cache).__name__ in WINDOW_CLASSES:
            settle(cache)
        composed.keys[layer] = composed.values[layer] = None


class DocumentChunks:
    """Document chunks of one store: stored (prefilled through `saver`), read back, composed into
    one context and answered over (through `answerer`)."""

    def __init__(self, store: Store, models: LoadedModels, prefiller: Prefiller, saver: Saver, answerer: Answerer):
        self.store = store
        self.models = models
        self.prefiller = prefiller
        self.saver = saver
        self.answerer = answerer

    def add_chunk(self, loaded: LoadedModel, text: str, *, name: str | None = None, scheme: str | None = None,
                  system: str | None = None, pin: bool = False) -> ChunkInfo:
        """Store `text` as a chunk (under `name`, or its content address); a chunk stored already
        is kept as it is."""
        if not text.strip():
            raise BadInput("the document is empty: nothing to store")
        scheme = scheme_name(scheme or self.store.config.default_scheme)
        prefix = prefix_tokens(loaded, system)
        tokens = loaded.prompt.document_tokens(loaded.tokenizer, text)
        return self.ensure_chunk(loaded, scheme, prefix, tokens, name, pin)[0]

    def ensure_chunk(self, loaded: LoadedModel, scheme: str, prefix: list[int], tokens: list[int],
                     name: str | None, pin: bool = False, *,
                     read: Manifest | None = None) -> tuple[ChunkInfo, ChunkKV | None]:
        """The chunk entry for these tokens, stored if missing or damaged; with its K/V when it was
        loaded or computed here. `read`: the version of chunk `name` the tokens were read from
        (`ask --doc NAME`); that version is served, and ConflictError raised when the entry no
        longer holds it."""
        codec = self.models.codec_identity(loaded, scheme, WINDOWS)
        address = chunk_address(loaded.identity.digest, codec.digest, prefix, tokens)
        entry = name or NAME_PREFIX + address[:40]
        if read is not None:
            manifest = read
        else:
            try:
                manifest = self.store.get(entry)
            except NotFound:
                manifest = None
        if manifest is not None and manifest.metadata.get(CHUNK_KEY) == address:
            found = self.load_chunk(loaded, manifest, prefix, tokens)
            if found is not None:
                if pin and not manifest.pinned:
                    self.store.pin(entry)
                return ChunkInfo(entry, len(tokens), len(prefix), False, 0.0, pin or manifest.pinned), found
        elif manifest is not None and name is not None and CHUNK_KEY not in manifest.metadata:
            raise BadInput(f"entry {name!r} exists and is not a document chunk: choose another name")
        # Tokens read from a chunk the user named are stored again only to repair that very
        # version: once it was replaced or removed, storing them would bring the old document
        # back under the user's name.
        if read is not None and self._replaced(read):
            raise ConflictError(f"chunk {entry} was replaced or removed while this request read it: ask again")
        t0 = time.perf_counter()
        caches = make_prompt_cache(loaded.model, scheme, verdicts=self.models.verdicts(loaded))
        check_composable(loaded.model, caches)
        metadata = {CHUNK_KEY: address, PREFIX_KEY: str(len(prefix)), ROPE_KEY: rope_description(loaded.model)}
        self.saver.save_tokens(entry, loaded, prefix + tokens, scheme=scheme, pin=pin, metadata=metadata,
                               windows=WINDOWS)
        seconds = time.perf_counter() - t0
        # A replaced pinned entry stays pinned (Store.put).
        pinned = pin or (manifest is not None and manifest.pinned)
        return ChunkInfo(entry, len(tokens), len(prefix), True, seconds, pinned), None

    def load_chunk(self, loaded: LoadedModel, manifest: Manifest, prefix: list[int],
                   tokens: list[int]) -> ChunkKV | None:
        """The decoded K/V of a chunk entry, every token's row in every layer; None (a miss) when its
        objects are damaged or lost, or its window layers were stored without their rows."""
        if list(manifest.tokens) != prefix + tokens:
            raise TokenMismatch(f"chunk {manifest.name} holds other tokens than its address says: "
                                "run `tqstore verify`")
        if manifest.metadata.get(ROPE_KEY) != rope_description(loaded.model):
            raise IdentityMismatch(f"chunk {manifest.name} was stored with RoPE {manifest.metadata.get(ROPE_KEY)!r}, "
                                   f"this model uses {rope_description(loaded.model)!r}")
        try:
            # The version checked above: by name, a chunk replaced meanwhile (`chunk add --name`)
            # gave its K/V paired with the tokens checked here.
            snap, _ = self.store.load(manifest.name, manifest=manifest)
        except (CorruptBlock, FormatError):
            if self._replaced(manifest):
                raise ConflictError(f"chunk {manifest.name} was replaced or removed while this request read it: "
                                    "ask again") from None
            return None
        windows = [r for r in snap.layers if r.config.get("class") in WINDOW_CLASSES]
        if not all(is_window_record(r) for r in windows):
            return None
        caches = restore(snap)
        pairs = [(r.arrays["keys"], r.arrays["values"]) if is_window_record(r) else decoded_kv(c)
                 for r, c in zip(snap.layers, caches)]
        return ChunkKV(prefix, tokens, [k for k, _ in pairs], [v for _, v in pairs])

    def _replaced(self, manifest: Manifest) -> bool:
        """Whether entry `manifest.name` now holds other content than `manifest`."""
        try:
            return not self.store.get(manifest.name).same_content(manifest)
        except (NotFound, FormatError):
            return True

    def _named(self, loaded: LoadedModel, scheme: str, name: str) -> tuple[Manifest, list[int]]:
        """A stored chunk by name, checked against this model and codec: its manifest and the chunk
        tokens (without the prefix it was stored after)."""
        try:
            manifest = self.store.get(name)
        except NotFound:  # named without the store's folder: a server's clients see this message
            raise NotFound(f"no stored chunk {name}: `tqstore chunk add` (or PUT /v1/caches) stores one") from None
        if CHUNK_KEY not in manifest.metadata:
            raise BadInput(f"entry {name!r} is not a document chunk: store it with `tqstore chunk add`")
        if manifest.model_digest != loaded.identity.digest:
            raise IdentityMismatch(f"chunk {name!r} was stored with another model or tokenizer "
                                   f"({manifest.model_ref}): store it again with this model")
        if manifest.codec_digest != self.models.codec_identity(loaded, scheme, WINDOWS).digest:
            raise IdentityMismatch(f"chunk {name!r} was stored with scheme {manifest.scheme}, not {scheme}: pass "
                                   f"--scheme {manifest.scheme} or store it again")
        return manifest, list(manifest.tokens[int(manifest.metadata[PREFIX_KEY]):])

    def composed_caches(self, loaded: LoadedModel, documents: Sequence[Document], scheme: str, *,
                        system: str | None = None, recompute: float = DEFAULT_RECOMPUTE,
                        question: Sequence[int] | None = None) -> ComposedContext:
        """Caches of `[prefix][doc_1]...[doc_k]` under `scheme` from stored chunks (texts not stored
        yet are prefilled and stored first); recompute 1 is a plain prefill of the whole. The
        `question` tokens that follow steer which tokens are recomputed (compose.py).

        Before any chunk is restored or prefilled, the composition's peak memory is estimated
        (compose_memory.py) and OverMemoryBudget raised when it is over `store.compose_budget`."""
        if not documents:
            raise BadInput("no documents given")
        if not 0.0 <= recompute <= 1.0:
            raise BadInput(f"recompute is a fraction of the document tokens from 0 to 1, got {recompute}")
        t0 = time.perf_counter()
        caches = make_prompt_cache(loaded.model, scheme, verdicts=self.models.verdicts(loaded))
        check_composable(loaded.model, caches)
        check_recompute(loaded.model, recompute)  # before any document is stored
        prefix = prefix_tokens(loaded, system)
        # A document given many times is restored once: its decoded K/V serve every place it sits
        # (100 copies of one chunk were 100 restores held at once, issue 27).
        order = [("name", d.name) if d.name is not None else ("text", d.text) for d in documents]
        distinct = {key: self._chunk_source(loaded, scheme, prefix, *key) for key in dict.fromkeys(order)}
        chunk_tokens = [len(distinct[key][0]) for key in order]
        estimate = composition_bytes(ModelShape.of(loaded.model), len(prefix), chunk_tokens,
                                     [len(tokens) for tokens, _, _ in distinct.values()],
                                     question=len(question or ()), recompute=recompute, step=self.prefiller.chunk)
        check_budget(estimate, self.store.config.compose_budget_bytes, documents=len(documents),
                     tokens=len(prefix) + sum(chunk_tokens))
        found = {}
        for key, (chunk, name, read) in distinct.items():
            info, kv = self.ensure_chunk(loaded, scheme, prefix, chunk, name, read=read)
            if kv is None and recompute < 1.0:
                # Read back now: storing the next document may evict this one under the LMDB
                # budget (two new documents over it failed every time with NotFound).
                kv = self._stored_kv(loaded, prefix, chunk, info)
            found[key] = (info, kv)
        infos = [found[key][0] for key in order]
        tokens = prefix + [t for key in order for t in distinct[key][0]]
        if recompute >= 1.0:
            self.prefiller.prefill(loaded, caches, tokens)
            return ComposedContext(caches, tokens, infos, 0, len(tokens) - len(prefix), time.perf_counter() - t0,
                                   estimate)
        composed = compose(loaded.model, [found[key][1] for key in order], recompute, question=question,
                           windows=window_sizes(caches))
        fresh = fresh_tokens(composed, [found[key][1] for key in order], [info.stored for info in infos])
        del found  # the chunks' K/V are in `composed` now
        fill_caches(caches, composed)
        return ComposedContext(caches, composed.tokens, infos, composed.reused - fresh, composed.recomputed,
                               time.perf_counter() - t0, estimate, fresh)

    def _chunk_source(self, loaded: LoadedModel, scheme: str, prefix: list[int], kind: str,
                      value: str) -> tuple[list[int], str | None, Manifest | None]:
        """A document's chunk tokens, the entry name to keep it under (None: its address) and,
        for a chunk named by the request and kept under that name, the version read."""
        if kind == "text":
            if not value.strip():  # it would be stored as a chunk of the template's separators alone
                raise BadInput("a document is empty: nothing to compose")
            return loaded.prompt.document_tokens(loaded.tokenizer, value), None, None
        manifest, tokens = self._named(loaded, scheme, value)
        if list(manifest.tokens[:len(manifest.tokens) - len(tokens)]) != prefix:
            return tokens, None, None
        return tokens, value, manifest

    def _stored_kv(self, loaded: LoadedModel, prefix: list[int], tokens: list[int], info: ChunkInfo) -> ChunkKV:
        """The K/V of chunk `info`, stored just now, read back from the store."""
        try:
            manifest = self.store.get(info.name)
        except NotFound:
            manifest = None
        if manifest is None or list(manifest.tokens) != prefix + tokens:
            raise ConflictError(f"chunk {info.name} was replaced or removed while this request stored it: ask again")
        kv = self.load_chunk(loaded, manifest, prefix, tokens)
        if kv is None:
            raise CorruptBlock(f"chunk {info.name} was stored just now but cannot be read back: run `tqstore verify`")
        return kv

    def ask_documents(self, loaded: LoadedModel, documents: Sequence[Document], question: str, *,
                      scheme: str | None = None, system: str | None = None, recompute: float = DEFAULT_RECOMPUTE,
                      **options) -> DocumentsAnswer:
        """Answer `question` over `documents` in the given order, reusing each stored chunk's K/V
        wherever it sits; `recompute` (0 to 1) is the share of chunk tokens recomputed in context.
        The scheme is `scheme`, else the first named chunk's, else the store's default. Options as
        `Answerer.generation`."""
        if scheme is None:
            named = next((d.name for d in documents if d.name is not None), None)
            scheme = self.store.get(named).scheme if named else self.store.config.default_scheme
        scheme = scheme_name(scheme)
        question_tokens = loaded.prompt.after_documents_tokens(loaded.tokenizer, question)
        context = self.composed_caches(loaded, documents, scheme, system=system, recompute=recompute,
                                       question=question_tokens)
        answer = self.answerer.generate_composed(loaded, scheme, context.caches, context.tokens, question_tokens,
                                                 context.seconds, **options)
        if recompute >= 1.0:
            reused, recomputed, prefilled = 0, 0, len(context.tokens) + len(question_tokens)
        else:
            reused, recomputed = context.reused, context.recomputed
            prefilled = len(question_tokens) + context.fresh
        return DocumentsAnswer(answer, context.chunks, reused, recomputed, prefilled, context.seconds,
                               context.estimated_bytes)
