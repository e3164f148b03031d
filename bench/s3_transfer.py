"""Push and pull of one entry against plain boto3 on the same moto S3 server, with requests per entry.

    python bench/s3_transfer.py --tokens 4096 16384 --runs 3 --baseline c8b3709 --write

An entry of synthetic K/V rows with the real model's geometry (bench/storage.py's: 24 layers,
2 KV heads, head dim 64) is compressed with turbo4, put, pushed to a moto S3 server on loopback
into a fresh prefix, and pulled into an empty home. Beside each, in the same process and
against the same server: boto3's transfer manager (upload_fileobj / download_fileobj with the
store's part size and concurrency) on one object of the entry's stored size. Requests are
counted from the store's boto3 client (before-call events), by operation.

`--baseline REV` measures git revision REV's tqstore too, run by run interleaved with this
tree's (each run in a fresh process; REV's package is exported with `git archive` and put first
on PYTHONPATH), so both are measured under the same load. Ranges over --runs runs, median
first; ratios are floor seconds / tqstore seconds (1.0 = boto3's speed). CPU seconds are the
process's (the moto server runs in it, so they include the server's work for each side): on a
shared machine they move less than wall times. `--write` puts the
table into docs/benchmarks.md (section bench-s3-transfer).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent


def _timed(store, action, requests: Counter) -> tuple[float, float]:
    """Wall and process CPU seconds of `action("e")` on `store` (the CPU includes the in-process
    moto server's), its S3 requests counted by operation in `requests`."""
    store._tiers.require_s3().client.meta.events.register(
        "before-call.s3", lambda event_name, **_: requests.update([event_name.split(".")[-1]]))
    t0, c0 = time.perf_counter(), time.process_time()
    action("e")
    return time.perf_counter() - t0, time.process_time() - c0


def model_and_identities(scheme: str):
    """(model with bench/storage.py's KV geometry, its model identity, the codec identity of
    `scheme` on it)."""
    from storage import kv_model
    from tqstore.models.identity import CodecIdentity, ModelIdentity
    from turboquant import make_prompt_cache, snapshot

    model = kv_model()
    model_id = ModelIdentity.from_model(model, kv_dtype="float32")
    return model, model_id, CodecIdentity.from_snapshot(snapshot(make_prompt_cache(model, scheme)), scheme)


def one_run(tokens: list[int], scheme: str) -> list[dict]:
    """Push, pull and their boto3 floors for each context size; one dict per size."""
    import mlx.core as mx

    import tqstore  # first: bench/storage.py puts this tree on sys.path, ahead of a --baseline's PYTHONPATH

    sys.path.insert(0, str(BENCH))
    from common import LocalS3, compressed
    from storage import boto3_floors, raw_snapshot
    from tqstore.config import load_config
    from tqstore.store.store import Store

    model, model_id, codec_id = model_and_identities(scheme)
    s3 = LocalS3()
    root = Path(tempfile.mkdtemp(prefix="tqstore-s3-transfer-", dir=os.environ.get("TQSTORE_BENCH_DIR")))
    out = []
    try:
        for n in tokens:
            raw = raw_snapshot(n)
            mx.eval(raw.arrays())
            snap, _ = compressed(model, raw, scheme)
            home, other = root / f"push-{n}", root / f"pull-{n}"
            overrides = {"s3_url": s3.url(f"{home.name}-{time.time_ns()}"), "s3_endpoint": s3.endpoint}
            config = load_config(home, overrides)
            store = Store.open(home, config=config)
            manifest = store.put("e", snap, list(range(n)), model=model_id, codec=codec_id, model_ref="bench",
                                 prefill_seconds=1.0).manifest
            requests = {"push": Counter(), "pull": Counter()}
            push, push_cpu = _timed(store, store.push, requests["push"])
            store.close()
            remote = Store.open(other, config=load_config(other, overrides))
            remote.ls(remote=True)  # the remote index, outside the timing
            pull, pull_cpu = _timed(remote, remote.pull, requests["pull"])
            remote.close()
            c0 = time.process_time()
            up, down = boto3_floors(s3, manifest.nbytes, config.s3_part_size, config.s3_concurrency)
            floor_cpu = time.process_time() - c0
            out.append({"tokens": n, "scheme": scheme, "stored": manifest.nbytes, "objects": len(manifest.objects),
                        "push": push, "up": up, "pull": pull, "down": down,
                        "push_cpu": push_cpu, "pull_cpu": pull_cpu, "floor_cpu": floor_cpu,
                        "push_requests": dict(requests["push"]), "pull_requests": dict(requests["pull"]),
                        "package": tqstore.__file__})
            print(f"  {n} tokens: push {push:.3f} s (boto3 {up:.3f}), pull {pull:.3f} s (boto3 {down:.3f})",
                  file=sys.stderr, flush=True)
            shutil.rmtree(home, ignore_errors=True)
            shutil.rmtree(other, ignore_errors=True)
    finally:
        s3.stop()
        shutil.rmtree(root, ignore_errors=True)
    return out


def child(code: Path | None, tokens: list[int], scheme: str) -> list[dict]:
    """`one_run` in a fresh process, on `code`'s tqstore package (None: this tree's)."""
    env = dict(os.environ)
    if code is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(code), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    argv = [sys.executable, str(Path(__file__).resolve()), "--child", "--scheme", scheme,
            "--tokens", *map(str, tokens)]
    done = subprocess.run(argv, env=env, cwd=ROOT, stdout=subprocess.PIPE, check=True, text=True)
    runs = json.loads(done.stdout)
    expected = code or ROOT
    assert all(Path(r["package"]).is_relative_to(expected) for r in runs), f"{runs[0]['package']} is not {expected}"
    return runs


def export(rev: str, into: Path) -> Path:
    """Revision `rev`'s tqstore package, extracted under `into`."""
    archive = subprocess.run(["git", "archive", rev, "tqstore"], cwd=ROOT, stdout=subprocess.PIPE, check=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    return into


def span(values: list[float], fmt: str) -> str:
    """Median, then the range."""
    return f"{fmt.format(statistics.median(values))} ({fmt.format(min(values))}-{fmt.format(max(values))})"


def _range(values: list[float]) -> str:
    return f"{min(values):.2f}-{max(values):.2f}"


def requests(counts: dict) -> str:
    return f"{sum(counts.values())} ({', '.join(f'{v} {k}' for k, v in sorted(counts.items()))})"


def table(results: dict[str, list[dict]]) -> str:
    """One row per (context, code): seconds and ratios as median (range), requests per entry."""
    from common import markdown_table

    header = ["tokens", "scheme", "code", "stored MB", "objects", "push s", "boto3 upload s", "push / boto3",
              "pull s", "boto3 download s", "pull / boto3", "CPU s: push, pull, boto3 up + down",
              "push requests", "pull requests"]
    rows = []
    sizes = sorted({r["tokens"] for runs in results.values() for r in runs})
    for n in sizes:
        for code, runs in results.items():
            mine = [r for r in runs if r["tokens"] == n]
            rows.append([n, mine[0]["scheme"], code, f"{mine[0]['stored'] / 1e6:.1f}", mine[0]["objects"],
                         span([r["push"] for r in mine], "{:.3f}"), span([r["up"] for r in mine], "{:.3f}"),
                         span([r["up"] / r["push"] for r in mine], "{:.2f}") + "x",
                         span([r["pull"] for r in mine], "{:.3f}"), span([r["down"] for r in mine], "{:.3f}"),
                         span([r["down"] / r["pull"] for r in mine], "{:.2f}") + "x",
                         ", ".join(_range([r[k] for r in mine]) for k in ("push_cpu", "pull_cpu", "floor_cpu")),
                         requests(mine[0]["push_requests"]), requests(mine[0]["pull_requests"])])
    return markdown_table(header, rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--scheme", default="turbo4")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--baseline", metavar="REV", help="also measure this git revision's tqstore, interleaved")
    parser.add_argument("--write", action="store_true", help="write the table into docs/benchmarks.md")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(one_run(args.tokens, args.scheme)))
        return 0
    sys.path.insert(0, str(BENCH))
    with tempfile.TemporaryDirectory(prefix="tqstore-baseline-") as folder:
        codes: dict[str, Path | None] = {}
        if args.baseline:
            codes[f"before ({args.baseline})"] = export(args.baseline, Path(folder))
        codes["this tree" if args.baseline is None else "after"] = None
        results: dict[str, list[dict]] = {code: [] for code in codes}
        for i in range(args.runs):
            for code, path in codes.items():
                print(f"run {i + 1}, {code}", file=sys.stderr, flush=True)
                results[code] += child(path, args.tokens, args.scheme)
    body = table(results)
    from common import print_and_write

    return print_and_write("bench-s3-transfer", body, args.write, argv)


if __name__ == "__main__":
    sys.exit(main())
