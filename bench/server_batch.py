"""Continuous batching in `tqstore serve` (issue 30): aggregate tokens/s of concurrent streams
against one stream alone, per scheme, and a short request's first token while a long prompt
prefills.

    python bench/server_batch.py                         # CPU: the tiny random-weight llama (8 layers, 2 KV heads)
    python bench/server_batch.py --model 8b              # GPU: 8 layers of Llama-3.1-8B shapes, random bf16 weights
    python bench/server_batch.py --openblas --blas-threads 1 --runs 5 --write   # CPU, into docs/server.md

One real `tqstore serve` per scheme (`--no-save`, `--max-running` the largest concurrency, at least
2 with a long prompt), all up at once on the same model folder; every measurement alternates between
them, so all see the same machine load. Per run, concurrency and scheme: that many clients at once,
each one streamed completion of `--tokens` tokens (greedy) on its own short prompt; aggregate
tokens/s is the tokens they received over the wall time from the first request sent to the last
stream's end. The ratio is against one client alone in the same run, and the last column against
the first scheme's clients as many at once, measured beside them in the same run. Then, per
scheme: a short streamed request's first token on the idle server, and again while a
`--long`-token prompt prefills (sent first; the short one `--short-after` seconds later, 0.2 by
default). Before any of it, one uncounted round at every concurrency and one long prompt per
server (its chunk shapes new to the server). With `--prefill-profile`, a long prompt's prefill in
this process, chunk by chunk (cold: the first time this process runs those shapes; warm: the same
chunks again): in the engine's 512-token chunks, in the server's chunks
(tqstore/serve/chunking.py), and in 16-token chunks, so each chunk's cost of a new shape shows.

The 8b model is bench/restore_vs_recompute.py's (its builder: hidden 4096, 32 query / 8 KV
heads, head dim 128, MLP 14336, vocabulary 32,000, random weights), 8 layers by default.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import http.client
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(1, str(ROOT))
sys.path.insert(2, str(ROOT / "tests"))

from common import choose_blas, markdown_table, replace_section, stamp  # noqa: E402
from server_process import ServerProcess  # noqa: E402

DOC = ROOT / "docs" / "server.md"
MARKER = "server_batch"
# The decode steps' attention: DecodeBatch's group (raw rows, TurboQuant rows under a block or on their
# CUDA mirrors) and RowStacks (other compressed rows), or one call per row.
FORMS = ("group", "per row")


def say(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def write_model(args, root: Path) -> tuple[Path, int, str]:
    """The model folder, its vocabulary size and a line describing it."""
    import mlx.core as mx

    if args.model == "tiny":
        from model_folder import write_model_folder
        from tiny_models import CONFIGS

        config = CONFIGS["llama"]
        folder = write_model_folder(root / "tiny-llama", kind="llama")
        return folder, config["vocab_size"], (
            f"the tiny random-weight llama of the tests ({config['num_hidden_layers']} layers, hidden "
            f"{config['hidden_size']}, {config['num_attention_heads']} query / {config['num_key_value_heads']} KV "
            "heads, float32)")
    import restore_vs_recompute as rvr

    shapes = argparse.Namespace(layers=args.layers, hidden=4096, mlp=14336, heads=32, kv_heads=8, head_dim=128,
                                vocab=32000)
    gpu = mx.default_device().type == mx.DeviceType.gpu
    dtype = mx.bfloat16 if gpu else mx.float32
    folder = root / "llama-8b-shapes"
    rvr.write_model(folder, shapes, dtype)
    return folder, shapes.vocab, (f"{args.layers} layers of Llama-3.1-8B shapes (bench/restore_vs_recompute.py's "
                                  f"builder) with random {str(dtype).rsplit('.', 1)[-1]} weights")


def stream(server: ServerProcess, prompt, max_tokens: int, t_start: float) -> tuple[int, float, float]:
    """One streamed greedy completion: (tokens received, first-event time, end time), both
    counted from `t_start`."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=600)
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    if response.status != 200:
        raise RuntimeError(f"{response.status}: {response.read()[:300]!r}")
    first, tokens = None, 0
    for line in response:
        if not line.startswith(b"data: {"):
            continue
        if first is None:
            first = time.perf_counter() - t_start
        part = json.loads(line[6:])
        if part.get("usage"):
            tokens = part["usage"]["completion_tokens"]
    conn.close()
    return tokens, first, time.perf_counter() - t_start


