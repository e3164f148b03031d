"""Where a `tqstore serve` under concurrent requests spends its time (issue 30): streamed and
whole (unstreamed) completions side by side, with the server's own decode-step metrics and the
CPU seconds of its busiest threads.

    python bench/server_threads.py --model 8b --scheme raw      # GPU: 8 layers of Llama-3.1-8B shapes
    python bench/server_threads.py --model tiny --scheme turbo4 # CPU: the tests' tiny llama

One real server (`--no-save`). Per round, kind (streamed, whole) and concurrency (1 and
`--concurrency`): `--runs` bursts of that many 64-token greedy completions of 16-token prompts,
sent at once. Printed per cell: each burst's aggregate tokens/s; the decode steps the server
ran (from /metrics: how many, their mean seconds, rows per step); the CPU seconds of the
server's four busiest threads (on a GPU host the model thread, then the HTTP event loop; on the
CPU, MLX's compute thread comes first).
A whole completion wakes the event loop once, a streamed one once per token: the difference
between the two is what streaming costs the model thread.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import http.client
import json
import os
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "bench"), str(ROOT), str(ROOT / "tests")]

import server_batch  # noqa: E402
from server_process import ServerProcess  # noqa: E402


def whole(server: ServerProcess, prompt: list[int], max_tokens: int) -> int:
    """One unstreamed greedy completion; its completion tokens."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=600)
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    answer = json.loads(conn.getresponse().read())
    conn.close()
    return answer["usage"]["completion_tokens"]


def whole_rate(server: ServerProcess, prompts: list[list[int]], max_tokens: int) -> float:
    """Aggregate tokens/s of one unstreamed completion per prompt, all sent at once."""
    barrier = threading.Barrier(len(prompts) + 1)

    def client(prompt):
        barrier.wait()
        return whole(server, prompt, max_tokens)

    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(client, p) for p in prompts]
        t0 = time.perf_counter()
        barrier.wait()
        tokens = sum(f.result() for f in futures)
    return tokens / (time.perf_counter() - t0)


def thread_seconds(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) of each thread of a process so far."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rpartition(")")[2].split()
        except FileNotFoundError:  # the thread ended
            continue
        out[tid] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return out


def metric(server: ServerProcess, name: str) -> float:
    """A metric's value summed over its labels, from /metrics."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith(name + " ") or line.startswith(name + "{"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=("tiny", "8b"), default="tiny")
    parser.add_argument("--layers", type=int, default=8, help="layers of the 8b model")
    parser.add_argument("--scheme", default="raw")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--runs", type=int, default=4, help="bursts per cell")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="tqstore-server-threads-"))
    folder, vocab, described = server_batch.write_model(args, root)
    print(f"model: {described}; scheme {args.scheme}", flush=True)
    server = ServerProcess(root / "home", folder, "--scheme", args.scheme, "--no-save",
                           "--max-running", str(args.concurrency), "--max-queue", "64")
    try:
        rng = random.Random(0)
        prompts = [[rng.randrange(8, vocab - 1) for _ in range(16)] for _ in range(args.concurrency)]
        server_batch.concurrent_rate(server, prompts[:2], 4)  # warm-up: shapes, codec
        server_batch.concurrent_rate(server, prompts, 8)
        for _ in range(args.rounds):
            for kind in ("streamed", "whole"):
                for c in sorted({1, args.concurrency}):
                    before = thread_seconds(server.proc.pid)
                    steps0 = [metric(server, f"tqstore_{m}") for m in
                              ("decode_step_seconds_sum", "decode_step_seconds_count", "batch_size_sum")]
                    rates = [server_batch.concurrent_rate(server, prompts[:c], args.tokens)[0] if kind == "streamed"
                             else whole_rate(server, prompts[:c], args.tokens) for _ in range(args.runs)]
                    after = thread_seconds(server.proc.pid)
                    seconds, steps, rows = (metric(server, f"tqstore_{m}") - s for m, s in zip(
                        ("decode_step_seconds_sum", "decode_step_seconds_count", "batch_size_sum"), steps0))
                    busiest = sorted((after[t] - before.get(t, 0.0) for t in after), reverse=True)[:4]
                    print(f"{kind} c={c}: tokens/s {[round(r) for r in rates]}; steps {steps:.0f}, mean step "
                          f"{1000 * seconds / max(steps, 1):.2f} ms, rows/step {rows / max(steps, 1):.2f}; "
                          f"busiest threads' CPU-s {[round(b, 2) for b in busiest]}", flush=True)
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
