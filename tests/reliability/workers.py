"""Child processes of the reliability suite: `python workers.py OP SETTINGS_JSON`.

Each op opens the store of `settings["home"]` (with `settings["config"]` as overrides), prints
"ready" once it is about to work, then works; ops that end print one JSON line of results.
The crash ops loop until they are killed (SIGKILL, from the test); the concurrency, disk-full
and churn ops run to the end and report.

Entries are synthetic snapshots (test_blocks.make_snapshot) over tokens that share a 512-token
prefix, so entries share blocks, except `save`, which prefills a tiny model through the Engine.
"""

from __future__ import annotations

import hashlib
import json
import random
import sys
import time

import numpy as np

from harness import TEST_SETTINGS
from test_blocks import make_snapshot
from tqstore import Store
from tqstore.config import load_config
from tqstore.errors import CorruptBlock, DiskFull, NotFound
from tqstore.canonical import tensor_bytes
from tqstore.models.identity import CodecIdentity, ModelIdentity
from turboquant.records import Layout

MODEL = ModelIdentity("weights-a", {"num_hidden_layers": 2}, None, None, None, "float16", "synthetic")
CODEC = CodecIdentity("turbo4", (), {})
LAYOUTS = [Layout.RAW, Layout.TURBO]  # even seeds: no calibration, so shared prefixes always combine
BASE = [int(t) for t in np.random.default_rng(0).integers(0, 50_000, 512)]


def tokens_for(seed: int, n: int) -> list[int]:
    """The shared 512-token prefix, then `n` tokens of this seed."""
    rng = random.Random(seed)
    return BASE + [rng.randrange(50_000) for _ in range(n)]


def put(store: Store, name: str, n: int, seed: int, layers: int = 1, **kw):
    """Store a synthetic entry of 512 + n tokens (and `layers` x 2 layers); returns the PutResult."""
    snap = make_snapshot(512 + n, layouts=LAYOUTS * layers, seed=6 * (seed % 7))
    return store.put(name, snap, tokens_for(seed, n), model=MODEL, codec=CODEC, model_ref="synthetic",
                     prefill_seconds=0.1, **kw)


def snapshot_digest(snap) -> str:
    """sha256 over every tensor's bytes and every layer's metadata: equal digests, equal caches."""
    h = hashlib.sha256()
    for layer in snap.layers:
        h.update(json.dumps([layer.layout.value, layer.offset, dict(layer.config), dict(layer.state)],
                            sort_keys=True, default=str).encode())
        for name in sorted(layer.arrays):
            h.update(name.encode())
            h.update(tensor_bytes(layer.arrays[name]).tobytes())
    return h.hexdigest()


def emit(**doc: object) -> None:
    print(json.dumps(doc), flush=True)


def open_store(settings: dict) -> Store:
    return Store.open(config=load_config(settings["home"], {**TEST_SETTINGS, **settings.get("config", {})}))


# --- crash ops: loop until killed ------------------------------------------------------------


def op_put(settings: dict) -> None:
    store = open_store(settings)
    rng = random.Random(settings["seed"])
    print("ready", flush=True)
    for i in range(10**9):
        put(store, f"w{rng.randrange(4)}", rng.choice([44, 300, 600]), rng.randrange(10**6))


def op_save(settings: dict) -> None:
    """Save documents with the engine as `tqstore save` runs it: mlx-lm's package imported lazily
    and the model loaded light (the home's first load records the tokenizer, so the next kill's
    process starts without transformers, as a second `tqstore save` does)."""
    from tqstore.models import lazy_mlx_lm

    lazy_mlx_lm.install()
    from tqstore.engine.engine import Engine

    store = open_store(settings)
    engine = Engine(store, prefill_chunk=64, light=True)
    engine.model(settings["model"])  # loaded before "ready": kills land in saves, not in mlx-lm's load
    rng = random.Random(settings["seed"])
    words = "the seller pays for delays clause seven covers delivery payment and penalties".split()
    print("ready", flush=True)
    for i in range(10**9):
        document = " ".join(rng.choice(words) for _ in range(rng.choice([40, 120, 300])))
        engine.save(f"doc{rng.randrange(4)}", document, model=settings["model"], scheme=settings.get("scheme"))


