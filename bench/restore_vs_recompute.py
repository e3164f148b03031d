"""Restore against recompute through the public Engine: the issue-28 table (first token from the
memory tier and from LMDB with its pages dropped, against a cold prefill and a cold read).

    python bench/restore_vs_recompute.py                  # H200: 8 layers of Llama-3.1-8B, 4k-64k, turbo4 raw
    python bench/restore_vs_recompute.py --layers 2 --hidden 512 --mlp 1536 --tokens 512 1024 --runs 2   # CPU
    python bench/restore_vs_recompute.py --json results.json ...    # keep every run's figures as it goes
    python bench/restore_vs_recompute.py --render results.json --write   # the table from kept figures

The model has Llama-3.1-8B's shapes (hidden 4096, 32 query / 8 KV heads, head dim 128, MLP 14336;
vocabulary 32,000 instead of 128,256, which only changes the output head) and random weights
(bf16 on a GPU, float32 on the CPU), built from a config with mlx_lm.models.llama and written as
a model folder with a word-level tokenizer: nothing is downloaded. The context is random token
ids; the question is 16 more.

Per cell (tokens, scheme) and run, in a fresh store home:
- cold: mlx-lm's `stream_generate` over context + question on a fresh plain KVCache, to the first
  token (what answering costs without tqstore);
- plain prefill: the Engine's chunked prefill of the context into plain KVCaches, against the
  prefill inside `save_tokens` (into the scheme's caches), and the save's compress + put
  (fp16-equivalent GB/s: the K/V bytes an fp16 cache of the context holds over those seconds);
- from memory: `generate(..., max_tokens=1)` right after the save (the memory tier: the save's
  joined arrays, so the restore is a slice of them);
- from LMDB: the store closed, data.mdb's pages dropped (posix_fadvise DONTNEED), a fresh Store
  and Engine, `generate` again;
- cold read: data.mdb's pages dropped again and the file read sequentially (the floor).
All cells and runs go side by side in one process; the table gives the median and min-max.
A second table splits each first token from memory and from LMDB into the store's restore, the
question's forward, the first-token step (the last token's forward and the sampling) and the
rest (lookup, building the caches), beside the time that 10x sooner than cold allows.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
# This checkout's tqstore, not the one installed: run from a baseline checkout, the bench
# measures that tree (on 2026-12-06 a "baseline" call measured the installed tree instead).
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))

from common import drop_page_cache, machine_line, markdown_table, git_revision, replace_section  # noqa: E402

DOCS = Path(__file__).resolve().parent.parent / "docs"
MARKER = "bench-restore-vs-recompute"
SECTION = "## Restore against recompute on the H200 (issue 28)"
QUESTION_TOKENS = 16
READ_CHUNK = 16 << 20


def say(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


# -- the model ------------------------------------------------------------------------------

def llama_config(args) -> dict:
    """A Llama config with Llama-3.1-8B's attention shapes (sizes from the flags)."""
    return {"model_type": "llama", "hidden_size": args.hidden, "num_hidden_layers": args.layers,
            "intermediate_size": args.mlp, "num_attention_heads": args.heads, "num_key_value_heads": args.kv_heads,
            "head_dim": args.head_dim, "rms_norm_eps": 1e-5, "vocab_size": args.vocab, "rope_theta": 500000.0,
            "max_position_embeddings": 131072, "tie_word_embeddings": False}


def write_tokenizer(path: Path, vocab: int) -> int:
    """A word-level tokenizer covering every id of the model (so any sampled token decodes);
    returns its end-of-sequence id."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    words = {f"w{i}": i for i in range(vocab)}
    tok = Tokenizer(models.WordLevel(words, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.save(str(path / "tokenizer.json"))
    eos = vocab - 1
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": f"w{eos}",
        "pad_token": "w0", "unk_token": "w0"}))
    return eos


def write_model(path: Path, args, dtype) -> None:
    """Random weights at the configured shapes, written as an mlx-lm model folder."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama

    path.mkdir(parents=True, exist_ok=True)
    config = llama_config(args)
    mx.random.seed(0)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    model.set_dtype(dtype)
    weights = dict(tree_flatten(model.parameters()))
    mx.eval(weights)
    eos = write_tokenizer(path, args.vocab)
    config.update(eos_token_id=eos, bos_token_id=0, torch_dtype=str(dtype).rsplit(".", 1)[-1])
    (path / "config.json").write_text(json.dumps(config))
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    del model, weights
    mx.clear_cache()


