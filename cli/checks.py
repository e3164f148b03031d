"""The machine checks behind `tqstore selftest`. Each returns a Check; none raises.

- backend: MLX version and device.
- attention: TurboQuant attention over compressed storage (the fused kernel on a GPU, the
  plain-ops path everywhere) against a float64 numpy reference over the same dequantized K/V.
- fsync: a durable write in the home (O_EXCL, fsync or F_FULLFSYNC, rename, folder fsync),
  timed, with the filesystem type: tmpfs loses data at reboot, network filesystems break LMDB.
- blas: the BLAS in use and whether OpenBLAS could be.
- s3: a HEAD of the bucket with the configured endpoint and credentials, when configured.
"""

from __future__ import annotations

import math
import os
import secrets
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqstore.config import Config
from tqstore.durable import fsync_dir, full_fsync

ATTENTION_SCHEMES = ("turbo4", "turbo8v3", "turbo0v4", "affine8")
# Max error relative to the largest output. float32 on the CPU is exact up to rounding; float16
# storage, and float32 matmuls on a GPU (TF32 on CUDA: a 10-bit mantissa), are not. Measured on
# an H200: plain ops in float32 up to 2.7e-3, the CUDA kernel 2e-6; float16 up to 8e-4.
CPU_FLOAT32_TOLERANCE = 1e-4
TOLERANCE = 1e-2
SUSPICIOUS_FSYNC_SECONDS = 20e-6  # a real flush to stable storage takes longer than this
VOLATILE_FS = {"tmpfs", "ramfs"}
NETWORK_FS = {"nfs", "nfs4", "cifs", "smb3", "smbfs", "fuse.sshfs", "9p", "afpfs", "webdav"}


@dataclass
class Check:
    """One check: status ok, warn (works, with a caveat), fail or skip; details for JSON."""

    name: str
    status: str
    detail: str
    data: dict[str, Any] = field(default_factory=dict)


def backend() -> Check:
    import mlx.core as mx

    device = "gpu" if mx.default_device().type == mx.DeviceType.gpu else "cpu"
    gpus = [name for name in ("metal", "cuda") if _available(mx, name)]
    data = {"mlx": mx.__version__, "device": device, "gpu_backends": gpus}
    available = f", GPU backend available: {', '.join(gpus)}" if gpus else ""
    return Check("backend", "ok", f"MLX {mx.__version__}, default device {device}{available}", data)


def _available(mx, backend: str) -> bool:
    """Whether MLX has GPU backend `backend` ("metal", "cuda") and it is usable here."""
    try:
        return bool(getattr(mx, backend).is_available())
    except AttributeError:  # an MLX build without that backend
        return False


def attention() -> Check:
    import mlx.core as mx

    from turboquant import select_backend

    kernel = select_backend()
    gpu = mx.default_device().type == mx.DeviceType.gpu
    dtypes = [mx.float32] + ([mx.float16] if gpu else [])
    worst, where = 0.0, ""
    results = []
    try:
        for dtype in dtypes:
            for scheme in ATTENTION_SCHEMES:
                for L in (1, 4):
                    paths = {"plain": _attention_error(scheme, dtype, L, kernels=False)}
                    if kernel and L == 1:
                        paths[kernel] = _attention_error(scheme, dtype, L, kernels=True)
                    for path, error in paths.items():
                        dtype_name = str(dtype).rsplit(".", 1)[-1]
                        tolerance = CPU_FLOAT32_TOLERANCE if dtype == mx.float32 and not gpu else TOLERANCE
                        relative = error / tolerance
                        results.append({"scheme": scheme, "dtype": dtype_name, "queries": L, "path": path,
                                        "max_error": error, "tolerance": tolerance})
                        if relative > worst:
                            worst, where = relative, f"{scheme} {dtype_name} L={L} {path}"
    except Exception as exc:  # noqa: BLE001 - a crash in the kernels is this check's finding
        return Check("attention", "fail", f"attention raised {type(exc).__name__}: {exc}", {"kernel": kernel})
    paths = f"{kernel} kernel and plain ops" if kernel else "plain ops (no GPU kernel on this device)"
    data = {"kernel": kernel, "results": results}
    if worst > 1:
        return Check("attention", "fail", f"{where} is off the float64 reference by {worst:.1f}x the tolerance", data)
    return Check("attention", "ok", f"{paths} match the float64 reference ({len(results)} cases, worst "
                                    f"{worst:.2f} of the tolerance)", data)