def cpu_seconds(pid: int, tid: int | None = None) -> float:
    """User + system CPU time so far of a process (all its threads), or of its thread `tid`, from /proc."""
    path = f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat"
    fields = Path(path).read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def concurrent_rate(server: ServerProcess, prompts: list, max_tokens: int, bursts: int = 1
                    ) -> tuple[float, float, float]:
    """(aggregate tokens per second, tokens per CPU-second of the server, CPU microseconds per
    token of its event loop) over `bursts` rounds of one streamed completion per prompt, all
    sent at once. The second does not count the time the server waited for a core, so it moves
    less with other load on a shared machine; the third is the server's main thread, which runs
    uvicorn's loop (HTTP, the streams' events) and shares the interpreter lock with the model's."""
    pid = server.proc.pid
    tokens, wall = 0, 0.0
    cpu0, loop0 = cpu_seconds(pid), cpu_seconds(pid, pid)
    for _ in range(bursts):
        barrier = threading.Barrier(len(prompts) + 1)
        t0 = [0.0]

        def client(prompt):
            barrier.wait()
            return stream(server, prompt, max_tokens, t0[0])

        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            futures = [pool.submit(client, p) for p in prompts]
            t0[0] = time.perf_counter()
            barrier.wait()
            results = [f.result() for f in futures]
        tokens += sum(r[0] for r in results)
        wall += max(r[2] for r in results)
    cpu, loop = cpu_seconds(pid) - cpu0, cpu_seconds(pid, pid) - loop0
    return tokens / wall, tokens / max(cpu, 1e-9), loop / max(tokens, 1) * 1e6


def decode_rates(engine, loaded, scheme: str, prompts: list, max_tokens: int, group: bool) -> tuple[float, float]:
    """(tokens per second, tokens per CPU-second) of the decode steps alone, in this process:
    one row per prompt through tqstore/engine/batch.py (prefilled first, not timed), stepped
    together until every row has its `max_tokens` (or its end-of-sequence token). `group`
    False: every row attends over its own caches, one call per row (the form before the
    group, kept for rows of 1,024 tokens and more)."""
    from tqstore.engine.batch import DecodeBatch, batched_generation

    rows = [batched_generation(engine, loaded, scheme, p, max_tokens=max_tokens) for p in prompts]
    pending = []
    for row in rows:
        step = next(row)
        while step is None:
            step = next(row)
        pending.append(step)
    tokens, wall, cpu = 0, time.perf_counter(), time.process_time()
    batch = DecodeBatch() if group else DecodeBatch(group_tokens=0)
    while any(p is not None for p in pending):
        live = [i for i, p in enumerate(pending) if p is not None]
        served = {id(r) for r in batch.step(loaded.model, [pending[i] for i in live])}
        tokens += len(served)
        for i in (i for i in live if id(pending[i]) in served):
            try:
                pending[i] = rows[i].send(None)
            except StopIteration:
                pending[i] = None
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return tokens / wall, tokens / cpu


def prefill_profile(engine, loaded, scheme: str, tokens: list[int], chunk,
                    learn=None) -> tuple[float, list[int], list[float]]:
    """(seconds, chunk lengths, seconds per chunk) of `tokens` prefilled into fresh caches through
    Engine.prefill_steps, each chunk sized by `chunk(position)`; `learn(length, seconds, end)` is told
    each chunk's time before the next is sized (as the server's worker tells its sizer)."""
    from turboquant import make_prompt_cache

    starts, lengths, seconds = [], [], []

    def sized(position: int) -> int:
        if starts:
            lengths.append(position - starts[-1])
            if learn is not None:
                learn(lengths[-1], seconds[-1], position)
        starts.append(position)
        return chunk(position)

    t0 = last = time.perf_counter()
    for _ in engine.prefill_steps(loaded, make_prompt_cache(loaded.model, scheme), tokens, chunk=sized):
        now = time.perf_counter()
        seconds.append(now - last)
        last = now
    lengths.append(len(tokens) - starts[-1])
    return time.perf_counter() - t0, lengths, seconds