# -- one cell -------------------------------------------------------------------------------

def cold_first_token(loaded, prompt: list[int]) -> float:
    """Seconds from nothing to the first token with mlx-lm alone (plain KVCache)."""
    from mlx_lm import stream_generate
    from mlx_lm.models.cache import make_prompt_cache

    t0 = time.perf_counter()
    for _ in stream_generate(loaded.model, loaded.tokenizer, prompt=prompt, max_tokens=1,
                             prompt_cache=make_prompt_cache(loaded.model)):
        break
    return time.perf_counter() - t0


def plain_prefill(engine, loaded, context: list[int]) -> float:
    """The Engine's chunked prefill of `context` into plain KVCaches (the save's yardstick)."""
    from mlx_lm.models.cache import make_prompt_cache

    return engine.prefill(loaded, make_prompt_cache(loaded.model), context)


def first_token(engine, loaded, scheme: str, prompt: list[int], tier: str) -> dict:
    """`generate(..., max_tokens=1)`: wall seconds, the tier it used, and where the seconds went:
    the store's restore (fetch, verify, join, evaluate), the question's forward (all but its
    last token, over the restored caches), the first-token step (the last token's forward and
    the sampling, mlx-lm's `stream_generate`), and the rest (the lookup, building the caches
    from the snapshot, Python between the steps)."""
    t0 = time.perf_counter()
    answer = engine.generate(loaded, scheme, prompt, max_tokens=1)
    wall = time.perf_counter() - t0
    if answer.tier != tier or answer.cached_tokens == 0:
        raise RuntimeError(f"expected a restore from {tier}, got {answer.tier!r} ({answer.cached_tokens} tokens)")
    return {"seconds": wall, "restore_seconds": answer.restore_seconds, "cached_tokens": answer.cached_tokens,
            "question_seconds": answer.prefill_seconds, "step_seconds": answer.generation_seconds,
            "other_seconds": wall - answer.restore_seconds - answer.prefill_seconds - answer.generation_seconds}


def cold_read(path: Path) -> dict:
    """Drop the file's pages, then read it sequentially: (bytes, seconds)."""
    drop_page_cache(path)
    buffer = bytearray(READ_CHUNK)
    view = memoryview(buffer)
    total = 0
    fd = os.open(path, os.O_RDONLY)
    try:
        t0 = time.perf_counter()
        while n := os.readv(fd, [view]):
            total += n
        seconds = time.perf_counter() - t0
    finally:
        os.close(fd)
    return {"bytes": total, "seconds": seconds, "allocated": os.stat(path).st_blocks * 512}


