"""The storage data path against its floors, each floor measured beside its column in one run.

    python bench/storage.py --tokens 16384 --schemes raw turbo4 turbo8v3 --runs 3

An entry of synthetic K/V rows with the real model's geometry (Qwen2.5-0.5B: 24 layers, 2 KV
heads, head dim 64, float32; keys with a few outlier channels like real ones) is compressed,
put, restored from memory and from LMDB with its pages dropped, pushed to a moto S3 server on
loopback and pulled into an empty home. Beside each step its floor on this machine, on warm
pages unless the step itself is cold:

    put        a plain LMDB put of the same number of bytes in 1 MiB values, one transaction, synced
    memory     a copy of the entry's decoded bytes (warm source and destination)
    lmdb cold  a sequential read of data.mdb with its pages dropped, the store closed first (an
               open environment maps the pages it read, and posix_fadvise(DONTNEED) leaves
               mapped pages in the page cache), checked evicted with mincore
    push/pull  boto3's transfer manager (upload_fileobj / download_fileobj, the store's part size
               and concurrency) on one object of the same size

Ratios are step speed / floor speed (1.0 = at the floor). Ranges over --runs runs.

    python bench/storage.py --tokens 16384 --schemes raw turbo4 --runs 3 --scaling --write

`--tree DIR` measures the tqstore and turboquant of another checkout (a baseline) with this
script's floors: run it beside the same command without it.

`--scaling` adds the restore cost per stored GB (memory tier, and LMDB with its pages dropped)
from 1k to 64k tokens at 24 layers and from 8 to 64 layers at 4k tokens (turbo4), wall and
process CPU seconds: flat rows
mean the cost grows with bytes, not with layer records. `--write` puts both tables into
docs/benchmarks.md (sections bench-storage and bench-storage-scaling).
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from common import LocalS3, compressed, drop_page_cache, markdown_table  # noqa: E402

GEOMETRY = dict(model_type="qwen2", hidden_size=896, num_hidden_layers=24, intermediate_size=64,
                num_attention_heads=14, num_key_value_heads=2, vocab_size=256, rms_norm_eps=1e-6,
                tie_word_embeddings=True)


@dataclass
class Run:
    """One run of one scheme: seconds per step and per floor, and the entry's sizes."""

    scheme: str
    stored_bytes: int = 0
    fp16_bytes: int = 0
    decoded_bytes: int = 0
    resident_before_lmdb: int = 0  # bytes of data.mdb in the page cache when the LMDB restore began
    load: float = 0.0  # the 1-minute load average when the run began (2 cores here)
    seconds: dict = field(default_factory=dict)  # step -> seconds
    floors: dict = field(default_factory=dict)  # step -> floor seconds
    cpu: dict = field(default_factory=dict)  # "put", "put floor" -> the process's CPU seconds


def kv_model(layers: int = GEOMETRY["num_hidden_layers"]):
    """A random-weight model with the real model's KV geometry (only its cache shapes matter)."""
    from mlx_lm.models import qwen2

    model = qwen2.Model(qwen2.ModelArgs.from_dict({**GEOMETRY, "num_hidden_layers": layers}))
    mx.eval(model.parameters())
    return model


def raw_snapshot(tokens: int, seed: int = 0, n_layers: int = GEOMETRY["num_hidden_layers"]):
    """An uncompressed snapshot of `tokens` synthetic rows per layer."""
    from turboquant.records import LayerRecord, Layout, Snapshot

    rng = np.random.default_rng(seed)
    layers = []
    for _ in range(n_layers):
        k = rng.standard_normal((1, 2, tokens, 64), dtype=np.float32)
        channels = rng.choice(64, 3, replace=False)
        k[..., channels] = k[..., channels] * 4 + 40 * np.array([1.0, -0.6, 0.4], dtype=np.float32)
        v = rng.standard_normal((1, 2, tokens, 64), dtype=np.float32) * 0.5
        layers.append(LayerRecord(Layout.RAW, tokens, {"keys": mx.array(k), "values": mx.array(v)},
                                  {"class": "KVCache"}))
    return Snapshot(layers=layers, codecs={})