def op_push(settings: dict) -> None:
    store = open_store(settings)
    rng = random.Random(settings["seed"])
    print("ready", flush=True)
    for i in range(10**9):
        name = f"p{rng.randrange(4)}"
        put(store, name, rng.choice([44, 300, 600]), rng.randrange(10**6))
        store.push(name)


def op_pull(settings: dict) -> None:
    """Pull the bucket's entries again and again, each time after removing the local copy (so
    its objects are downloaded again)."""
    store = open_store(settings)
    names = [e.name for e in store.ls(remote=True)]
    rng = random.Random(settings["seed"])
    print("ready", flush=True)
    for i in range(10**9):
        name = rng.choice(names)
        try:
            store.rm(name)
        except NotFound:
            pass
        store.pull(name)


def op_gc(settings: dict) -> None:
    """Make garbage (replaced and removed entries) and collect it, compacting now and then."""
    store = open_store(settings)
    rng = random.Random(settings["seed"])
    print("ready", flush=True)
    for i in range(10**9):
        put(store, f"g{rng.randrange(3)}", rng.choice([44, 300, 600]), rng.randrange(10**6))
        if rng.random() < 0.3:
            try:
                store.rm(f"g{rng.randrange(3)}")
            except NotFound:
                pass
        store.gc(compact=rng.random() < 0.4)


def op_evict(settings: dict) -> None:
    """Put entries under a small LMDB budget: every put evicts."""
    store = open_store(settings)
    rng = random.Random(settings["seed"])
    print("ready", flush=True)
    for i in range(10**9):
        put(store, f"e{i % 50}", rng.choice([44, 300, 600, 1200]), rng.randrange(10**6), pin=rng.random() < 0.05)


# --- concurrency: writers and readers for a fixed time ---------------------------------------


def op_writer(settings: dict) -> None:
    """Put (and sometimes remove, sometimes gc) entries of three kinds for `seconds`: `keep-*`
    names shared by every writer and never removed, `temp-*` names shared and removed, and
    this writer's own names. Every completed put is reported with the digest of what it stored."""
    store = open_store(settings)
    me, rng = settings["writer"], random.Random(settings["seed"])
    puts, rms, gcs = [], [], 0
    print("ready", flush=True)
    end = time.monotonic() + settings["seconds"]
    seq = 0
    while time.monotonic() < end:
        seq += 1
        roll = rng.random()
        if roll < 0.1 and me == 0:
            store.gc()
            gcs += 1
            continue
        if roll < 0.25:
            name = f"temp-{rng.randrange(3)}"
            try:
                store.rm(name)
                rms.append(name)
            except NotFound:
                pass
            continue
        kind = rng.random()
        name = f"keep-{rng.randrange(3)}" if kind < 0.4 else f"temp-{rng.randrange(3)}" if kind < 0.6 \
            else f"own{me}-{rng.randrange(3)}"
        result = put(store, name, rng.choice([1, 44, 256, 300, 600]), rng.randrange(10**6),
                     metadata={"writer": str(me), "seq": str(seq)})
        puts.append({"name": name, "writer": me, "seq": seq, "digest": snapshot_digest(result.snapshot),
                     "tokens": len(result.manifest.tokens)})
    emit(puts=puts, rms=rms, gcs=gcs)


