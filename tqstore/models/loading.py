"""Loading models for the engine, and the local registry from model identity to folder.

An entry records the model it was made with (a path or a repo id, and its identity digest).
A model named by a Hugging Face repo id is recorded by that id, not by the snapshot folder the
hub cache resolved it to: the id is what finds the model in another machine's hub cache.
On another machine a path may not exist: the registry maps identity digests to the folders
this machine has loaded, so a pulled entry finds its model, or says to pass --model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

from tqstore.durable import write_cache_file
from tqstore.errors import ConfigError, IdentityMismatch, NotFound, TqstoreError
from tqstore.models.identity import ModelIdentity, describe_difference, legacy_identity
from tqstore.models.light import load_light as light_model, remember as remember_tokenizer
from tqstore.models.prompting import PromptFormat, prompt_format

REGISTRY_FILE = "models.json"
REVISION_KEY = "tqstore.model_revision"  # entry metadata: the hub commit of a model named by repo id
COMPUTE_DTYPES = ("auto", "float32", "float16", "bfloat16")


@dataclass
class LoadedModel:
    """A model ready for the engine: weights, tokenizer, identity and prompt framing."""

    model: object
    tokenizer: object
    identity: ModelIdentity
    ref: str  # what the user passed: a folder or a repo id
    path: Path
    adapter_path: str | None
    prompt: PromptFormat
    repo: str | None = None  # the Hugging Face repo id the model was resolved from, if any
    revision: str | None = None  # the hub commit of that repo's snapshot, where known

    @property
    def entry_ref(self) -> str:
        """What an entry records as its model: the repo id, else the folder."""
        return self.repo or str(self.path)

    def entry_metadata(self, metadata: dict[str, str] | None = None) -> dict[str, str] | None:
        """`metadata` with the hub revision the model came from, where there is one."""
        if self.revision is None:
            return metadata
        return {REVISION_KEY: self.revision, **(metadata or {})}


def compute_dtype(choice: str = "auto") -> mx.Dtype | None:
    """The dtype models run in: float32 on the CPU (MLX's CPU half-precision matmul is very slow),
    the checkpoint's own dtype on a GPU (None = keep)."""
    if choice not in COMPUTE_DTYPES:
        raise ConfigError(f"compute dtype must be one of {', '.join(COMPUTE_DTYPES)}, got {choice!r}")
    if choice == "auto":
        return mx.float32 if mx.default_device() == mx.cpu else None
    return getattr(mx, choice)


def resolve_model_path(ref: str) -> Path:
    """A local folder as is; a repo id from the local hub cache, or downloaded when allowed."""
    path = Path(ref).expanduser()
    if path.exists():
        if not (path / "config.json").exists():
            raise NotFound(f"{path} is not a model folder (no config.json): pass the folder holding the model")
        return path
    if ref.count("/") != 1 or ref.startswith((".", "/", "~")):
        raise NotFound(f"model {ref!r} not found: pass a local model folder or a Hugging Face repo id "
                       "(owner/name), or run `tqstore model install qwen2.5-coder-0.5b`")
    try:
        from huggingface_hub import snapshot_download
        from mlx_lm.utils import DEFAULT_ALLOW_PATTERNS

        try:
            return Path(snapshot_download(ref, local_files_only=True, allow_patterns=DEFAULT_ALLOW_PATTERNS))
        except Exception:  # noqa: BLE001 - not cached yet: try the network below
            return Path(snapshot_download(ref, allow_patterns=DEFAULT_ALLOW_PATTERNS))
    except Exception as e:  # noqa: BLE001 - any hub failure is one user-facing message
        raise NotFound(f"could not get model {ref!r} from the Hugging Face hub ({type(e).__name__}); "
                       "without network access pass a local folder, or run "
                       "`tqstore model install qwen2.5-coder-0.5b`") from None


def hub_repo(ref: str, path: Path) -> tuple[str, str | None] | None:
    """(repo id, commit) of a model the hub cache holds, None for any other folder: `ref` itself
    where it is a repo id (no folder of that name here), or the repo of a hub cache's snapshot
    folder (`.../models--owner--name/snapshots/<commit>`, which is also where the registry finds
    a repo's model again; the hub refuses "--" inside ids, so the name splits one way)."""
    path = path.resolve()
    commit = path.name if path.parent.name == "snapshots" else None
    if not Path(ref).expanduser().exists():
        return ref, commit
    repo = snapshot_repo(path)
    return (repo, commit) if repo is not None else None


def snapshot_repo(path: str | Path) -> str | None:
    """The repo id of a hub cache's snapshot folder path (`.../models--owner--name/snapshots/<commit>`),
    whether or not it exists here; None for any other path."""
    path = Path(path)
    cached = path.parent.parent.name
    if path.parent.name == "snapshots" and cached.startswith("models--"):
        owner_name = cached[len("models--"):].split("--")
        if len(owner_name) == 2 and all(owner_name):
            return "/".join(owner_name)
    return None


def load_model(ref: str, *, cache_dir: Path, adapter_path: str | None = None, dtype: str = "auto",
               light: bool = False) -> LoadedModel:
    """Load a model with mlx-lm (optionally with a LoRA adapter) and compute its identity.
    `light`: without transformers where the folder allows it (models/light.py), and record
    its tokenizer for the next light load when it goes through mlx-lm."""
    path = resolve_model_path(ref)
    if adapter_path is not None:
        if not Path(adapter_path).expanduser().exists():
            raise NotFound(f"adapter {adapter_path} not found")
        # Absolute, as the model's path is: entries and models.json record it for later commands,
        # which may run in another directory.
        adapter_path = str(Path(adapter_path).expanduser().resolve())
    found = light_model(path, cache_dir) if light and adapter_path is None else None
    try:
        if found is not None:
            model, tokenizer = found
        else:
            from mlx_lm import load

            model, tokenizer = load(str(path), adapter_path=adapter_path)
    except (FileNotFoundError, ValueError) as e:
        raise TqstoreError(f"mlx-lm cannot load {path}: {e}") from None
    if found is None and light and adapter_path is None:
        remember_tokenizer(path, cache_dir, tokenizer)
    target = compute_dtype(dtype)
    if target is not None:
        model.set_dtype(target)
    kv_dtype = str(target or _parameter_dtype(model)).rsplit(".", 1)[-1]
    repo, revision = hub_repo(ref, path) or (None, None)
    identity = ModelIdentity.from_path(path, cache_dir, adapter_path=adapter_path, kv_dtype=kv_dtype, source=repo)
    return LoadedModel(model, tokenizer, identity, ref, path.resolve(), adapter_path, prompt_format(tokenizer),
                       repo=repo, revision=revision)


def _parameter_dtype(model) -> mx.Dtype:
    from mlx.utils import tree_flatten

    for _, p in tree_flatten(model.parameters()):
        if mx.issubdtype(p.dtype, mx.floating):
            return p.dtype
    return mx.float32


class ModelRegistry:
    """identity digest -> {path, ref, adapter} of models this machine has loaded (a JSON file)."""

    def __init__(self, home: Path):
        self.path = Path(home) / REGISTRY_FILE

    def _read(self) -> dict:
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as e:
            raise ConfigError(f"{self.path} is unreadable ({e}); delete it, it is rebuilt as models load") from None
        return data if isinstance(data, dict) else {}

    def remember(self, loaded: LoadedModel) -> None:
        """Record where `loaded` lives. Written only when that changes: loading a known model is a
        read, and reads must work on a full disk; a record that cannot be written for want of
        space is skipped (it only helps find the model of a pulled entry)."""
        data = self._read()
        record = {"path": str(loaded.path), "ref": loaded.ref, "adapter": loaded.adapter_path}
        if data.get(loaded.identity.hexdigest) == record:
            return
        data[loaded.identity.hexdigest] = record
        write_cache_file(self.path, json.dumps(data, indent=1, sort_keys=True).encode())

    def find(self, digest_hex: str) -> dict | None:
        return self._read().get(digest_hex)


def check_identity(loaded: LoadedModel, expected: ModelIdentity, entry: str) -> None:
    """Refuse a model that is not the one an entry was made with, naming what differs."""
    if loaded.identity.digest == expected.digest:
        return
    if legacy_identity(loaded.identity).digest == expected.digest:
        # Stored before the identity covered the whole config: the same weights and KV shape,
        # but nothing says the rest of the config (norms, activations, quantization) is the same.
        raise IdentityMismatch(f"entry {entry!r} was saved by an older tqstore, whose model identity covered only "
                               f"the config fields that shape the KV cache, so its cache may not be {loaded.ref}'s: "
                               f"save it again (`tqstore save {entry} --model {loaded.ref} ...`)")
    differences = describe_difference(expected, loaded.identity)
    if all(d.startswith("kv_dtype") for d in differences):
        # The same model computing in another dtype: naming another model misled.
        raise IdentityMismatch(f"entry {entry!r} was saved with this model computing in {expected.kv_dtype}, and "
                               f"{loaded.ref} is loaded in {loaded.identity.kv_dtype} here (kv_dtype): load it in "
                               f"{expected.kv_dtype} (the engine's dtype), or save the entry again in this one")
    differences = "; ".join(differences[:6])
    raise IdentityMismatch(f"entry {entry!r} was saved with another model ({expected.source or 'unknown'}); "
                           f"{loaded.ref} differs: {differences}. Pass the model it was saved with (--model)")
