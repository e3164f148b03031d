"""The HTTP layer of `tqstore serve`, two implementations side by side: request latency and
hostile clients.

    python bench/server_http.py                      # this tree against ad056ea (http.server)
    python bench/server_http.py --old /path/to/tree --runs 20 --write

Two real `tqstore serve` subprocesses on loopback serve the same tiny random-weight model
(tests/model_folder.py, `--no-save`): the "old" one from another source tree (a path, or a git
revision unpacked with `git archive` into a temporary folder; by default ad056ea, the last
commit on http.server) and the "new" one from this tree. Every measurement alternates between
the two, so both see the same machine load. Measured, per server:

- a short completion (4 tokens, greedy; a new connection each): median and range of `--runs`;
- a streamed completion (32 tokens): time to its first event and to its end;
- /healthz and /metrics round trips (a new connection each), and /healthz on one kept-alive
  connection;
- the same completion while `--slow` slow clients hold connections (half sent part of a request
  head, half a whole head and part of a body; none sends more);
- a flood: `--flood` clients connect at once and each asks /healthz: wall time, p50/p99 and how
  many got 200, 503 or no answer;
- a 1 GiB body announced (64 KiB sent): the time to the 413.

`--write` puts the table in docs/server.md.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import http.client
import json
import socket
import statistics
import subprocess
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
from model_folder import write_model_folder  # noqa: E402
from server_process import ServerProcess  # noqa: E402

DOC = ROOT / "docs" / "server.md"
OLD = "ad056ea"  # the last commit whose server ran on http.server
COMPLETION = {"prompt": "Who pays for delays?", "max_tokens": 4, "temperature": 0}
# Greedy decoding of this prompt on the tiny model repeats one printable token (tests/
# test_server_lifecycle.py): every token is an event of its own.
STREAM = {"prompt": "Slow one: abscond abscond abscond", "max_tokens": 32, "temperature": 0, "stream": True}


def source_tree(spec: str, scratch: Path) -> Path:
    """A source tree: `spec` itself if it is a folder, else that git revision of this repository."""
    if Path(spec).is_dir():
        return Path(spec).resolve()
    tree = scratch / f"tree-{spec.replace('/', '_')}"
    tree.mkdir()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", spec], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    return tree


def call(server: ServerProcess, method: str, path: str, body: dict | None = None,
         conn: http.client.HTTPConnection | None = None) -> tuple[int, float]:
    """(status, seconds) of one request, on `conn` or a new connection."""
    own = conn is None
    conn = conn or http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    t0 = time.perf_counter()
    try:
        conn.request(method, path, None if body is None else json.dumps(body),
                     {"Content-Type": "application/json"} if body is not None else {})
        response = conn.getresponse()
        response.read()
        return response.status, time.perf_counter() - t0
    finally:
        if own:
            conn.close()


def timed(server: ServerProcess, method: str, path: str, body: dict | None = None) -> float:
    status, seconds = call(server, method, path, body)
    assert status == 200, (path, status)
    return seconds


def streamed(server: ServerProcess) -> tuple[float, float]:
    """(seconds to the first event, seconds to the end) of a streamed 32-token completion."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    t0 = time.perf_counter()
    try:
        conn.request("POST", "/v1/completions", json.dumps(STREAM), {"Content-Type": "application/json"})
        response = conn.getresponse()
        assert response.status == 200
        response.readline()
        first = time.perf_counter() - t0
        response.read()
        return first, time.perf_counter() - t0
    finally:
        conn.close()


def ms(values: list[float]) -> str:
    """median (min-max) in milliseconds."""
    return f"{statistics.median(values) * 1e3:.1f} ({min(values) * 1e3:.1f}-{max(values) * 1e3:.1f})"


def hold_slow_clients(server: ServerProcess, n: int) -> list[socket.socket]:
    """`n` connections that stop mid-request: half in the head, half in the body."""
    socks = []
    for i in range(n):
        sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
        if i % 2:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Le")
        else:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 1000\r\n\r\n{\"prompt\": \"")
        socks.append(sock)
    return socks


def flood(server: ServerProcess, n: int) -> dict:
    """`n` clients connect at once and each asks /healthz."""
    start = threading.Barrier(n)

    def one(_):
        start.wait()
        try:
            return call(server, "GET", "/healthz")
        except OSError:
            return 0, None

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        results = list(pool.map(one, range(n)))
    wall = time.perf_counter() - t0
    answered = sorted(s for status, s in results if status == 200)
    return {"wall": wall, "ok": len(answered), "busy": sum(status == 503 for status, _ in results),
            "failed": sum(status == 0 for status, _ in results),
            "p50": statistics.median(answered) if answered else None,
            "p99": answered[min(len(answered) - 1, int(0.99 * len(answered)))] if answered else None}