def op_reader(settings: dict) -> None:
    """Restore every listed entry and look up prefixes for `seconds`. Each restore uses the
    manifest the reader read (Store.restore of a whole-entry Match), so it must give exactly
    that entry, or, if writers removed some of its blocks meanwhile (the entry replaced or
    removed), a shorter prefix of whole blocks naming the misses, or CorruptBlock: never
    anything else."""
    from tqstore.store.lookup import Match

    store = open_store(settings)
    rng = random.Random(settings["seed"])
    loads = lookups = gone = 0
    errors = []
    print("ready", flush=True)
    end = time.monotonic() + settings["seconds"]
    while time.monotonic() < end:
        entries = store.ls()
        rng.shuffle(entries)
        for entry in entries[:4]:
            try:
                m = store.get(entry.name)
                snap, stats = store.restore(Match(len(m.tokens), tuple(m.keys), m.name, "lmdb", m))
            except (NotFound, CorruptBlock):
                gone += 1
                continue
            whole = stats.tokens == len(m.tokens)
            prefix = stats.tokens % m.block_size == 0 and stats.tokens < len(m.tokens) and stats.misses
            if snap.offset != stats.tokens or not (whole or prefix):
                errors.append(f"{m.name}: restored {snap.offset} of {len(m.tokens)} tokens ({stats.misses})")
            loads += 1
            gone += not whole
        query = tokens_for(rng.randrange(10**6), 100)
        match = store.lookup(query, model=MODEL.digest, codec=CODEC.digest)
        if match is not None:
            try:
                snap, stats = store.restore(match)
                if snap.offset != stats.tokens or stats.tokens > match.tokens:
                    errors.append(f"prefix restore gave {snap.offset} tokens for a match of {match.tokens}")
            except CorruptBlock:
                gone += 1
        lookups += 1
    emit(loads=loads, lookups=lookups, gone=gone, errors=errors)


# --- disk full -------------------------------------------------------------------------------


def simulate_small_disk(capacity: int) -> None:
    """Make the free-disk checks see a disk of `capacity` bytes holding only the home folder
    (what tqstore asks the OS: shutil.disk_usage). Used where no size-limited filesystem can be
    mounted; the store's own guard and map growth then meet a full disk deterministically."""
    import os
    import shutil

    real = shutil.disk_usage

    def disk_usage(path):
        used = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(os.path.dirname(str(path)))
                   for f in fs)
        total = real(path).total
        return type(real(path))(total, used, max(0, capacity - used))

    shutil.disk_usage = disk_usage


def op_fill(settings: dict) -> None:
    """Fill the store until the disk is full; check what was stored; free space and store again;
    then, with a budget, keep storing: eviction must keep the store writable."""
    if settings.get("simulate_capacity"):
        simulate_small_disk(settings["simulate_capacity"])
    store = open_store(settings)
    rng = random.Random(1)
    stored, full, other = [], [], []
    print("ready", flush=True)
    sizes = []
    for i in range(400):
        try:
            sizes.append(rng.choice([300, 600, 1200]))
            put(store, f"f{i}", sizes[-1], i)
            stored.append(f"f{i}")
        except DiskFull as exc:
            full.append(str(exc))
            if len(full) >= 3:
                break
        except Exception as exc:  # noqa: BLE001 - any other type is the finding
            other.append(f"{type(exc).__name__}: {exc}")
            break
    problems = [str(p) for p in store.verify()]
    loaded = sum(store.load(n)[1].tokens > 0 for n in stored)
    # Space freed inside the LMDB file must be usable again on a full disk: a put of the size
    # just removed (a larger one would live on slack, which lock.mdb's allocated blocks take).
    store.rm(stored[0])
    try:
        put(store, "after-rm", sizes[0], 10**5)
        after_rm = "stored"
    except DiskFull as exc:
        after_rm = f"DiskFull: {exc}"
    tight = _tight_disk(store, settings["home"]) if settings.get("ballast") else None
    store.close()
    # A budget below the disk's size: eviction keeps every later put possible.
    store = open_store({**settings, "config": {**settings.get("config", {}),
                                               "lmdb_budget_bytes": settings["budget"]}})
    budget_puts, budget_errors = 0, []
    for i in range(settings.get("budget_puts", 30)):
        try:
            put(store, f"b{i}", rng.choice([300, 600, 1200]), 10**6 + i)
            budget_puts += 1
        except Exception as exc:  # noqa: BLE001
            budget_errors.append(f"{type(exc).__name__}: {exc}")
    budget_problems = [str(p) for p in store.verify()]
    budget_loaded = sum(store.load(e.name)[1].tokens > 0 for e in store.ls())
    store.close()
    emit(stored=len(stored), loaded=loaded, full=full, other=other, problems=problems, after_rm=after_rm,
         tight=tight, budget_puts=budget_puts, budget_errors=budget_errors, budget_problems=budget_problems,
         budget_loaded=budget_loaded)