@contextlib.contextmanager
def timing_compress_and_put(store):
    """Seconds the save inside spends in `TurboQuantKVCache.compress` and in `store.put` (on a
    GPU compress is lazy: its work is evaluated inside the put, so only the sum is meaningful)."""
    from turboquant import TurboQuantKVCache

    spent = {"compress": 0.0, "put": 0.0}

    def timed(fn, key):
        def run(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[key] += time.perf_counter() - t0
        return run

    compress = TurboQuantKVCache.compress
    TurboQuantKVCache.compress = timed(compress, "compress")
    store.put = timed(store.put, "put")
    try:
        yield spent
    finally:
        TurboQuantKVCache.compress = compress
        del store.put


def warm_up(root: Path, loaded, lengths: list[int]) -> None:
    """One untimed cold prefill and one untimed Engine prefill at each context length before any
    cell: the first prefill of a shape pays MLX's builds for it (15.7 s against 0.43 s at 32k in
    one H200 run), which would land in whichever cell ran first and make the cold column a
    measure of the run order. The Engine's chunks are other shapes than mlx-lm's: without its own
    warm-up the plain prefill of the first scheme at each length paid them (0.42-5.2 s in run 1
    at 166a8b4, against 0.05-1.4 s afterwards), which skewed the save's prefill ratio."""
    from tqstore.config import load_config
    from tqstore.engine.engine import Engine
    from tqstore.store.store import Store

    vocab = loaded.model.args.vocab_size
    home = root / "warm-up-home"
    store = Store.open(home, config=load_config(home))
    try:
        engine = Engine(store)
        engine.use_model(loaded)
        for tokens in lengths:
            context = [1 + (i * 7919) % (vocab - 2) for i in range(tokens + QUESTION_TOKENS)]
            seconds = cold_first_token(loaded, context)
            plain = plain_prefill(engine, loaded, context[:tokens])
            say(f"warm-up: a cold prefill of {tokens:,} tokens took {seconds:.3f} s, the Engine's plain prefill "
                f"{plain:.3f} s (neither counted)")
    finally:
        store.close()
        shutil.rmtree(home, ignore_errors=True)


def one_cell(root: Path, loaded, tokens: int, scheme: str, run: int, rng: random.Random) -> dict:
    """Every measurement of one (tokens, scheme) run, in its own store home (removed after)."""
    import mlx.core as mx

    from tqstore.config import load_config
    from tqstore.engine.engine import Engine
    from tqstore.store.store import Store

    vocab = loaded.model.args.vocab_size
    context = [rng.randrange(1, vocab - 1) for _ in range(tokens)]
    prompt = context + [rng.randrange(1, vocab - 1) for _ in range(QUESTION_TOKENS)]
    home = root / f"home-{tokens}-{scheme}-{run}"
    shutil.rmtree(home, ignore_errors=True)
    config = load_config(home)
    row: dict = {"tokens": tokens, "scheme": scheme, "run": run}
    store = Store.open(home, config=config)
    try:
        engine = Engine(store)
        engine.use_model(loaded)
        row["cold"] = cold_first_token(loaded, prompt)
        row["plain_prefill"] = plain_prefill(engine, loaded, context)
        mx.clear_cache()
        t0 = time.perf_counter()
        with timing_compress_and_put(store) as spent:
            saved = engine.save_tokens(f"ctx-{tokens}", loaded, context, scheme=scheme)
        row["save"] = time.perf_counter() - t0
        row["compress_put"] = spent["compress"] + spent["put"]
        row["save_prefill"] = saved.prefill_seconds
        margs = loaded.model.args  # K and V of every layer at 2 bytes an element: what an fp16 cache holds
        row["fp16_bytes"] = 2 * 2 * tokens * margs.num_hidden_layers * margs.num_key_value_heads \
            * (margs.head_dim or margs.hidden_size // margs.num_attention_heads)
        row["stored_bytes"] = store.get(f"ctx-{tokens}").nbytes
        row["memory"] = first_token(engine, loaded, scheme, prompt, "memory")
    finally:
        store.close()
    data = home / "lmdb" / "data.mdb"
    drop_page_cache(data)
    store = Store.open(home, config=config)
    try:
        store.stats()  # opening the environment is not part of a restore
        engine = Engine(store)
        engine.use_model(loaded)
        row["lmdb"] = first_token(engine, loaded, scheme, prompt, "lmdb")
    finally:
        store.close()
    row["read"] = cold_read(data)
    shutil.rmtree(home, ignore_errors=True)
    mx.clear_cache()
    return row


# -- the table ------------------------------------------------------------------------------

def summary(values: list[float], digits: int = 3, unit: str = " s") -> str:
    """Median and min-max of several runs."""
    median = f"{statistics.median(values):.{digits}f}{unit}"
    if len(values) == 1:
        return median
    return f"{median} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def gbps(rows: list[dict], seconds) -> str:
    return summary([r["stored_bytes"] / seconds(r) / 1e9 for r in rows], 2, "")


def compress_put(runs: list[dict]) -> str:
    """fp16-equivalent GB/s of a save's compress and put (issue 28's target: 5 GB/s on the H200,
    0.5 on the CPU). Rows kept before the column existed: "-"."""
    if any("compress_put" not in r for r in runs):
        return "-"
    return summary([r["fp16_bytes"] / max(r["compress_put"], 1e-9) / 1e9 for r in runs], 2, "")


def tables(rows: list[dict]) -> str:
    """The restore table and the save-prefill table, one line per (tokens, scheme)."""
    cells: dict[tuple[int, str], list[dict]] = {}
    failures: list[dict] = []
    for row in rows:
        (failures if "error" in row else cells.setdefault((row["tokens"], row["scheme"]), [])).append(row)
    restore, save = [], []
    for (tokens, scheme), runs in cells.items():
        cold = statistics.median(r["cold"] for r in runs)

        def vs(key: str) -> str:
            values = [r[key]["seconds"] for r in runs]
            return f"{summary(values)}, {cold / statistics.median(values):.2f}x"

        restore.append([f"{tokens:,}", scheme, f"{statistics.median(r['stored_bytes'] for r in runs) / 1e6:,.0f}",
                        summary([r['cold'] for r in runs]), vs("memory"), vs("lmdb"),
                        gbps(runs, lambda r: r["memory"]["restore_seconds"]),
                        gbps(runs, lambda r: r["lmdb"]["restore_seconds"]),
                        summary([r["read"]["bytes"] / r["read"]["seconds"] / 1e9 for r in runs], 2, "")])
        plain = statistics.median(r["plain_prefill"] for r in runs)
        save.append([f"{tokens:,}", scheme, summary([r['plain_prefill'] for r in runs]),
                     f"{summary([r['save_prefill'] for r in runs])}, "
                     f"{statistics.median(r['save_prefill'] for r in runs) / plain:.2f}x",
                     summary([r['save'] for r in runs]), compress_put(runs)])
    text = markdown_table(["tokens", "scheme", "stored MB", "cold prefill + 1st token", "from memory (ratio)",
                           "from LMDB, pages dropped (ratio)", "memory restore GB/s", "LMDB restore GB/s",
                           "cold-read GB/s"], restore)
    text += "\n\n" + breakdown(cells)
    text += "\n\n" + markdown_table(["tokens", "scheme", "plain prefill (Engine, KVCache)",
                                     "prefill inside save (x plain)", "whole save (prefill + compress + put)",
                                     "compress + put GB/s fp16-eq"], save)
    for f in failures:
        text += f"\n\nFailed: {f['tokens']:,} tokens {f['scheme']} run {f['run']}: {f['error']}"
    return text


PARTS = (("restore_seconds", "restore"), ("question_seconds", "question forward"),
         ("step_seconds", "first-token step"), ("other_seconds", "lookup + caches + rest"))


def breakdown(cells: dict[tuple[int, str], list[dict]]) -> str:
    """Where a first token's seconds go, from memory and from LMDB: the store's restore, the
    question's forward, the first-token step (last token's forward + sampling) and the rest,
    median (min-max) over the runs; with what 10x sooner than cold would allow in all."""
    rows = []
    for (tokens, scheme), runs in cells.items():
        for tier in ("memory", "lmdb"):
            if not all("question_seconds" in r[tier] for r in runs):
                continue  # figures kept before the breakdown was measured
            rows.append([f"{tokens:,}", scheme, tier, summary([r[tier]["seconds"] for r in runs]),
                         *(summary([r[tier][key] for r in runs]) for key, _ in PARTS),
                         f"{statistics.median(r['cold'] for r in runs) / 10:.3f} s"])
    if not rows:
        return "(no breakdown: these figures were kept before it was measured)"
    return markdown_table(["tokens", "scheme", "from", "first token", *(name for _, name in PARTS),
                           "10x sooner than cold"], rows)


def section(results: dict) -> str:
    meta = results["meta"]
    runs = max((r["run"] for r in results["rows"]), default=0) + 1
    return (f"Through the public Engine, {meta['model']}. Ratios are the cold median over the tier's median "
            f"(above 1: the store answers sooner). Times are median (min-max) of {runs} runs per cell, all cells "
            f"side by side in one process, after {meta.get('warm_up', 'one untimed cold prefill')} at each length; "
            f"restore GB/s is stored bytes over the Engine's restore seconds; "
            f"the cold read is data.mdb read sequentially after dropping its pages (the file holds the entry "
            f"plus LMDB's pages). Store homes under {meta['tmp']} ({meta['fs']}).\n\n"
            f"{tables(results['rows'])}\n\n"
            f"Command: `{meta['command']}` (git {meta['revision']}, {meta['date']}). Machine: {meta['machine']}.")


def write_doc(path: Path, body: str) -> None:
    """Put the section between its markers (a new section at the end the first time)."""
    text = path.read_text() if path.exists() else ""
    if f"<!-- {MARKER}:start -->" not in text:
        path.write_text(text.rstrip() + f"\n\n{SECTION}\n")
    replace_section(path, MARKER, body)


def filesystem(path: Path) -> str:
    """The file system a folder lives on (page dropping means nothing on tmpfs)."""
    best, kind = "", "unknown file system"
    try:
        for line in Path("/proc/mounts").read_text().splitlines():
            _, mount, fs, *_ = line.split()
            if str(path.resolve()).startswith(mount) and len(mount) > len(best):
                best, kind = mount, fs
    except OSError:
        pass
    return kind


# -- main -----------------------------------------------------------------------------------

def model_arguments(parser: argparse.ArgumentParser) -> None:
    """The model's shape flags (`llama_config`, `write_model`): Llama-3.1-8B's, 8 layers, by default."""
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--mlp", type=int, default=14336)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=32000)


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384, 32768, 65536])
    parser.add_argument("--schemes", nargs="+", default=["turbo4", "raw"])
    parser.add_argument("--runs", type=int, default=3)
    model_arguments(parser)
    parser.add_argument("--memory-limit-gb", type=float, default=100.0,
                        help="mx.set_memory_limit on a GPU (the H200 has about 139 GiB)")
    parser.add_argument("--tmp", type=Path, default=Path(tempfile.gettempdir()),
                        help="where the model folder and the store homes go")
    parser.add_argument("--json", type=Path, help="write every run's figures here as they come")
    parser.add_argument("--render", type=Path, help="only print (and --write) the table of a --json file")
    parser.add_argument("--revision", default=None, help="the git revision to name (default: HEAD)")
    parser.add_argument("--write", action="store_true", help="put the section into --out")
    parser.add_argument("--out", type=Path, default=DOCS / "benchmarks.md")
    return parser.parse_args(argv[1:])


