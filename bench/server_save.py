"""Does a request wait for the previous response's save? Time to first token beside the put.

    python bench/server_save.py --tokens 4096 --runs 3 --openblas

Two real `tqstore serve` processes on loopback serve the same random-weight model folder with
the real model's KV geometry (24 layers, 2 KV heads, head dim 64; tests/model_folder.py): one
saves prompts (`--save-min-tokens 64`, the writer thread stores them), one runs with `--no-save`.
Each run sends both servers, in turn, request A (a long prompt, one token of answer, so its
prefix is saved after the response) and, as soon as A's response is read, request B (a short
unrelated prompt, streamed); B's time to first token is timed from sending it to its first text
chunk. A's put time is the server's own `tqstore_autosave_seconds` (from the hand-over to the
writer until stored), read from /metrics once the save has landed; /metrics is also read as
B's first token arrives, to see whether A's save was still pending then. Had B waited for the
put, its first token would come at least that much later than with `--no-save`.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))
sys.path.insert(2, str(Path(__file__).resolve().parent.parent / "tests"))

from common import markdown_table, replace_section, stamp  # noqa: E402

DOC = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"
GEOMETRY = dict(hidden_size=128, num_hidden_layers=24, intermediate_size=256, num_attention_heads=2,
                num_key_value_heads=2)
SAVED = 'tqstore_autosaves_total{outcome="saved"}'


def metrics(server) -> dict[str, float]:
    """The server's Prometheus samples."""
    from server_process import parse_prometheus, request

    status, _, text = request(server, "GET", "/metrics")
    assert status == 200, text
    return parse_prometheus(text)


def complete(server, prompt: str, max_tokens: int) -> None:
    """One non-streamed completion, read to the end."""
    from server_process import request

    status, _, body = request(server, "POST", "/v1/completions", timeout=600,
                              body={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
    assert status == 200, body


def first_token_seconds(server, prompt: str, at_first=lambda: None) -> tuple[float, object]:
    """Seconds from sending a streamed completion to its first text chunk (the rest is drained),
    and what `at_first` returned when that chunk came."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=600)
    body = json.dumps({"prompt": prompt, "max_tokens": 8, "temperature": 0, "stream": True})
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200, response.read()
    first = seen = None
    for line in response:
        if first is None and line.startswith(b"data: {"):
            if any(c.get("text") for c in json.loads(line[6:])["choices"]):
                first = time.perf_counter() - t0
                seen = at_first()
    conn.close()
    if first is None:
        raise RuntimeError("the stream carried no text")
    return first, seen


def long_prompt(tokenizer, run: int, tokens: int) -> str:
    """About `tokens` tokens of text that differ from the other runs' from the first words on."""
    from model_folder import CORPUS

    text = f"Run {run} of the benchmark. " + CORPUS * (tokens // 50 + 2)
    ids = tokenizer.encode(text).ids[:tokens]
    return tokenizer.decode(ids)


def one_run(server, saving: bool, a: str, b: str) -> tuple[float, float | None, bool | None]:
    """(B's first-token seconds, A's put seconds, whether A's save was still pending when B's
    first token came) for A then B on one server; the last two are None without saves."""
    before = metrics(server) if saving else {}
    complete(server, a, max_tokens=1)
    ttft, pending = first_token_seconds(server, b, lambda: saving and metrics(server)[SAVED] == before[SAVED])
    if not saving:
        return ttft, None, None
    deadline = time.monotonic() + 300
    while (now := metrics(server))[SAVED] == before[SAVED]:
        if time.monotonic() > deadline:
            raise RuntimeError("A's prefix was not saved within 300 s")
        time.sleep(0.05)
    return ttft, now["tqstore_autosave_seconds_sum"] - before["tqstore_autosave_seconds_sum"], pending


def measure(tmp: Path, model: Path, tokenizer, scheme: str, args) -> list[tuple[float, float, float, bool]]:
    """(B's first token with --no-save, with A saving, A's put, A's save pending at B's first
    token) per run, for one scheme."""
    from server_process import ServerProcess

    tmp.mkdir()
    flags = ("--scheme", scheme, "--save-min-tokens", "64", "--max-tokens", "8")
    servers = {saving: ServerProcess(tmp / f"home-{saving}", model, *flags, *(() if saving else ("--no-save",)))
               for saving in (True, False)}
    runs = []
    try:
        for run in range(args.runs):
            a, b = long_prompt(tokenizer, run, args.tokens), f"Question {run}: who pays for delays?"
            sync, _, _ = one_run(servers[False], False, a, b)
            ttft, put, pending = one_run(servers[True], True, a, b)
            runs.append((sync, ttft, put, pending))
            print(f"{scheme} run {run + 1}: B first token {ttft:.3f} s (no save {sync:.3f} s), A's put {put:.3f} s, "
                  f"still pending at B's first token: {pending}", flush=True)
    finally:
        for server in servers.values():
            server.stop()
    return runs


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=4096, help="request A's prompt tokens")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--schemes", nargs="+", default=["raw", "turbo4"])
    parser.add_argument("--openblas", action="store_true", help="servers with Debian's OpenBLAS preloaded")
    parser.add_argument("--no-doc", action="store_true", help="print the table only")
    args = parser.parse_args(argv[1:])
    if args.openblas:
        from tqstore.models.blas import openblas_environment

        os.environ.update(openblas_environment())

    from model_folder import train_tokenizer, write_model_folder
    from tiny_models import CONFIGS

    rows = []
    with tempfile.TemporaryDirectory(prefix="tqstore-bench-") as tmp:
        model = write_model_folder(Path(tmp) / "model", "qwen2", **GEOMETRY)
        tokenizer = train_tokenizer(CONFIGS["qwen2"]["vocab_size"])
        for scheme in args.schemes:
            rows.append((scheme, measure(Path(tmp) / scheme, model, tokenizer, scheme, args)))
    table = render(args, rows)
    print(table)
    if not args.no_doc:
        replace_section(DOC, "bench-server-save", f"{stamp(argv)}\n\n{table}")


def render(args, rows: list[tuple[str, list[tuple[float, float, float, bool]]]]) -> str:
    """Per scheme, the range over the runs of B's first token with and without saves, and A's put."""
    def span(values) -> str:
        return f"{min(values):.3f}-{max(values):.3f}"

    body = []
    for scheme, runs in rows:
        s, t, p, pending = zip(*runs)
        body.append([args.tokens, scheme, len(runs), span(s), span(t), span([x - y for x, y in zip(t, s)]), span(p),
                     f"{sum(pending)}/{len(runs)}"])
    return markdown_table(["A prompt tokens", "scheme", "runs", "B first token, --no-save (s)",
                           "B first token, A saving (s)", "difference (s)", "A's put (s)",
                           "A's save still pending at B's first token"], body)


if __name__ == "__main__":
    main(sys.argv)