def _tight_disk(store: Store, home: str) -> dict:
    """Puts into a disk left with just about the put's payload free (a ballast file takes the
    rest; the store compacted and empty before each), in steps of one page around it: the
    free-disk guard refuses some, LMDB itself meets the full disk on others (growing the map,
    or ENOSPC in the middle of a commit). Each must end as a stored entry or DiskFull."""
    import os
    import shutil

    def reset() -> None:
        for name in [e.name for e in store.ls()]:
            store.rm(name)
        store.gc(compact=True)  # the file shrinks: the next put must grow it

    reset()
    needed = put(store, "probe", 600, 2 * 10**5).bytes_written  # every put below writes as much
    ballast = os.path.join(os.path.dirname(home), "ballast")
    outcome: dict = {}
    for i, room in enumerate(range(needed - 8192, needed + 65536, 4096)):
        reset()
        with open(ballast, "wb") as f:
            f.write(bytes(max(0, shutil.disk_usage(home).free - room)))
        try:
            put(store, f"tight{i}", 600, 2 * 10**5)
            outcome[f"tight{i}"] = "stored"
        except DiskFull as exc:
            message = str(exc)
            caught = "guard" if "is free" in message else "map growth" if "map cannot grow" in message \
                else "LMDB commit"
            outcome[f"tight{i}"] = f"DiskFull ({caught})"
        except Exception as exc:  # noqa: BLE001 - any other type is the finding
            outcome[f"tight{i}"] = f"{type(exc).__name__}: {exc}"
        os.unlink(ballast)
        outcome.setdefault("problems", []).extend(str(p) for p in store.verify())
    outcome["loaded"] = sum(store.load(e.name)[1].tokens > 0 for e in store.ls())
    put(store, "after-ballast", 600, 3 * 10**5)
    outcome["after"] = "stored"
    return outcome


# --- churn -----------------------------------------------------------------------------------


def op_churn(settings: dict) -> None:
    """save/rm cycles of varied sizes in one long-running process: the LMDB file against the
    peak live data, then compaction, and this process's memory over the cycles."""
    import resource

    import mlx.core as mx

    store = open_store(settings)
    rng = random.Random(settings["seed"])
    lmdb = store._tiers.lmdb
    live: list[str] = []
    peak_live = peak_file = 0
    samples = []
    print("ready", flush=True)
    for cycle in range(settings["cycles"]):
        if live and (len(live) >= settings["max_live"] or rng.random() < 0.45):
            store.rm(live.pop(rng.randrange(len(live))))
        else:
            name = f"c{cycle}"
            put(store, name, rng.choice([1, 100, 300, 700, 1500, 3000]), rng.randrange(10**6),
                layers=settings.get("layers", 1))
            live.append(name)
        stats = lmdb.stats()
        peak_live = max(peak_live, stats.payload_bytes)
        peak_file = max(peak_file, stats.file_bytes)
        if cycle % 10 == 0:
            samples.append({"cycle": cycle, "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                            "rss_now": _rss(), "active": mx.get_active_memory(), "file": stats.file_bytes,
                            "live": stats.payload_bytes, "used": stats.used_bytes})
    before = lmdb.stats()
    compacted = store.gc(compact=True)
    after = lmdb.stats()
    problems = [str(p) for p in store.verify()]
    loaded = sum(store.load(n)[1].tokens > 0 for n in live)
    store.close()
    emit(peak_live=peak_live, peak_file=peak_file, file_before=before.file_bytes, live_before=before.payload_bytes,
         used_before=before.used_bytes, file_after=after.file_bytes, live_after=after.payload_bytes,
         used_after=after.used_bytes, compact=[compacted.compact.bytes_before, compacted.compact.bytes_after],
         samples=samples, problems=problems, loaded=loaded, live=len(live))


