"""Moving one entry through a single file: tqstore's portable bundle, or mlx-lm's prompt-cache file.

    export_bundle(store, "contract", "contract.tqb")      # manifest + every object, one file
    import_bundle(store, "contract.tqb", "contract")      # verified in full, then published
    export_mlx_lm(store, "contract", "contract.safetensors")  # raw / affine entries only
    import_mlx_lm(engine, "cache.safetensors", "contract", model="./Qwen2.5-0.5B", text=document)

A bundle (tqstore.exchange.bundle, docs/format.md) holds the entry's manifest and the exact stored bytes
of its objects, so an import publishes the same entry as a `pull` would, by the same path
(tqstore.store.publish): every object is verified against what the manifest expects before
anything is written, objects go to the LMDB tier first and the manifest last (under the home
lock), so a failed import leaves nothing visible.

An mlx-lm prompt-cache file holds caches but no token ids; tqstore writes them into the file's
metadata on export, and a file made elsewhere (mlx_lm.cache_prompt) needs the text it was made
from to recover them.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tqstore.exchange.bundle import BUNDLE_MAGIC, read_bundle, write_bundle
from tqstore.errors import BadInput, ConflictError, IdentityMismatch, NotFound, TruncatedData, UnsupportedCache
from tqstore.format.manifest import Manifest
from tqstore.names import validate_name
from tqstore.store.publish import Batch, publish
from tqstore.store.object_checks import Want, check_digest, decode, wants_for

if TYPE_CHECKING:
    from tqstore.engine.engine import Engine
    from tqstore.store.store import Store

__all__ = ["ExportResult", "ImportResult", "MLX_LM_SUFFIX", "MODEL_KEY", "TOKENS_KEY", "export_bundle", "export_mlx_lm",
           "import_bundle", "import_mlx_lm", "is_bundle"]

# mlx-lm file metadata written on export (no dots in keys: mlx-lm would nest them): the token ids
# as a JSON list, and the model identity digest the caches belong to.
TOKENS_KEY = "tqstore_tokens"
MODEL_KEY = "tqstore_model"
MLX_LM_SUFFIX = ".safetensors"  # mlx.load picks the file format by the suffix


@dataclass(frozen=True)
class ExportResult:
    """What an export wrote."""

    name: str
    path: str
    format: str  # "bundle" or "mlx-lm"
    tokens: int
    bytes: int  # size of the file


@dataclass(frozen=True)
class ImportResult:
    """What an import stored."""

    name: str
    path: str
    format: str  # "bundle" or "mlx-lm"
    tokens: int
    scheme: str
    blocks: int  # token blocks of the entry
    new_blocks: int  # blocks written (the others were in the store already)
    evicted: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()


def is_bundle(path: str | os.PathLike) -> bool:
    """Whether the file starts with the bundle magic."""
    with open(path, "rb") as f:
        return f.read(len(BUNDLE_MAGIC)) == BUNDLE_MAGIC


# --- bundles -----------------------------------------------------------------------------------


def export_bundle(store: Store, name: str, path: str | os.PathLike) -> ExportResult:
    """Write local entry `name` with every object it uses to `path`, atomically.

    The objects are the exact bytes the LMDB tier holds, each checked against the digest the
    manifest records; pins and the bucket's etag (local bookkeeping) are left out. NotFound for
    an entry whose TTL has run out (a pinned one too: the bundle would arrive expired).
    """
    tiers = store.tiers
    manifest = store.get(name)
    # An import would refuse it: better said here, where the entry can still be saved again.
    if manifest.lapsed(time.time()):
        raise NotFound(f"{manifest.lapse_reason('a bundle')}: nothing was exported; save it again"
                       + (" without --ttl to export it" if manifest.pinned else " (tqstore gc removes expired entries)"))
    objects = {}
    for ref in manifest.objects:
        payload = tiers.lmdb.get_object(ref.key)  # CorruptBlock if its segments are damaged
        if payload is None:
            raise NotFound(f"entry {name} cannot be exported: object {ref.key.hex()[:12]} is missing from the store "
                           "(tqstore verify lists the damage); save or pull the entry again")
        check_digest(payload, ref, f"the stored object {ref.key.hex()[:12]} of {name}")
        objects[ref.key] = payload
    write_bundle(path, manifest.replace(pinned=False, remote_etag=None).to_bytes(), objects)
    return ExportResult(name, str(path), "bundle", len(manifest.tokens), os.path.getsize(path))


def import_bundle(store: Store, path: str | os.PathLike, name: str | None = None) -> ImportResult:
    """Publish the entry in bundle `path` as `name` (default: its own name) in the LMDB tier.

    Every object is verified (bundle digests, the manifest's digests, then format, identity,
    tokens and keys) before anything is written; then the entry is published as put and pull
    publish (tqstore.store.publish: the budget enforced before and after). A local entry of
    that name is replaced (its pin is kept). ConflictError when this store holds the entry's
    first block from another save; NotFound when the entry's TTL has run out.
    """
    manifest_bytes, payloads = read_bundle(path)
    manifest = Manifest.from_bytes(manifest_bytes)
    name = validate_name(manifest.name if name is None else name)
    manifest = manifest.replace(name=name, pinned=False, remote_etag=None)
    # Published, it would never be matched or loaded, could evict live entries, and the next gc deletes it.
    if manifest.expired(time.time()):
        raise NotFound(f"the entry in {path} expired at {time.ctime(manifest.expires)}: nothing was imported (every "
                       "export of that save carries its TTL): save the text again and export that")
    wants = wants_for(manifest, len(manifest.blocks), remote=False)
    for want, ref in zip(wants, manifest.objects):
        payload = payloads.get(ref.key)
        if payload is None:
            raise TruncatedData(f"{path} lacks the {want.kind} {ref.key.hex()[:12]} its manifest lists: export the "
                                "entry again")
        check_digest(payload, ref, f"the {want.kind} {ref.key.hex()[:12]} in {path}")
        try:
            decode(payload, want)
        except ConflictError as exc:
            raise ConflictError(f"{path} does not hold one save's objects ({exc}): export the entry again") from None
    published = publish(store.tiers, name, wants, _Bundle(manifest, payloads),
                        lambda digests, old: manifest.with_digests(digests).replace(
                            pinned=old is not None and old.pinned))
    new_blocks = sum(1 for ref in manifest.blocks if ref.key in published.written)
    return ImportResult(name, str(path), "bundle", len(manifest.tokens), manifest.scheme, len(manifest.blocks),
                        new_blocks, published.evicted, published.warnings)


class _Bundle:
    """A bundle's objects, all verified already, as a publish source."""

    action = "import"
    advice = "remove those entries (tqstore rm) and import again"

    def __init__(self, manifest: Manifest, payloads: dict[bytes, bytes]) -> None:
        self.refs = {ref.key: ref for ref in manifest.objects}
        self.data = payloads

    def expected(self, want: Want) -> str | None:
        """The digest the bundle's manifest records."""
        return self.refs[want.key].sha256

    def payloads(self, missing: list[Want], kept: object) -> Iterator[Batch]:
        """The missing objects, in one batch (the bundle is in memory already)."""
        yield {w.key: (self.data[w.key], self.refs[w.key].sha256) for w in missing}


