"""Bytes that must come out the same in every process and on every machine: the canonical JSON
that identities, keys and headers hash, and the raw little-endian bytes of tensors (bfloat16 and
NaN payloads bit for bit)."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import mlx.core as mx
import numpy as np

# (mx dtype, safetensors code, unsigned dtype of the same width) per dtype name.
DTYPES: dict[str, tuple[mx.Dtype, str, mx.Dtype]] = {
    "float16": (mx.float16, "F16", mx.uint16),
    "bfloat16": (mx.bfloat16, "BF16", mx.uint16),
    "float32": (mx.float32, "F32", mx.uint32),
    "uint8": (mx.uint8, "U8", mx.uint8),
    "uint16": (mx.uint16, "U16", mx.uint16),
    "uint32": (mx.uint32, "U32", mx.uint32),
    "uint64": (mx.uint64, "U64", mx.uint64),
    "int8": (mx.int8, "I8", mx.uint8),
    "int16": (mx.int16, "I16", mx.uint16),
    "int32": (mx.int32, "I32", mx.uint32),
    "int64": (mx.int64, "I64", mx.uint64),
}
_NP_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def canonical_json(obj: Any) -> bytes:
    """The canonical JSON bytes that identities and headers hash (sorted keys, compact, ASCII)."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()


def dtype_name(dtype: mx.Dtype) -> str:
    """'float16', 'bfloat16', ... for an MLX dtype."""
    return str(dtype).rsplit(".", 1)[-1]


def tensor_bytes(a: mx.array) -> np.ndarray:
    """The array's bytes, C order, little-endian, as a flat uint8 numpy array.

    Goes through an unsigned view of the same width, so bfloat16 (which numpy lacks) and NaN
    payloads come out bit for bit.
    """
    name = dtype_name(a.dtype)
    if name not in DTYPES:
        raise ValueError(f"dtype {name} cannot be stored (supported: {', '.join(DTYPES)})")
    return np.ascontiguousarray(np.asarray(unsigned_view(a))).reshape(-1).view(np.uint8)


def unsigned_view(a: mx.array) -> mx.array:
    """`a` viewed as the unsigned integers of its width (a storable dtype): how bytes are typed
    where bfloat16, which numpy lacks, and NaN payloads must come out bit for bit."""
    unsigned = DTYPES[dtype_name(a.dtype)][2]
    return a if a.dtype == unsigned else a.view(unsigned)


def tensor_from_bytes(data, dtype: str, shape: tuple[int, ...]) -> mx.array:
    """Inverse of `tensor_bytes` (copies `data` into a new MLX array)."""
    mx_dtype, _, unsigned = DTYPES[dtype]
    n = np.frombuffer(data, dtype=_NP_UINT[unsigned.size])
    if n.ctypes.data % unsigned.size:
        n = n.copy()  # safetensors data offsets need not be aligned
    a = mx.array(n.reshape(shape))
    return a if mx_dtype == unsigned else a.view(mx_dtype)


def tensor_summary(a: mx.array) -> dict[str, Any]:
    """{"dtype", "shape", "sha256"}: what identities hash for an array."""
    return {"dtype": dtype_name(a.dtype), "shape": list(a.shape),
            "sha256": hashlib.sha256(tensor_bytes(a)).hexdigest()}