def op_full_disk(settings: dict) -> None:
    """On a small real filesystem (the test mounts it): an entry saved with a tiny model, then
    the disk filled to the last byte. Reads (`ask`, `ls`, `info`, `verify`) must work and write
    nothing; a save must be refused before its prefill; a put that LMDB itself meets ENOSPC in
    must fail as DiskFull; then `rm` + `gc` must make the next save work. Every command is the
    real `tqstore` in a subprocess."""
    import os
    import subprocess

    from harness import cli
    from tqstore.engine.engine import Engine

    home, model = settings["home"], settings["model"]
    config = ["--home", home]
    assert cli("config", "set", "store.min_free_disk", "0", *config).returncode == 0  # (1 GiB by default)
    store = open_store(settings)
    Engine(store, prefill_chunk=64).save("doc", "The contract says the seller pays for delays. " * 8, model=model,
                                         scheme="turbo4")
    put(store, "big", 3000, 1)
    store.close()
    ballast = os.path.join(os.path.dirname(home), "ballast")
    _fill(ballast)
    out: dict = {"free_after_fill": shutil_free(home)}
    registry = os.path.join(home, "models.json")
    before = os.stat(registry).st_mtime_ns

    def run(name: str, *argv: str) -> None:
        done = cli(*argv, *config, timeout=300)
        out[name] = [done.returncode, (done.stdout + done.stderr)[-600:]]

    def in_process(name: str, job) -> None:
        store = open_store(settings)
        try:
            out[name] = [0, str(job(store))]
        except Exception as exc:  # noqa: BLE001 - reported, the test names it
            out[name] = [1, f"{type(exc).__name__}: {exc}"]
        finally:
            store.close()

    run("ask", "ask", "doc", "Who pays?", "--max-tokens", "2")
    in_process("ls", lambda store: [e.name for e in store.ls()])
    in_process("verify", verified)
    out["registry_rewritten"] = os.stat(registry).st_mtime_ns != before
    run("save_full", "save", "big", "--model", model, "--prompt", "The seller pays. " * 40)
    # LMDB's own ENOSPC: room for the guard, not for LMDB's pages and meta.
    os.unlink(ballast)
    store = open_store(settings)
    needed = put(store, "probe", 600, 7).bytes_written
    store.rm("probe")
    store.close()
    _fill(ballast, leave=needed + 4096)
    store = open_store(settings)
    outcomes = []
    for i in range(6):
        try:
            put(store, f"tight{i}", 600, 100 + i)
            outcomes.append("stored")
        except DiskFull as exc:
            outcomes.append("DiskFull (guard)" if "is free" in str(exc) else "DiskFull (LMDB)")
        except Exception as exc:  # noqa: BLE001 - any other type is the finding
            outcomes.append(f"{type(exc).__name__}: {exc}")
    store.close()
    out["tight"] = outcomes
    _fill(ballast + "2")
    out["free_before_recovery"] = shutil_free(home)
    run("rm", "rm", "big")
    run("gc", "gc")
    run("save_after_gc", "save", "after", "--model", model, "--prompt", "The seller pays. " * 20)
    run("ask_after_gc", "ask", "after", "Who pays?", "--max-tokens", "2")
    run("gc_compact", "gc", "--compact")
    in_process("verify_end", verified)
    subprocess.run(["sync"])
    emit(**out)


def verified(store: Store) -> str:
    """"ok" if `Store.verify` finds nothing (AssertionError naming the problems otherwise)."""
    problems = store.verify()
    assert problems == [], problems
    return "ok"


def shutil_free(path: str) -> int:
    import shutil

    return shutil.disk_usage(path).free


def _fill(path: str, leave: int = 0) -> None:
    """Append to `path` until the disk has `leave` bytes free (0: until ENOSPC)."""
    import errno
    import os

    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        for chunk in (1 << 20, 1 << 16, 1 << 12, 1 << 9):
            while shutil_free(path) - chunk >= leave:
                try:
                    os.write(fd, bytes(chunk))
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        raise
                    break  # a smaller chunk may still fit
    finally:
        os.close(fd)


def _rss() -> int:
    """This process's resident set now (Linux /proc; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            import os

            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


if __name__ == "__main__":
    globals()[f"op_{sys.argv[1]}"](json.loads(sys.argv[2]))