def measure(args, argv: list[str]) -> dict:
    import mlx.core as mx

    from tqstore.config import load_config
    from tqstore.engine.engine import Engine
    from tqstore.store.store import Store

    gpu = mx.default_device().type == mx.DeviceType.gpu
    if gpu and args.memory_limit_gb > 0:
        mx.set_memory_limit(int(args.memory_limit_gb * (1 << 30)))
    dtype = mx.bfloat16 if gpu else mx.float32
    root = Path(tempfile.mkdtemp(prefix="tqstore-restore-vs-recompute-", dir=args.tmp))
    model_dir = root / "model"
    t0 = time.perf_counter()
    write_model(model_dir, args, dtype)
    say(f"model folder written in {time.perf_counter() - t0:.1f} s: {model_dir}")
    model_store = Store.open(root / "model-home", config=load_config(root / "model-home"))
    loaded = Engine(model_store).model(str(model_dir))
    model_store.close()
    say(f"model loaded ({loaded.identity.hexdigest[:12]}), device {mx.default_device()}")
    results = {"meta": {
        "command": "python " + " ".join([f"bench/{Path(argv[0]).name}", *argv[1:]]),
        "revision": args.revision or git_revision(), "date": time.strftime("%Y-%m-%d"), "machine": machine_line(),
        "tmp": str(args.tmp), "fs": filesystem(args.tmp),
        "warm_up": "one untimed cold prefill and one untimed Engine prefill",
        "model": (f"a Llama model ({args.layers} layers, hidden {args.hidden}, {args.heads} query / {args.kv_heads} "
                  f"KV heads, head dim {args.head_dim}, MLP {args.mlp}, vocabulary {args.vocab:,}) with random "
                  f"{str(dtype).rsplit('.', 1)[-1]} weights, a context of random token ids and a "
                  f"{QUESTION_TOKENS}-token question, `generate(..., max_tokens=1)`")},
        "rows": []}
    rng = random.Random(0)
    try:
        warm_up(root, loaded, args.tokens)
        for run in range(args.runs):
            for tokens in args.tokens:
                for scheme in args.schemes:
                    t0 = time.perf_counter()
                    try:
                        row = one_cell(root, loaded, tokens, scheme, run, rng)
                    except Exception as e:  # a cell that fails (memory) is reported, the rest still run
                        traceback.print_exc()
                        row = {"tokens": tokens, "scheme": scheme, "run": run, "error": f"{type(e).__name__}: {e}"}
                        mx.clear_cache()
                    results["rows"].append(row)
                    if "error" not in row:
                        parts = ", ".join(f"{name} {row['memory'][key]:.3f}" for key, name in PARTS)
                        say(f"run {run + 1}/{args.runs} {tokens} {scheme}: cold {row['cold']:.3f} s, memory "
                            f"{row['memory']['seconds']:.3f} s ({parts}), lmdb {row['lmdb']['seconds']:.3f} s, "
                            f"save prefill "
                            f"{row['save_prefill']:.3f} s vs {row['plain_prefill']:.3f} s, compress + put "
                            f"{row['compress_put']:.3f} s, "
                            f"{row['stored_bytes'] / 1e6:.0f} MB ({time.perf_counter() - t0:.1f} s, peak "
                            f"{mx.get_peak_memory() / 2**30:.1f} GiB)")
                    if args.json:
                        args.json.write_text(json.dumps(results, indent=1))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return results


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv if argv is None else argv
    args = parse(argv)
    results = json.loads(args.render.read_text()) if args.render else measure(args, argv)
    body = section(results)
    if args.write:
        write_doc(args.out, body)
        say(f"wrote {args.out}")
    print(body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