def lmdb_put_floor(nbytes: int, folder: Path, segment: int = 1 << 20) -> float:
    """Seconds for a plain synced LMDB put of `nbytes` (warm source) in 1 MiB values."""
    import lmdb

    payload = np.random.default_rng(1).integers(0, 255, nbytes, dtype=np.uint8).tobytes()
    path = Path(tempfile.mkdtemp(dir=folder))
    env = lmdb.open(str(path), map_size=max(1 << 30, 4 * nbytes))
    try:
        t0 = time.perf_counter()
        with env.begin(write=True) as txn:
            for i in range(0, nbytes, segment):
                txn.put(i.to_bytes(8, "big"), payload[i:i + segment])
        env.sync(True)
        return time.perf_counter() - t0
    finally:
        env.close()
        shutil.rmtree(path, ignore_errors=True)


def memcpy_floor(nbytes: int) -> float:
    """Seconds to copy `nbytes` between warm buffers (both touched before the timing)."""
    src = np.random.default_rng(2).integers(0, 255, nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    t0 = time.perf_counter()
    np.copyto(dst, src)
    return time.perf_counter() - t0


def resident_bytes(path: Path) -> int:
    """Bytes of `path` in the page cache (mincore over a fresh read-only mapping of it)."""
    import ctypes
    import ctypes.util
    import mmap

    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    size = os.path.getsize(path)
    if not size:
        return 0
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr is None or addr == ctypes.c_void_p(-1).value:
            raise OSError(ctypes.get_errno(), f"mmap of {path}")
        try:
            pages = (ctypes.c_ubyte * ((size + mmap.PAGESIZE - 1) // mmap.PAGESIZE))()
            if libc.mincore(ctypes.c_void_p(addr), size, pages) != 0:
                raise OSError(ctypes.get_errno(), f"mincore of {path}")
            return sum(v & 1 for v in pages) * mmap.PAGESIZE
        finally:
            libc.munmap(ctypes.c_void_p(addr), size)
    finally:
        os.close(fd)


def cold_read_floor(path: Path, nbytes: int) -> float:
    """Seconds to read the first `nbytes` of `path` sequentially after dropping its pages.

    The caller must have closed every LMDB environment on `path`: posix_fadvise(DONTNEED)
    cannot evict pages that a process has mapped, and an open environment maps the pages its
    reads touched, so the "cold" read would read the page cache. Checked here with mincore: a
    floor read with more than 1% of the file still resident raises instead of timing memory."""
    drop_page_cache(path)
    left_over = resident_bytes(path)
    if left_over > 0.01 * os.path.getsize(path):
        raise RuntimeError(f"{left_over} bytes of {path} stay in the page cache after posix_fadvise(DONTNEED): a "
                           "process still maps them (close the store first)")
    buf = bytearray(8 << 20)
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        left = nbytes
        while left > 0:
            n = f.readinto(buf)
            if not n:
                break
            left -= n
    return time.perf_counter() - t0


def boto3_floors(s3: LocalS3, nbytes: int, part: int, concurrency: int) -> tuple[float, float]:
    """Seconds to upload and download one object of `nbytes` with boto3's transfer manager."""
    from boto3.s3.transfer import TransferConfig

    cfg = TransferConfig(multipart_threshold=part, multipart_chunksize=part, max_concurrency=concurrency)
    payload = np.random.default_rng(3).integers(0, 255, nbytes, dtype=np.uint8).tobytes()
    t0 = time.perf_counter()
    s3.client.upload_fileobj(io.BytesIO(payload), s3.bucket, "floor/object", Config=cfg)
    t1 = time.perf_counter()
    s3.client.download_fileobj(s3.bucket, "floor/object", io.BytesIO(), Config=cfg)
    return t1 - t0, time.perf_counter() - t1


def run_scheme(model, raw, scheme: str, root: Path, s3: LocalS3, n: int, run_index: int = 0) -> Run:
    """Every step of one scheme, each beside its floor."""
    from tqstore.config import load_config
    from tqstore.models.identity import CodecIdentity, ModelIdentity
    from tqstore.store.store import Store
    from turboquant import make_prompt_cache, snapshot

    run = Run(scheme, load=os.getloadavg()[0])
    snap, run.seconds["compress"] = compressed(model, raw, scheme)
    run.decoded_bytes = sum(a.nbytes for a in snap.arrays())
    run.fp16_bytes = 2 * 2 * 2 * 64 * n * GEOMETRY["num_hidden_layers"]
    # A bucket prefix of its own per run: a push into one that holds the objects moves nothing.
    home, other = root / f"{scheme}-{n}-{run_index}", root / f"{scheme}-{n}-{run_index}-pull"
    for h in (home, other):
        shutil.rmtree(h, ignore_errors=True)
    overrides = {"s3_url": s3.url(home.name), "s3_endpoint": s3.endpoint}
    config = load_config(home, overrides)
    model_id = ModelIdentity.from_model(model, kv_dtype="float32")
    codec_id = CodecIdentity.from_snapshot(snapshot(make_prompt_cache(model, scheme)), scheme)
    tokens = list(range(n))
    store = Store.open(home, config=config)
    c0, t0 = time.process_time(), time.perf_counter()
    result = store.put("e", snap, tokens, model=model_id, codec=codec_id, model_ref="bench", prefill_seconds=1.0)
    run.seconds["put"], run.cpu["put"] = time.perf_counter() - t0, time.process_time() - c0
    run.stored_bytes = result.manifest.nbytes
    c0 = time.process_time()
    run.floors["put"] = lmdb_put_floor(run.stored_bytes, root)
    run.cpu["put floor"] = time.process_time() - c0

    t0 = time.perf_counter()
    store.load("e")
    run.seconds["memory"] = time.perf_counter() - t0
    run.floors["memory"] = memcpy_floor(run.decoded_bytes)
    store.close()

    data = home / "lmdb" / "data.mdb"
    drop_page_cache(data)
    store = Store.open(home, config=config)
    store.get("e")  # opening is not part of a restore
    drop_page_cache(data)
    run.resident_before_lmdb = resident_bytes(data)
    t0 = time.perf_counter()
    store.load("e")
    run.seconds["lmdb"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    store.push("e")
    run.seconds["push"] = time.perf_counter() - t0
    store.close()
    run.floors["lmdb"] = cold_read_floor(data, run.stored_bytes)
    remote = Store.open(other, config=load_config(other, overrides))
    remote.ls(remote=True)  # the remote index, outside the timing
    t0 = time.perf_counter()
    remote.pull("e")
    run.seconds["pull"] = time.perf_counter() - t0
    remote.close()
    run.floors["push"], run.floors["pull"] = boto3_floors(s3, run.stored_bytes, config.s3_part_size,
                                                          config.s3_concurrency)
    for h in (home, other):
        shutil.rmtree(h, ignore_errors=True)
    return run


STEPS = (("put", "stored"), ("memory", "decoded"), ("lmdb", "stored"), ("push", "stored"), ("pull", "stored"))
TARGETS = {"put": 0.5, "lmdb": 0.8, "push": 0.9, "pull": 0.9}


def span(values: list[float], fmt: str = "{:.2f}") -> str:
    lo, hi = min(values), max(values)
    return fmt.format(lo) if fmt.format(lo) == fmt.format(hi) else f"{fmt.format(lo)}-{fmt.format(hi)}"


def table(runs: list[Run], tokens: int) -> str:
    """One row per scheme: GB/s of each step and of its floor, and their ratio, as ranges."""
    header = ["tokens", "scheme", "load", "stored MB", "save GB/s fp16-eq (compress + put)"]
    for step, _ in STEPS:
        header += [f"{step} GB/s", f"{step} floor GB/s", f"{step} / floor"]
        if step == "put":  # on a loaded machine CPU seconds stretch far less than wall seconds
            header += ["put / floor in CPU s"]
    rows = []
    for scheme in dict.fromkeys(r.scheme for r in runs):
        mine = [r for r in runs if r.scheme == scheme]
        row = [tokens, scheme, span([r.load for r in mine], "{:.0f}"), f"{mine[0].stored_bytes / 1e6:.1f}",
               span([r.fp16_bytes / (r.seconds["compress"] + r.seconds["put"]) / 1e9 for r in mine])]
        for step, basis in STEPS:
            nbytes = (lambda r: r.decoded_bytes) if basis == "decoded" else (lambda r: r.stored_bytes)
            row += [span([nbytes(r) / r.seconds[step] / 1e9 for r in mine]),
                    span([nbytes(r) / r.floors[step] / 1e9 for r in mine]),
                    span([r.floors[step] / r.seconds[step] for r in mine]) + "x"]
            if step == "put":
                row += [span([r.cpu["put floor"] / r.cpu["put"] for r in mine]) + "x"]
        rows.append(row)
    return markdown_table(header, rows)


def measure(tokens: int, schemes: list[str], runs: int) -> list[Run]:
    """`runs` runs of every scheme (interleaved, so drift spreads over all of them)."""
    model = kv_model()
    raw = raw_snapshot(tokens)
    mx.eval(raw.arrays())
    root = Path(tempfile.mkdtemp(prefix="tqstore-storage-", dir=os.environ.get("TQSTORE_BENCH_DIR")))
    s3 = LocalS3()
    out = []
    try:
        for i in range(runs):
            for scheme in schemes:
                r = run_scheme(model, raw, scheme, root, s3, tokens, i)
                out.append(r)
                print(f"run {i + 1} {scheme}: " + ", ".join(
                    f"{k} {v:.3f}s (floor {r.floors.get(k, float('nan')):.3f}s)" for k, v in r.seconds.items())
                    + f"; data.mdb resident before the LMDB restore {r.resident_before_lmdb / 1e6:.1f} MB", flush=True)
    finally:
        s3.stop()
        shutil.rmtree(root, ignore_errors=True)
    return out


SCALING_TOKENS = (1024, 4096, 16384, 65536)  # at the model's 24 layers
SCALING_LAYERS = (8, 16, 32, 64)  # at SCALING_AT tokens
SCALING_AT = 4096


def restore_costs(layers: int, tokens: int, scheme: str, root: Path, run_index: int
                  ) -> tuple[int, float, float, float, float]:
    """(stored bytes, wall seconds of a memory-tier restore, of an LMDB restore with the pages
    dropped, and the process's CPU seconds of each) of one entry of `layers` layers and
    `tokens` tokens."""
    from tqstore.config import load_config
    from tqstore.models.identity import CodecIdentity, ModelIdentity
    from tqstore.store.store import Store
    from turboquant import make_prompt_cache, snapshot

    model = kv_model(layers)
    raw = raw_snapshot(tokens, n_layers=layers)
    mx.eval(raw.arrays())
    snap, _ = compressed(model, raw, scheme)
    home = root / f"scaling-{layers}-{tokens}-{run_index}"
    config = load_config(home, {})
    store = Store.open(home, config=config)
    result = store.put("e", snap, list(range(tokens)), model=ModelIdentity.from_model(model, kv_dtype="float32"),
                       codec=CodecIdentity.from_snapshot(snapshot(make_prompt_cache(model, scheme)), scheme),
                       model_ref="bench", prefill_seconds=1.0)
    del snap, raw
    mx.clear_cache()  # the freed snapshot (1.6 GB at 64k) must not stay in MLX's cache while the restores allocate
    c0, t0 = time.process_time(), time.perf_counter()
    store.load("e")
    memory, memory_cpu = time.perf_counter() - t0, time.process_time() - c0
    store.close()
    mx.clear_cache()
    data = home / "lmdb" / "data.mdb"
    store = Store.open(home, config=config)
    store.get("e")
    drop_page_cache(data)
    c0, t0 = time.process_time(), time.perf_counter()
    store.load("e")
    lmdb, lmdb_cpu = time.perf_counter() - t0, time.process_time() - c0
    store.close()
    shutil.rmtree(home, ignore_errors=True)
    return result.manifest.nbytes, memory, lmdb, memory_cpu, lmdb_cpu


def scaling_table(runs: int, scheme: str = "turbo4") -> str:
    """Restore seconds per stored GB over token counts and layer counts (ranges over `runs`)."""
    points = [(GEOMETRY["num_hidden_layers"], t) for t in SCALING_TOKENS]
    points += [(n, SCALING_AT) for n in SCALING_LAYERS if (n, SCALING_AT) not in points]
    root = Path(tempfile.mkdtemp(prefix="tqstore-scaling-", dir=os.environ.get("TQSTORE_BENCH_DIR")))
    found: dict[tuple[int, int], list[tuple[int, float, float, float, float]]] = {p: [] for p in points}
    loads: dict[tuple[int, int], list[float]] = {p: [] for p in points}
    try:
        for i in range(runs):
            for layers, tokens in points:
                loads[(layers, tokens)].append(os.getloadavg()[0])
                found[(layers, tokens)].append(restore_costs(layers, tokens, scheme, root, i))
                nbytes, memory, lmdb, memory_cpu, lmdb_cpu = found[(layers, tokens)][-1]
                print(f"scaling run {i + 1}: {layers} layers, {tokens} tokens, {nbytes / 1e6:.1f} MB: memory "
                      f"{memory:.3f}s (CPU {memory_cpu:.3f}s), lmdb {lmdb:.3f}s (CPU {lmdb_cpu:.3f}s), load "
                      f"{loads[(layers, tokens)][-1]:.1f}", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    rows = []
    for (layers, tokens), got in found.items():
        rows.append([layers, tokens, scheme, span(loads[(layers, tokens)], "{:.0f}"), f"{got[0][0] / 1e6:.1f}",
                     span([g[1] / (g[0] / 1e9) for g in got], "{:.3f}"), span([g[3] / (g[0] / 1e9) for g in got], "{:.3f}"),
                     span([g[0] / g[1] / 1e9 for g in got]),
                     span([g[2] / (g[0] / 1e9) for g in got], "{:.3f}"), span([g[4] / (g[0] / 1e9) for g in got], "{:.3f}"),
                     span([g[0] / g[2] / 1e9 for g in got])])
    return markdown_table(["layers", "tokens", "scheme", "load", "stored MB", "memory restore s/GB",
                           "its CPU s/GB", "memory GB/s", "LMDB restore (pages dropped) s/GB", "its CPU s/GB",
                           "LMDB GB/s"], rows)


def use_tree(tree: Path | None) -> None:
    """Import tqstore and turboquant from `tree` (before anything imported them)."""
    if tree is None:
        return
    if "tqstore" in sys.modules or "turboquant" in sys.modules:
        raise RuntimeError("--tree must be applied before tqstore is imported")
    sys.path.insert(0, str(tree.resolve()))
    import tqstore

    print(f"measuring the tree at {Path(tqstore.__file__).resolve().parent.parent}", flush=True)


def write_docs(sections: dict[str, str], argv: list[str]) -> None:
    """Replace the named sections of docs/benchmarks.md, each under its provenance line."""
    from common import replace_section, stamp

    doc = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"
    for name, body in sections.items():
        replace_section(doc, name, f"{stamp(argv)}\n\n{body}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--schemes", nargs="+", default=["raw", "turbo4", "turbo8v3"])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--scaling", action="store_true", help="also the restore cost per GB over tokens and layers")
    parser.add_argument("--write", action="store_true", help="write the tables into docs/benchmarks.md")
    parser.add_argument("--tree", type=Path, help="measure the tqstore and turboquant of another checkout (a "
                        "baseline, e.g. from `git worktree add`), with this script's floors")
    args = parser.parse_args(argv)
    use_tree(args.tree)
    sections = {"bench-storage": table(measure(args.tokens, args.schemes, args.runs), args.tokens)}
    print(sections["bench-storage"], flush=True)
    if args.scaling:
        sections["bench-storage-scaling"] = scaling_table(args.runs)
        print(sections["bench-storage-scaling"])
    if args.write:
        write_docs(sections, [sys.argv[0], *(sys.argv[1:] if argv is None else argv)])
    return 0


if __name__ == "__main__":
    sys.exit(main())
