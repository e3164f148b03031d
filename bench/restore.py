"""Time to first token, restore vs recompute, and save/restore throughput per tier and scheme.

For each context length the real model prefills the context once (uncompressed); that prefill
plus a 16-token question and the first answer token on a plain mlx-lm KVCache is the cold
time to first token. Each scheme then compresses the same prefix, stores it, and answers the
same question from the memory tier, from LMDB (after evicting the file from the page cache)
and from an S3 server on loopback. Ratios are measured side by side in one run.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx

from common import LocalS3, compressed, drop_page_cache

QUESTION_TOKENS = 16


@dataclass
class TierRow:
    context: int
    scheme: str
    tier: str
    restore_seconds: float  # lookup + fetch + verify + assemble, evaluated
    ttft_seconds: float  # restore + question prefill + first token
    cold_ttft_seconds: float
    restored_tokens: int

    @property
    def ratio(self) -> float:
        return self.cold_ttft_seconds / self.ttft_seconds


@dataclass
class SaveRow:
    context: int
    scheme: str
    stored_bytes: int
    fp16_bytes: int
    compress_seconds: float
    put_seconds: float
    push_seconds: float = 0.0
    restore_seconds: dict = field(default_factory=dict)  # tier -> seconds

    @property
    def bytes_per_token(self) -> float:
        return self.stored_bytes / self.context


@dataclass
class Context:
    """What every scheme of one context length shares."""

    tokens: list[int]
    question: list[int]
    raw: object  # the uncompressed snapshot of the context
    cold_ttft: float
    prefill_seconds: float
    fp16_bytes: int


def fp16_kv_bytes(snapshot, tokens: int) -> int:
    """Bytes an fp16 cache of these layers needs for `tokens` tokens (K and V)."""
    total = 0
    for record in snapshot.layers:
        keys = record.arrays.get("keys")
        if keys is not None:
            total += 2 * keys.shape[1] * (keys.shape[3] + record.arrays["values"].shape[3]) * tokens
    return total


def prepare_context(model, tokens: list[int], prefill) -> Context:
    from mlx_lm.models.cache import make_prompt_cache as mlx_make_prompt_cache

    from turboquant import restore_as
    from turboquant.quality import raw_prefix

    context, question = tokens[:-QUESTION_TOKENS], tokens[-QUESTION_TOKENS:]
    t0 = time.perf_counter()
    raw = raw_prefix(model, mx.array(context))
    prefill_seconds = time.perf_counter() - t0
    caches = restore_as(raw, mlx_make_prompt_cache(model))
    mx.eval([c.state for c in caches])
    t1 = time.perf_counter()
    prefill(model, caches, question[:-1])
    mx.eval(model(mx.array(question[-1:])[None], cache=caches))
    cold = prefill_seconds + time.perf_counter() - t1
    return Context(context, question, raw, cold, prefill_seconds, fp16_kv_bytes(raw, len(context)))


def answer_first_token(engine, loaded, scheme: str, ctx: Context) -> tuple[float, float, str, int]:
    """(ttft, restore seconds, tier, restored tokens) for the question after the stored context."""
    from turboquant import restore

    prompt = ctx.tokens + ctx.question
    codec = engine.codec_identity(loaded, scheme)
    t0 = time.perf_counter()
    match = engine.store.lookup(prompt[:-1], model=loaded.identity.digest, codec=codec.digest)
    if match is None:
        raise RuntimeError(f"{scheme}: the stored context was not found")
    snap, stats = engine.store.restore(match)
    caches = restore(snap)
    # The restore's count, not the lookup's: a block lost in every tier restores fewer tokens.
    engine.prefill(loaded, caches, prompt[stats.tokens:-1])
    mx.eval(loaded.model(mx.array(prompt[-1:])[None], cache=caches))
    return time.perf_counter() - t0, stats.seconds, stats.tier, stats.tokens


def run_scheme(ctx: Context, scheme: str, loaded, home: Path, s3: LocalS3 | None) -> tuple[SaveRow, list[TierRow]]:
    from tqstore.config import load_config
    from tqstore.engine.engine import Engine
    from tqstore.store.store import Store

    overrides = {"s3_url": s3.url(home.name), "s3_endpoint": s3.endpoint} if s3 else {}
    config = load_config(home, overrides)
    store = Store.open(home, config=config)
    engine = Engine(store)
    engine.use_model(loaded)
    name = f"ctx{len(ctx.tokens)}-{scheme}"
    snap, compress_seconds = compressed(loaded.model, ctx.raw, scheme)
    t1 = time.perf_counter()
    result = store.put(name, snap, ctx.tokens, model=loaded.identity, codec=engine.codec_identity(loaded, scheme),
                       model_ref=str(loaded.path), prefill_seconds=ctx.prefill_seconds)
    t2 = time.perf_counter()
    save = SaveRow(len(ctx.tokens), scheme, result.manifest.nbytes, ctx.fp16_bytes, compress_seconds, t2 - t1)
    rows = []

    def measure(tier_store):
        engine = Engine(tier_store)  # an Engine's parts hold its store: one engine per open store
        engine.use_model(loaded)
        ttft, restore_s, tier, n = answer_first_token(engine, loaded, scheme, ctx)
        save.restore_seconds[tier] = restore_s
        rows.append(TierRow(len(ctx.tokens), scheme, tier, restore_s, ttft, ctx.cold_ttft, n))

    measure(store)  # memory: put keeps the blocks hot
    store.close()
    drop_page_cache(home / "lmdb" / "data.mdb")
    store = Store.open(home, config=config)
    store.stats()  # opening is not part of a restore
    measure(store)
    if s3:
        t3 = time.perf_counter()
        store.push(name)
        save.push_seconds = time.perf_counter() - t3
        store.close()
        remote_home = home.with_name(home.name + "-remote")
        remote = Store.open(remote_home, config=load_config(remote_home, overrides))
        remote.ls(remote=True)  # refresh the remote index outside the timing
        measure(remote)
        remote.close()
    else:
        store.close()
    return save, rows


def lmdb_put_floor(nbytes: int, segment: int = 1 << 20) -> float:
    """Seconds for a plain LMDB put of `nbytes` in 1 MiB values (one transaction, synced)."""
    import os

    import lmdb

    payload = os.urandom(nbytes)
    with tempfile.TemporaryDirectory() as d:
        env = lmdb.open(d, map_size=max(1 << 30, 4 * nbytes))
        t0 = time.perf_counter()
        with env.begin(write=True) as txn:
            for i in range(0, nbytes, segment):
                txn.put(i.to_bytes(8, "big"), payload[i:i + segment])
        env.sync(True)
        seconds = time.perf_counter() - t0
        env.close()
    return seconds


def boto3_floor(s3: LocalS3, nbytes: int) -> tuple[float, float]:
    """Seconds to upload and download `nbytes` as one object with plain boto3."""
    import os

    payload = os.urandom(nbytes)
    t0 = time.perf_counter()
    s3.client.put_object(Bucket=s3.bucket, Key="floor/object", Body=payload)
    t1 = time.perf_counter()
    s3.client.get_object(Bucket=s3.bucket, Key="floor/object")["Body"].read()
    return t1 - t0, time.perf_counter() - t1


def dedup_push(loaded, ctx: Context, scheme: str, home: Path, s3: LocalS3, extra_tokens: list[int]) -> dict:
    """Push an entry, then a second one sharing its context as a prefix: bytes uploaded each time."""
    from tqstore.config import load_config
    from tqstore.engine.engine import Engine
    from tqstore.store.store import Store

    config = load_config(home, {"s3_url": s3.url(home.name), "s3_endpoint": s3.endpoint})
    store = Store.open(home, config=config)
    engine = Engine(store)
    engine.use_model(loaded)
    first = engine.save_tokens("first", loaded, ctx.tokens, scheme=scheme)
    push1 = store.push("first")
    second = engine.save_tokens("second", loaded, ctx.tokens + extra_tokens, scheme=scheme)
    push2 = store.push("second")
    total = store.get("second").nbytes
    store.close()
    return {"first_bytes": push1.bytes, "second_total": total, "second_uploaded": push2.bytes,
            "second_reused_tokens": second.reused_tokens, "first_tokens": first.tokens}


def fresh_home(root: Path, name: str) -> Path:
    home = root / name
    shutil.rmtree(home, ignore_errors=True)
    return home