def _attention_error(scheme: str, dtype, L: int, kernels: bool) -> float:
    """Max |attention - float64 reference| / max |reference| on random data with outliers."""
    import mlx.core as mx
    import numpy as np

    from turboquant import TurboQuantKVCache, parse_scheme, plan_layer

    H, R, D, T = 2, 4, 128, 300  # two 256-token storage blocks, GQA 4
    rng = np.random.default_rng(len(scheme) * 10 + L)
    k = rng.standard_normal((1, H, T, D))
    k[..., :3] = k[..., :3] * 4 + 30.0  # outlier channels, like real keys
    v = rng.standard_normal((1, H, T, D)) * 0.5
    q = rng.standard_normal((1, H * R, L, D))
    cache = TurboQuantKVCache(plan_layer(parse_scheme(scheme), H, D, D, dtype))
    cache.update_and_fetch(mx.array(k, dtype=dtype), mx.array(v, dtype=dtype))
    cache.compress()
    queries = mx.array(q, dtype=dtype)
    scale = 1 / math.sqrt(D)
    previous = os.environ.get("TQSTORE_KERNELS")
    os.environ["TQSTORE_KERNELS"] = "1" if kernels else "0"
    try:
        out = np.array(cache.attention(queries, scale).astype(mx.float32)).astype(np.float64)
    finally:
        if previous is None:
            del os.environ["TQSTORE_KERNELS"]
        else:
            os.environ["TQSTORE_KERNELS"] = previous
    kd, vd = (np.array(a.astype(mx.float32)).astype(np.float64) for a in cache.dequantized())
    qd = np.array(queries.astype(mx.float32)).astype(np.float64)
    kd, vd = np.repeat(kd, R, axis=1), np.repeat(vd, R, axis=1)
    scores = qd @ kd.swapaxes(-1, -2) * scale
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    reference = (weights / weights.sum(-1, keepdims=True)) @ vd
    return float(np.abs(out - reference).max() / np.abs(reference).max())


def home_fsync(home: Path) -> Check:
    data: dict[str, Any] = {"home": str(home), "filesystem": _filesystem(home), "f_fullfsync": None}
    try:
        home.mkdir(parents=True, exist_ok=True)
        token = secrets.token_hex(6)
        tmp, final = home / f".selftest-{token}.tmp", home / f".selftest-{token}"
        payload = os.urandom(64 * 1024)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, payload)
            start = time.perf_counter()
            data["f_fullfsync"] = full_fsync(fd)
            data["fsync_seconds"] = time.perf_counter() - start
        finally:
            os.close(fd)
        os.replace(tmp, final)
        fsync_dir(home)
        intact = final.read_bytes() == payload
        final.unlink()
        fsync_dir(home)
    except OSError as exc:
        return Check("fsync", "fail", f"cannot write durably in {home}: {exc.strerror or exc}", data)
    if not intact:
        return Check("fsync", "fail", f"a file written in {home} read back different", data)
    took = f"fsync {data['fsync_seconds'] * 1e3:.2f} ms on {data['filesystem'] or 'unknown filesystem'}"
    if data["f_fullfsync"] is not None:
        took += ", F_FULLFSYNC " + ("honoured" if data["f_fullfsync"] else "refused (plain fsync used)")
    if data["filesystem"] in VOLATILE_FS:
        return Check("fsync", "warn", f"{took}: the home is in memory and is lost at reboot; use --home on a disk",
                     data)
    if data["filesystem"] in NETWORK_FS:
        return Check("fsync", "warn", f"{took}: LMDB's locking is unreliable on network filesystems; keep the home on "
                                      "a local disk", data)
    if data["fsync_seconds"] < SUSPICIOUS_FSYNC_SECONDS:
        return Check("fsync", "warn", f"{took}: too fast for a flush to stable storage; the disk's write cache may "
                                      "not honour it (data written just before a power loss may be lost)", data)
    return Check("fsync", "ok", took, data)