# --- mlx-lm prompt-cache files -------------------------------------------------------------------


def export_mlx_lm(store: Store, name: str, path: str | os.PathLike) -> ExportResult:
    """Write entry `name` as a file `mlx_lm.models.cache.load_prompt_cache` reads (entries of
    scheme raw or affine only: mlx-lm has no cache class for TurboQuant layers). The token ids
    go into the file's metadata, so `import_mlx_lm` needs no text for it."""
    from turboquant import Format, parse_scheme

    from tqstore.exchange.mlx_lm import export_prompt_cache

    if Path(path).suffix != MLX_LM_SUFFIX:
        raise BadInput(f"mlx-lm prompt-cache files end in {MLX_LM_SUFFIX} (mlx picks the format by it): {path}")
    manifest = store.get(name)
    spec = parse_scheme(manifest.scheme)
    redo = (f"re-save it with --scheme raw or --scheme affine8 (tqstore save {name} --scheme raw ...) to export it "
            "for mlx-lm")
    if Format.TURBO in (spec.key_format, spec.value_format):
        raise UnsupportedCache(f"entry {name} is stored as {manifest.scheme}, whose TurboQuant layers mlx-lm cannot "
                               f"read: {redo}")
    snapshot, _ = store.load(name)
    metadata = {TOKENS_KEY: json.dumps(list(manifest.tokens)), MODEL_KEY: manifest.model_digest.hex(),
                "model": manifest.model_ref}
    try:
        export_prompt_cache(path, snapshot, metadata)
    except UnsupportedCache as exc:
        # A raw entry fails for its layer kinds, which no re-save changes: a bundle keeps them.
        advice = (f"export it as a bundle (tqstore export {name} FILE.tqb)" if manifest.scheme == "raw" else redo)
        raise UnsupportedCache(f"entry {name} cannot be exported for mlx-lm ({exc}): {advice}") from None
    return ExportResult(name, str(path), "mlx-lm", len(manifest.tokens), os.path.getsize(path))


