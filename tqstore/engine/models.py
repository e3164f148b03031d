"""The models an engine has loaded, and the identity checks between models, schemes and entries.

A model folder is loaded once per process (and remembered in the home's registry, so an entry
whose folder moved is still found by identity); a scheme's codec identity on a model is built
once from fresh caches. An entry is used only by a model and codec with the identities it
records.
"""

from __future__ import annotations

from pathlib import Path

from turboquant import WINDOW_MODES, codec_snapshot, parse_scheme

from tqstore.errors import BadInput, IdentityMismatch, NotFound, TqstoreError
from tqstore.format.manifest import Manifest
from tqstore.models.identity import CodecIdentity
from tqstore.models.loading import LoadedModel, ModelRegistry, check_identity, load_model, snapshot_repo
from tqstore.models.verdicts import FileVerdicts
from tqstore.store.store import Store


def scheme_name(scheme: str) -> str:
    """The canonical name of `scheme` (e.g. "turbo4" for "TURBO4"), else BadInput naming it."""
    try:
        return parse_scheme(scheme).name
    except ValueError as exc:
        raise BadInput(str(exc)) from None


def window_mode(mode: str) -> str:
    """`mode` if it is a way to keep window layers ("token" or "whole"), else BadInput."""
    if mode not in WINDOW_MODES:
        raise BadInput(f"windows must be one of {', '.join(WINDOW_MODES)}, got {mode!r}")
    return mode


class LoadedModels:
    """Models loaded from folders or repo ids (each once), and the codec identities of schemes on
    them, for entries of one store. `windows` is how new entries keep their window layers."""

    def __init__(self, store: Store, *, dtype: str, light: bool, windows: str):
        self.store = store
        self.dtype = dtype
        self.light = light
        self.windows = window_mode(windows)
        self.registry = ModelRegistry(store.config.home)
        self._models: dict[tuple[str, str | None], LoadedModel] = {}
        self._codecs: dict[tuple[bytes, str, str], CodecIdentity] = {}
        self._verdicts: dict[bytes, FileVerdicts] = {}

    def model(self, ref: str, adapter_path: str | None = None) -> LoadedModel:
        """Load (once per process) a model folder or repo id, and remember where it lives."""
        key = (ref, adapter_path)
        if key not in self._models:
            cache = Path(self.store.config.home) / "cache"
            loaded = load_model(ref, cache_dir=cache, adapter_path=adapter_path, dtype=self.dtype, light=self.light)
            self.registry.remember(loaded)
            self._models[key] = loaded
        return self._models[key]

    def use_model(self, loaded: LoadedModel) -> None:
        """Share a model another engine (or the caller) already loaded."""
        self._models[(loaded.ref, loaded.adapter_path)] = loaded

    def model_for(self, name: str, ref: str | None = None) -> LoadedModel:
        """The model an entry was saved with: `ref` if given, else the recorded one, else the
        registry's folder for its identity; refuses a model with another identity."""
        manifest = self.store.get(name)
        expected = manifest.model_identity
        if ref is None:
            ref, adapter = manifest.model_ref, manifest.adapter_path
            if not Path(ref).exists():
                known = self.registry.find(expected.hexdigest)
                if known is not None and Path(known["path"]).exists():
                    ref, adapter = known["path"], known.get("adapter")
                elif snapshot_repo(ref) is not None:  # recorded by another machine's hub cache folder
                    ref = snapshot_repo(ref)
                elif ref.count("/") != 1 or ref.startswith("/"):
                    raise NotFound(f"model {expected.source or ref!r} of entry {name!r} not found here: "
                                   "pass --model")
        else:
            adapter = manifest.adapter_path
        loaded = self.model(ref, adapter)
        check_identity(loaded, expected, name)
        return loaded

    def codec_identity(self, loaded: LoadedModel, scheme: str, windows: str | None = None) -> CodecIdentity:
        """The codec identity of `scheme` on this model (data-independent: from the layers' plans,
        `turboquant.codec_snapshot`), its windows kept as `windows` says (default the engine's)."""
        windows = window_mode(windows or self.windows)
        key = (loaded.identity.digest, scheme, windows)
        if key not in self._codecs:
            described = codec_snapshot(loaded.model, scheme, windows=windows, verdicts=self.verdicts(loaded))
            self._codecs[key] = CodecIdentity.from_snapshot(described, scheme)
        return self._codecs[key]

    def verdicts(self, loaded: LoadedModel) -> FileVerdicts:
        """Where what the plan's check learns about this model is kept for the next process:
        handed to every turboquant call that makes (or describes) its caches."""
        book = self._verdicts.get(loaded.identity.digest)
        if book is None:
            folder = Path(self.store.config.home) / "cache" / "verdicts"
            book = self._verdicts[loaded.identity.digest] = FileVerdicts(folder, loaded.identity.hexdigest)
        return book

    def entry_scheme(self, manifest: Manifest, loaded: LoadedModel) -> tuple[str, str]:
        """(scheme, windows) of an entry, once its codec digest agrees with them on this model: a
        manifest whose scheme was edited would otherwise miss every block and prefill cold under
        another scheme, silently. `windows` is how the entry keeps its window layers (entries saved
        before they could be kept by token keep them whole)."""
        for windows in (self.windows, *(m for m in WINDOW_MODES if m != self.windows)):
            try:
                codec = self.codec_identity(loaded, manifest.scheme, windows)
            except (ValueError, TqstoreError):
                codec = None
            if codec is not None and codec.digest == manifest.codec_digest:
                return manifest.scheme, windows
        raise IdentityMismatch(
            f"entry {manifest.name!r} says scheme {manifest.scheme!r}, but its codec digest is not that scheme's "
            "on this model: the manifest was edited or damaged (or written by a tqstore with another codec). "
            f"Run `tqstore verify`, then save the entry again")