def _filesystem(path: Path) -> str | None:
    """The type of the filesystem holding `path` (Linux: /proc/mounts; None elsewhere)."""
    try:
        mounts = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return None
    target = os.path.realpath(path if path.exists() else path.parent)
    best, kind = "", None
    for line in mounts:
        parts = line.split()
        if len(parts) < 3:
            continue
        point = parts[1].replace("\\040", " ")
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, kind = point, parts[2]
    return kind


def blas() -> Check:
    from tqstore.errors import ConfigError
    from tqstore.models.blas import active_blas, openblas_environment

    active = active_blas()
    data: dict[str, Any] = {"active": active}
    if sys.platform != "linux":
        return Check("blas", "ok", f"{active} (MLX uses Accelerate / Metal on macOS)", data)
    try:
        openblas_environment()
        data["openblas"] = "available"
    except ConfigError as exc:
        data["openblas"] = str(exc)
    hint = "; --blas openblas is available" if active != "openblas" and data["openblas"] == "available" else ""
    return Check("blas", "ok", f"{active}{hint}", data)


def s3(config: Config) -> Check:
    if config.s3_url is None:
        return Check("s3", "skip", "not configured (tqstore config set s3.url s3://BUCKET/PREFIX)")
    from tqstore.errors import ConfigError, CorruptBlock, FormatError, RemoteError
    from tqstore.store.crypto import cipher_from_config
    from tqstore.store.tiers.s3 import S3Tier
    from tqstore.store.tiers.s3_errors import Missing, boto_errors

    where = config.s3_endpoint or "AWS"
    data = {"url": config.s3_url, "endpoint": config.s3_endpoint, "encryption": None}
    try:
        cipher = cipher_from_config(config)
        data["encryption"] = None if cipher is None else cipher.source
        # Few attempts and a short connect timeout: a check should fail fast, not retry for minutes.
        tier = S3Tier(config.s3_bucket, config.s3_prefix, endpoint_url=config.s3_endpoint, region=config.s3_region,
                      max_attempts=2, connect_timeout=min(config.s3_connect_timeout, 5.0),
                      read_timeout=min(config.s3_read_timeout, 10.0), cipher=cipher)
        start = time.perf_counter()
        with boto_errors("head_bucket", "", tier.bucket, where, 2):
            tier.client.head_bucket(Bucket=tier.bucket)
        data["seconds"] = time.perf_counter() - start
        _open_one_manifest(tier)
    except Missing:
        return Check("s3", "fail", f"bucket {config.s3_bucket!r} does not exist at {where}: create it, or fix s3.url",
                     data)
    except (RemoteError, ConfigError) as exc:  # EncryptionKeyError is a RemoteError
        return Check("s3", "fail", str(exc), data)
    except (CorruptBlock, FormatError):
        pass  # a damaged manifest is verify --remote's to report, not a fault of this machine
    key = "off" if cipher is None else f"key from {cipher.source}"
    return Check("s3", "ok", f"{config.s3_url} at {where}: bucket reachable, credentials accepted, encryption "
                             f"{key} ({data['seconds'] * 1e3:.0f} ms)", data)


def _open_one_manifest(tier) -> None:
    """Read the prefix's first manifest, if any, with this machine's key: EncryptionKeyError when
    the prefix is sealed with another key or this machine has none."""
    listed = tier.list_manifests()
    if listed:
        tier.get_manifest(listed[0].name)