def import_mlx_lm(engine: Engine, path: str | os.PathLike, name: str, *, model: str, scheme: str | None = None,
                  text: str | None = None, system: str | None = None, adapter_path: str | None = None) -> ImportResult:
    """Store the caches of mlx-lm prompt-cache file `path` as entry `name` for `model`.

    The token ids come from `text`, the document the file was made from (framed as `tqstore
    save` and `mlx_lm.cache_prompt` frame it), or else from the metadata of a file tqstore
    exported, which also records the model identity (checked); where both are there, BadInput
    unless they are the same tokens.
    With `scheme` the raw layers are compressed to it; without, the entry keeps the file's
    layout (raw, or affine when the file's quantization is the scheme's own).
    """
    from tqstore.exchange.mlx_lm import compress_snapshot, import_prompt_cache

    validate_name(name)
    loaded = engine.model(model, adapter_path)
    imported = import_prompt_cache(path)
    snap = imported.snapshot
    made_with = imported.metadata.get(MODEL_KEY)
    if made_with is not None and made_with != loaded.identity.hexdigest:
        raise IdentityMismatch(f"{path} was exported from an entry of another model "
                               f"({imported.metadata.get('model')}): pass the model it was made with (--model)")
    tokens = _file_tokens(imported.metadata, loaded, text, system, path)
    if len(tokens) != snap.offset:
        raise BadInput(f"{path} holds {snap.offset} tokens, but the text frames as {len(tokens)} tokens for this "
                       "model: pass the exact text the cache was made from (and --system if it had one)")
    _check_layers(snap, loaded.model, path)
    file_snap = snap
    if scheme is not None:
        from turboquant import NotNative, parse_scheme

        scheme = parse_scheme(scheme).name
        try:
            snap = compress_snapshot(snap, loaded.model, scheme, tokens=tokens)
        except NotNative as exc:  # a quantized file: only raw caches compress (it was an internal error)
            raise UnsupportedCache(f"{path}: {exc}; import it without --scheme to keep its own layout") from None
    else:
        scheme = _file_scheme(snap, loaded.model, path, engine.models.verdicts(loaded))
    metadata = {"imported.from": Path(path).name}
    if scheme == "raw" or snap is not file_snap:  # the file's caches are uncompressed: the reference
        metadata |= _receipt(loaded, file_snap, snap, tokens)
    # An mlx-lm cache file holds its sliding windows as rings: the entry keeps them whole.
    codec = engine.codec_identity(loaded, scheme, "whole")
    result = engine.store.put(name, snap, tokens, model=loaded.identity, codec=codec,
                              model_ref=loaded.entry_ref, adapter_path=loaded.adapter_path, prefill_seconds=0.0,
                              metadata=loaded.entry_metadata(metadata))
    return ImportResult(name, str(path), "mlx-lm", len(tokens), scheme, len(result.manifest.blocks),
                        result.new_blocks, result.evicted, result.warnings)