def profile_rows(engine, loaded, schemes: list[str], long_tokens: int, vocab: int) -> list[list[str]]:
    """The `--prefill-profile` table: per scheme and chunking, a prefill of shapes this process
    has not run (cold), then the same chunks again (warm)."""
    import mlx.core as mx

    from tqstore.serve.chunking import ChunkSizer

    rng = random.Random(1)
    rows = []
    for scheme in schemes:
        # One per scheme, learning over its cold and warm runs, as the server's.
        sizer = ChunkSizer(engine.prefill_chunk, new_shapes_slow=mx.default_device().type == mx.DeviceType.gpu)
        cases = [("server's chunks (chunking.py)", long_tokens, sizer.size, sizer.ran),
                 ("engine, 512-token chunks", long_tokens, lambda position: engine.prefill_chunk, None),
                 ("16-token chunks", min(long_tokens, 2048), lambda position: 16, None)]
        for name, n, chunk, learn in cases:
            tokens = [rng.randrange(8, vocab - 1) for _ in range(n)]
            for run in ("cold", "warm"):
                seconds, lengths, per_chunk = prefill_profile(engine, loaded, scheme, tokens, chunk, learn)
                rows.append([scheme, name, f"{n:,}", run, f"{seconds:.2f}", str(len(lengths)),
                             f"{statistics.median(lengths):.0f}", f"{statistics.median(per_chunk) * 1000:.1f}",
                             f"{max(per_chunk) * 1000:.1f}"])
                say(f"prefill profile: {' | '.join(rows[-1])}")
    return rows


def first_token_beside_long(server: ServerProcess, short, long_prompt, after: float = 0.2
                            ) -> tuple[float, float, float]:
    """(a short request's first token alone, the same while `long_prompt` prefills, the long
    request's own time to its one token), seconds. The short request asks for one token, whose
    event comes when it is decoded: the random-weight models' first tokens are often pieces of
    a character, whose text the server holds back, so a longer stream's first event could be its
    last token, and beside a long prompt each token waits for a chunk of it (before 2026-12-06
    this asked for 4 tokens: on the CPU their one event came with the 4th)."""
    idle = stream(server, short, 1, time.perf_counter())[1]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        long = pool.submit(stream, server, long_prompt, 1, time.perf_counter())
        time.sleep(after)
        busy = stream(server, short, 1, time.perf_counter())[1]
        whole = long.result()[2]
    return idle, busy, whole


def summary(values: list[float], digits: int = 1) -> str:
    return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def ratio(values: list[float], against: list[float]) -> str:
    """Median (min-max) of `values` over `against`, run by run."""
    return f"{summary([v / a for v, a in zip(values, against)], 2)}x"


def cell(values: list[float], alone: list[float]) -> str:
    """Median (min-max) of `values`, and of their ratios to `alone` run by run (unless they are it)."""
    if values is alone:
        return summary(values)
    return f"{summary(values)}, {ratio(values, alone)}"