def huge_body(server: ServerProcess) -> tuple[str, float]:
    """(status line, seconds) for a 1 GiB body announced with 64 KiB of it sent."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        t0 = time.perf_counter()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     + f"Content-Length: {1 << 30}\r\n\r\n".encode() + b"{" * 65536)
        reply = sock.recv(4096)
        return reply.split(b"\r\n", 1)[0].decode(errors="replace"), time.perf_counter() - t0


def measure(servers: dict[str, ServerProcess], runs: int, slow: int, flood_n: int) -> list[list[str]]:
    """The table rows, one measurement kind per row, servers in columns."""
    names = list(servers)
    samples: dict[str, dict[str, list[float]]] = {name: {} for name in names}

    def alternate(key: str, count: int, measure_one) -> None:
        for _ in range(count):
            for name in names:
                samples[name].setdefault(key, []).append(measure_one(servers[name]))

    for server in servers.values():  # warm both: the first request compiles and allocates
        for _ in range(3):
            timed(server, "POST", "/v1/completions", COMPLETION)
    alternate("completion", runs, lambda s: timed(s, "POST", "/v1/completions", COMPLETION))
    alternate("stream", runs, streamed)
    for name in names:
        samples[name]["first"], samples[name]["whole"] = map(list, zip(*samples[name].pop("stream")))
    alternate("healthz", runs * 5, lambda s: timed(s, "GET", "/healthz"))
    alternate("metrics", runs, lambda s: timed(s, "GET", "/metrics"))

    def kept_alive(server: ServerProcess) -> float:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
        try:
            return statistics.median(call(server, "GET", "/healthz", conn=conn)[1] for _ in range(50))
        finally:
            conn.close()

    alternate("kept_alive", runs, kept_alive)

    def beside_slow(server: ServerProcess) -> float:
        held = hold_slow_clients(server, slow)
        try:
            return timed(server, "POST", "/v1/completions", COMPLETION)
        finally:
            for sock in held:
                sock.close()

    alternate("beside_slow", runs, beside_slow)
    floods = {name: flood(servers[name], flood_n) for name in names}
    time.sleep(1)
    bodies = {name: huge_body(servers[name]) for name in names}

    rows = [[f"short completion (4 tokens), ms: median (min-max) of {runs}",
             *(ms(samples[n]["completion"]) for n in names)],
            [f"streamed completion (32 tokens), first event, ms ({runs})", *(ms(samples[n]["first"]) for n in names)],
            [f"streamed completion (32 tokens), whole, ms ({runs})", *(ms(samples[n]["whole"]) for n in names)],
            [f"/healthz, new connection, ms ({runs * 5})", *(ms(samples[n]["healthz"]) for n in names)],
            [f"/metrics, new connection, ms ({runs})", *(ms(samples[n]["metrics"]) for n in names)],
            [f"/healthz on one kept-alive connection, ms (median of 50, x{runs})",
             *(ms(samples[n]["kept_alive"]) for n in names)],
            [f"short completion beside {slow} slow clients, ms ({runs})", *(ms(samples[n]["beside_slow"]) for n in names)],
            [f"flood: {flood_n} clients at once, /healthz: 200 / 503 / no answer",
             *(f"{f['ok']} / {f['busy']} / {f['failed']}" for f in floods.values())],
            ["flood: wall s; p50 / p99 of answered, ms",
             *(f"{f['wall']:.2f}; " + (f"{f['p50'] * 1e3:.0f} / {f['p99'] * 1e3:.0f}" if f["p50"] is not None else "-")
               for f in floods.values())],
            ["1 GiB body announced (64 KiB sent): reply, ms",
             *(f"{line.split(' ', 1)[1] if ' ' in line else line or 'closed'}, {s * 1e3:.1f}" for line, s in bodies.values())]]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--old", default=OLD, help=f"source tree or git revision of the old server (default {OLD})")
    parser.add_argument("--new", default=str(ROOT), help="source tree or git revision of the new server (default: here)")
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--slow", type=int, default=100, help="slow clients held open (default 100)")
    parser.add_argument("--flood", type=int, default=300, help="clients connecting at once (default 300)")
    parser.add_argument("--write", action="store_true", help="put the table in docs/server.md")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="tqstore-bench-http-") as scratch:
        scratch = Path(scratch)
        model = write_model_folder(scratch / "tiny-qwen2", kind="qwen2")
        trees = {"old": source_tree(args.old, scratch), "new": source_tree(args.new, scratch)}
        servers = {}
        try:
            for name, tree in trees.items():
                servers[name] = ServerProcess(scratch / f"home-{name}", model, "--no-save", source=tree)
            rows = measure(servers, args.runs, args.slow, args.flood)
        finally:
            for server in servers.values():
                server.stop()
    labels = {"old": f"old ({args.old})", "new": "new (Starlette + uvicorn)"}
    table = markdown_table(["measurement", *(labels[name] for name in trees)], rows)
    print(table)
    if args.write:
        replace_section(DOC, "server_http", f"{stamp(sys.argv)}\n\n{table}")


if __name__ == "__main__":
    main()