def _receipt(loaded, file_snap, stored, tokens: list[int]) -> dict[str, str]:
    """The quality receipt of an import (tqstore/engine/receipts.py): the context's last tokens
    re-scored against the file's uncompressed caches and against the entry as stored; {} where
    the caches cannot drop tokens (recurrent layers, full windows)."""
    from turboquant import restore

    from tqstore.engine import receipts

    reference_caches = restore(file_snap)
    probe = receipts.probe_length(len(tokens), reference_caches, recurrent=False)
    if not probe:
        return {}
    reference, seconds = receipts.reference(loaded.model, reference_caches, tokens[-probe:])
    return receipts.measure(loaded.model, restore(stored), tokens[-probe:], reference, seconds).metadata()


def _file_tokens(metadata: dict[str, str], loaded, text: str | None, system: str | None, path) -> list[int]:
    """The token ids of the file's caches: the ones tqstore recorded on export, or `text` framed
    for this model; both given, they must agree."""
    raw = metadata.get(TOKENS_KEY)
    recorded = None
    if raw is not None:
        try:
            recorded = json.loads(raw)
        except ValueError:
            pass
        if not isinstance(recorded, list) or not all(type(t) is int and t >= 0 for t in recorded):
            recorded = None
    if text is not None:
        tokens = loaded.prompt.context_tokens(loaded.tokenizer, text, system)
        # Stored under other tokens, the file's K/V would be reused for a text it was never computed from.
        if recorded is not None and tokens != recorded:
            raise BadInput(f"the text given is not the one {path} was made from (the file records its tokens): "
                           f"{_first_difference(tokens, recorded)}; pass the exact text the cache was made from "
                           "(and --system if it had one), or leave out --prompt to use the file's tokens")
        return tokens
    if raw is None:
        raise BadInput(f"{path} does not record its token ids (mlx-lm files never do): pass the text it was made from "
                       "with --prompt or --prompt-file")
    if recorded is None:
        raise BadInput(f"{path}: its {TOKENS_KEY} metadata is not a list of token ids; pass the text it was made from "
                       "with --prompt or --prompt-file")
    return recorded


def _first_difference(tokens: list[int], recorded: list[int]) -> str:
    for i, (mine, theirs) in enumerate(zip(tokens, recorded)):
        if mine != theirs:
            return f"token {i} of {len(recorded)} is {theirs} in the file, {mine} in the framed text"
    return f"the file records {len(recorded)} tokens, the framed text is {len(tokens)} tokens"


def _check_layers(snap, model, path) -> None:
    """The file's layers are the model's: same count, KV heads and head dims."""
    from turboquant import probe_kv_shapes

    shapes = probe_kv_shapes(model)
    if len(shapes) != len(snap.layers):
        raise IdentityMismatch(f"{path} holds {len(snap.layers)} layers, the model has {len(shapes)}: pass the model "
                               "the cache was made with (--model)")
    for i, (shape, record) in enumerate(zip(shapes, snap.layers)):
        keys = record.arrays.get("keys")
        if shape is not None and keys is not None and (keys.shape[1], keys.shape[3]) != shape[:2]:
            raise IdentityMismatch(f"{path}: layer {i} holds {keys.shape[1]} KV heads of dim {keys.shape[3]}, the "
                                   f"model has {shape[0]} of dim {shape[1]}: pass the model the cache was made with")


def _file_scheme(snap, model, path, verdicts) -> str:
    """raw for native layers; affineN when every quantized layer is exactly what that scheme makes
    (`verdicts`: the model's kept plan verdicts, as every call that makes its caches takes them)."""
    from turboquant import make_prompt_cache
    from turboquant.records import Layout

    layouts = {r.layout for r in snap.layers}
    if layouts <= {Layout.RAW, Layout.ROTATING}:
        return "raw"
    bits = {r.config.get("key_bits") for r in snap.layers if r.layout is Layout.AFFINE}
    if layouts <= {Layout.AFFINE, Layout.ROTATING} and len(bits) == 1:
        scheme = f"affine{bits.pop()}"
        fresh = make_prompt_cache(model, scheme, verdicts=verdicts)
        if all(r.config == c.plan.meta() for r, c in zip(snap.layers, fresh) if r.layout is Layout.AFFINE):
            return scheme
    raise UnsupportedCache(f"{path}: its quantized layers are not what a tqstore scheme makes for this model (bits, "
                           "group size or dtype differ): make the cache without kv_bits, then import it with --scheme")
