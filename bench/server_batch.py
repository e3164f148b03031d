"""Continuous batching in `tqstore serve` (issue 30): aggregate tokens/s of concurrent streams
against one stream alone, per scheme, and a short request's first token while a long prompt
prefills.

    python bench/server_batch.py                         # CPU: the tiny random-weight llama (8 layers, 2 KV heads)
    python bench/server_batch.py --model 8b              # GPU: 8 layers of Llama-3.1-8B shapes, random bf16 weights
    python bench/server_batch.py --runs 5 --write        # the table into docs/server.md

One real `tqstore serve` per scheme (`--no-save`, `--max-running` the largest concurrency), all
up at once on the same model folder; every measurement alternates between them, so all see the
same machine load. Per run, concurrency and scheme: that many clients at once, each one
streamed completion of `--tokens` tokens (greedy) on its own short prompt; aggregate tokens/s is
the tokens they received over the wall time from the first request sent to the last stream's
end. The ratio is against one client alone in the same run. Then, per scheme: a short
streamed request's first token on the idle server, and again while a `--long`-token prompt
prefills (sent first; the short one 0.2 s later).

The 8b model is bench/restore_vs_recompute.py's (its builder: hidden 4096, 32 query / 8 KV
heads, head dim 128, MLP 14336, vocabulary 32,000, random weights), 8 layers by default.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import http.client
import json
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

from common import markdown_table, replace_section, stamp  # noqa: E402
from server_process import ServerProcess  # noqa: E402

DOC = ROOT / "docs" / "server.md"
MARKER = "server_batch"


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


def concurrent_rate(server: ServerProcess, prompts: list, max_tokens: int) -> float:
    """Aggregate tokens/s of one streamed completion per prompt, all sent at once."""
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
    return sum(r[0] for r in results) / max(r[2] for r in results)


def first_token_beside_long(server: ServerProcess, short, long_prompt) -> tuple[float, float]:
    """(a short request's first event alone, the same while `long_prompt` prefills), seconds."""
    idle = stream(server, short, 4, time.perf_counter())[1]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        long = pool.submit(stream, server, long_prompt, 1, time.perf_counter())
        time.sleep(0.2)
        busy = stream(server, short, 4, time.perf_counter())[1]
        long.result()
    return idle, busy


def summary(values: list[float], digits: int = 1) -> str:
    return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=("tiny", "8b"), default="tiny",
                        help="tiny: the tests' tiny llama (CPU); 8b: Llama-3.1-8B shapes, random weights (GPU)")
    parser.add_argument("--layers", type=int, default=8, help="layers of the 8b model (default 8)")
    parser.add_argument("--schemes", nargs="+", default=["raw", "turbo4"])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--tokens", type=int, default=64, help="tokens per completion (default 64)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--long", type=int, default=None,
                        help="the long prompt's tokens (default 1024 tiny, 16384 8b; 0: skip)")
    parser.add_argument("--write", action="store_true", help="put the table into docs/server.md")
    return parser.parse_args(argv[1:])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv if argv is None else argv
    args = parse(argv)
    args.concurrency = sorted({1, *args.concurrency})  # the ratios are against one alone
    long_tokens = args.long if args.long is not None else (1024 if args.model == "tiny" else 16384)
    root = Path(tempfile.mkdtemp(prefix="tqstore-server-batch-"))
    servers: dict[str, ServerProcess] = {}
    try:
        folder, vocab, described = write_model(args, root)
        say(f"model folder: {described}")
        for scheme in args.schemes:
            servers[scheme] = ServerProcess(root / f"home-{scheme}", folder, "--scheme", scheme, "--no-save",
                                            "--max-running", str(max(args.concurrency)), "--max-queue", "64")
            say(f"{scheme} server on port {servers[scheme].port}")
        rng = random.Random(0)
        # Short prompts of random ids (none of the first few: special tokens in the tiny tokenizer).
        prompts = [[rng.randrange(8, vocab - 1) for _ in range(16)] for _ in range(max(args.concurrency))]
        for server in servers.values():  # warm-up: the first request builds the codec and compiles
            concurrent_rate(server, prompts[:2], 4)
        rates: dict[tuple[str, int], list[float]] = {}
        ratios: dict[tuple[str, int], list[float]] = {}
        for run in range(args.runs):
            alone: dict[str, float] = {}
            for c in args.concurrency:
                for scheme, server in servers.items():
                    rate = concurrent_rate(server, prompts[:c], args.tokens)
                    rates.setdefault((scheme, c), []).append(rate)
                    alone.setdefault(scheme, rate if c == 1 else None)
                    if alone[scheme]:
                        ratios.setdefault((scheme, c), []).append(rate / alone[scheme])
                    say(f"run {run + 1}/{args.runs}, {c} concurrent, {scheme}: {rate:.1f} tokens/s")
        firsts: dict[str, tuple[list[float], list[float]]] = {}
        if long_tokens:
            long_prompt = [rng.randrange(8, vocab - 1) for _ in range(long_tokens)]
            for run in range(args.runs):
                for scheme, server in servers.items():
                    idle, busy = first_token_beside_long(server, prompts[0], long_prompt)
                    firsts.setdefault(scheme, ([], []))[0].append(idle * 1000)
                    firsts[scheme][1].append(busy * 1000)
                    say(f"run {run + 1}/{args.runs}, {scheme}: first token {idle * 1000:.0f} ms idle, "
                        f"{busy * 1000:.0f} ms beside a {long_tokens}-token prefill")
    finally:
        for server in servers.values():
            server.stop()
        shutil.rmtree(root, ignore_errors=True)
    rows = []
    for c in args.concurrency:
        row = [str(c)]
        for scheme in args.schemes:
            row += [summary(rates[(scheme, c)]), summary(ratios[(scheme, c)], 2) + "x" if c != 1 else "1x"]
        rows.append(row)
    header = ["concurrent streams"] + [h for s in args.schemes for h in (f"{s}: tokens/s", f"{s}: vs 1 alone")]
    body = (f"{stamp(argv)}\n\nModel: {described}; {args.tokens}-token greedy streamed completions of 16-token "
            f"prompts; median (min-max) of {args.runs} runs.\n\n" + markdown_table(header, rows))
    if firsts:
        first_rows = [[s, summary(firsts[s][0], 0), summary(firsts[s][1], 0),
                       summary([b / i for i, b in zip(*firsts[s])], 2) + "x"] for s in args.schemes]
        body += ("\n\n" + markdown_table(["scheme", "first token, idle, ms", f"beside a {long_tokens}-token prefill, ms",
                                          "ratio"], first_rows))
    print(body)
    if args.write:
        replace_section(DOC, MARKER, body)
        say(f"wrote {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