def server_labels(args: argparse.Namespace) -> list[tuple[str, str, Path]]:
    """(label, scheme, source tree) of each server: one per scheme from this checkout, and with
    `--baseline DIR` one more per scheme from DIR, side by side."""
    mine = [(scheme, scheme, ROOT) for scheme in args.schemes]
    if not args.baseline:
        return mine
    return [(f"{scheme}, this tree", scheme, ROOT) for scheme in args.schemes] + [
        (f"{scheme}, baseline", scheme, Path(args.baseline).resolve()) for scheme in args.schemes]


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=("tiny", "8b"), default="tiny",
                        help="tiny: the tests' tiny llama (CPU); 8b: Llama-3.1-8B shapes, random weights (GPU)")
    parser.add_argument("--layers", type=int, default=8, help="layers of the 8b model (default 8)")
    parser.add_argument("--schemes", nargs="+", default=["raw", "turbo4"])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--tokens", type=int, default=64, help="tokens per completion (default 64)")
    parser.add_argument("--prompt-tokens", type=int, default=16,
                        help="tokens of each short prompt (default 16; 300 puts TurboQuant rows past their first "
                             "256-token block: compressed from the start, where shorter ones decode raw until a "
                             "block is held)")
    parser.add_argument("--ragged", action="store_true",
                        help="prompts of 16, 19, 22, ... tokens (from --prompt-tokens) instead of 16 each: the decode steps alone then run "
                             "rows of unequal length (a masked attention over the group), as the server's rows, which "
                             "join at different steps, always are")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--bursts", type=int, default=1,
                        help="rounds of concurrent completions per measurement (default 1): tokens/s over all of "
                             "them, so that a 64-token round's start (its prompts' prefill, rows joining) weighs "
                             "as it does in a longer run")
    parser.add_argument("--long", type=int, default=None,
                        help="the long prompt's tokens (default 1024 tiny, 16384 8b; 0: skip)")
    parser.add_argument("--short-after", type=float, default=0.2,
                        help="seconds after the long prompt the short request is sent (default 0.2: during a 16k "
                             "prompt's prefill on the H100 and H200; later, into a compressed prompt's encoding)")
    parser.add_argument("--openblas", action="store_true",
                        help="run on Debian's OpenBLAS, as the `tqstore serve` command does (the servers inherit it)")
    parser.add_argument("--blas-threads", type=int, default=None,
                        help="OPENBLAS_NUM_THREADS for this process and the servers (1 on a shared CPU: OpenBLAS's "
                             "threads spin while waiting for each other, and on busy cores a batched step then costs "
                             "several times its work)")
    parser.add_argument("--prefill-profile", action="store_true",
                        help="also time the long prompt's prefill chunk by chunk in this process, cold and warm, in "
                             "the engine's, the server's and 16-token chunks")
    parser.add_argument("--baseline", default=None, metavar="DIR",
                        help="also run each scheme's server from this source tree (a checkout, or a folder holding "
                             "its tqstore, turboquant and cli), measured beside this checkout's")
    parser.add_argument("--write", action="store_true", help="put the table into docs/server.md")
    return parser.parse_args(argv[1:])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv if argv is None else argv
    args = parse(argv)
    choose_blas(argv, args.openblas, args.blas_threads)
    args.concurrency = sorted({1, *args.concurrency})  # the ratios are against one alone
    long_tokens = args.long if args.long is not None else (1024 if args.model == "tiny" else 16384)
    root = Path(tempfile.mkdtemp(prefix="tqstore-server-batch-"))
    servers: dict[str, ServerProcess] = {}
    try:
        folder, vocab, described = write_model(args, root)
        say(f"model folder: {described}")
        # At least 2 running: with 1, the short request beside the long prompt waits for it to end
        # (or to be parked after 1 s), which measures the long prompt, not the interleaving.
        running = max(*args.concurrency, 2 if args.long != 0 else 1)
        for label, scheme, source in server_labels(args):
            servers[label] = ServerProcess(root / f"home-{len(servers)}", folder, "--scheme", scheme, "--no-save",
                                           "--max-running", str(running), "--max-queue", "64", source=source)
            say(f"{label} server on port {servers[label].port}")
        rng = random.Random(0)
        # Short prompts of random ids (none of the first few: special tokens in the tiny tokenizer).
        lengths = [args.prompt_tokens + (3 * i if args.ragged else 0) for i in range(max(args.concurrency))]
        prompts = [[rng.randrange(8, vocab - 1) for _ in range(n)] for n in lengths]
        # Warm-up at every concurrency: the first request builds the codec, and each batch size's
        # first steps compile its shapes (on the H200 a cold first run of 8 raw streams made 130
        # tokens/s against 2,419 warm, 2026-12-06).
        for server in servers.values():
            for c in args.concurrency:
                concurrent_rate(server, prompts[:c], args.tokens)
        rates: dict[tuple[str, int, str], list[float]] = {}  # (scheme, concurrency, "wall" | "cpu" | "loop")
        for run in range(args.runs):
            for c in args.concurrency:
                for scheme, server in servers.items():
                    measured = dict(zip(("wall", "cpu", "loop"),
                                        concurrent_rate(server, prompts[:c], args.tokens, args.bursts)))
                    for kind, rate in measured.items():
                        rates.setdefault((scheme, c, kind), []).append(rate)
                    say(f"run {run + 1}/{args.runs}, {c} concurrent, {scheme}: {measured['wall']:.1f} tokens/s, "
                        f"{measured['cpu']:.1f} tokens per server CPU-second, event loop {measured['loop']:.0f} us "
                        "CPU per token")
        firsts: dict[str, tuple[list[float], list[float], list[float]]] = {}
        if long_tokens:
            long_prompt = [rng.randrange(8, vocab - 1) for _ in range(long_tokens)]
            for scheme, server in servers.items():  # its cold run: the long prompt's chunk shapes are new
                measured = first_token_beside_long(server, prompts[0], long_prompt, args.short_after)
                say(f"warm-up, {scheme}: first token {measured[0] * 1000:.0f} ms idle, {measured[1] * 1000:.0f} ms "
                    f"beside a {long_tokens}-token prefill that took {measured[2]:.2f} s (not counted)")
            for run in range(args.runs):
                for scheme, server in servers.items():
                    measured = first_token_beside_long(server, prompts[0], long_prompt, args.short_after)
                    for kept, value in zip(firsts.setdefault(scheme, ([], [], [])), measured):
                        kept.append(value * 1000)
                    say(f"run {run + 1}/{args.runs}, {scheme}: first token {measured[0] * 1000:.0f} ms idle, "
                        f"{measured[1] * 1000:.0f} ms beside a {long_tokens}-token prefill that took "
                        f"{measured[2]:.2f} s")
        # The servers' memory back before this process loads the model: beside three servers that had
        # prefilled a 16k prompt, an H100 ran out of memory here (2026-12-07, twice).
        for server in servers.values():
            server.stop()
        from tqstore.engine.engine import Engine

        engine = Engine.open(root / "decode-home")  # an empty store: every row is prefilled
        loaded = engine.model(str(folder))
        decodes: dict[tuple[str, str, int, str], list[float]] = {}  # (scheme, attention, rows, "wall" | "cpu")
        for run in range(args.runs):
            for c in args.concurrency:
                for scheme in args.schemes:
                    for form in FORMS:
                        rates_now = decode_rates(engine, loaded, scheme, prompts[:c], args.tokens, form == "group")
                        measured = dict(zip(("wall", "cpu"), rates_now))
                        for kind, rate in measured.items():
                            decodes.setdefault((scheme, form, c, kind), []).append(rate)
                        say(f"run {run + 1}/{args.runs}, decode steps of {c} rows, {scheme}, {form}: "
                            f"{measured['wall']:.1f} tokens/s, {measured['cpu']:.1f} tokens per CPU-second")
        profile = profile_rows(engine, loaded, args.schemes, long_tokens or 1024, vocab) if args.prefill_profile else []
    finally:
        for server in servers.values():
            server.stop()
        shutil.rmtree(root, ignore_errors=True)
    labels = list(servers)
    base = labels[0]  # each run's streams of a server against the first server's of the same run
    rows = [[scheme, str(c)] + [cell(rates[(scheme, c, kind)], rates[(scheme, 1, kind)]) for kind in ("wall", "cpu")]
            + [ratio(rates[(scheme, c, "wall")], rates[(base, c, "wall")]) if scheme != base else "-",
               summary(rates[(scheme, c, "loop")], 0)]
            for scheme in labels for c in args.concurrency]
    header = ["server" if args.baseline else "scheme", "concurrent streams", "tokens/s (x one alone)", "tokens per server CPU-second (x one alone)",
              f"tokens/s x {base}'s, run by run", "event loop CPU per token, us"]
    first = args.prompt_tokens
    bursts_words = f", {args.bursts} rounds per measurement" if args.bursts > 1 else ""
    prompt_words = f"{first}- to {first + 3 * (max(args.concurrency) - 1)}-token" if args.ragged else f"{first}-token"
    body = (f"{stamp(argv)}\n\nModel: {described}; {args.tokens}-token greedy streamed completions of {prompt_words} "
            f"prompts{bursts_words}; median (min-max) of {args.runs} runs, each ratio against one stream alone in the same "
            f"run (the fifth column: against {base}'s streams as many at once, measured beside them in the same "
            "run; the last: the CPU time of the server's event loop thread over the tokens it streamed).\n\n"
            + markdown_table(header, rows))
    decode_rows = [[scheme, form, str(c)] + [cell(decodes[(scheme, form, c, kind)], decodes[(scheme, form, 1, kind)])
                                             for kind in ("wall", "cpu")]
                   for scheme in args.schemes for form in FORMS for c in args.concurrency]
    body += ("\n\nThe decode steps alone, in one process (tqstore/engine/batch.py's `DecodeBatch.step` over rows "
             "prefilled first; no HTTP, no detokenizing for clients), with the rows attending together (group: what "
             "the server does under 1,024 tokens: raw rows, TurboQuant rows under a block and, on CUDA, those on "
             "their decoded mirrors in the group, other compressed rows of one stored layout stacked) and one call per row (`DecodeBatch(group_tokens=0)`, the form before either), "
             "alternating:\n\n"
             + markdown_table(["scheme", "attention", "rows", "tokens/s (x one row)",
                               "tokens per CPU-second (x one row)"], decode_rows))
    if firsts:
        first_rows = [[s, summary(firsts[s][0], 0), summary(firsts[s][1], 0),
                       summary([b / i for i, b in zip(firsts[s][0], firsts[s][1])], 2) + "x",
                       summary(firsts[s][2], 0)] for s in labels]
        body += ("\n\n" + markdown_table(["scheme", "short request's first token, idle, ms",
                                          f"beside a {long_tokens}-token prompt sent {args.short_after:g} s before, ms",
                                          "ratio",
                                          "the long prompt's first token, ms"], first_rows))
    if profile:
        body += ("\n\nA long prompt's prefill in the bench's own process (`--prefill-profile`; Engine.prefill_steps "
                 "into fresh caches; cold: shapes this process has not run, warm: the same chunks again):\n\n"
                 + markdown_table(["scheme", "chunks", "tokens", "run", "seconds", "chunks run", "median length",
                                   "median chunk, ms", "slowest chunk, ms"], profile))
    print(body)
    if args.write:
        replace_section(DOC, MARKER, body)
        say(f"wrote {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
