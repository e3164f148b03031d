"""Shared pieces of the benchmark scripts: model/text locations, BLAS choice, table output."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import time
from pathlib import Path

HOME = Path(os.environ.get("TQSTORE_HOME", Path.home() / ".cache" / "tqstore"))
DEFAULT_MODEL = HOME / "models" / "qwen2.5-coder-0.5b"
DEFAULT_TEXT = HOME / "corpus" / "devils_dictionary.txt"
LICENCE_CHARS = 5000  # the corpus files open with licence headers


def use_openblas(argv: list[str]) -> None:
    """Re-exec this script with Debian's OpenBLAS preloaded (see tqstore/models/blas.py)."""
    from tqstore.models.blas import reexec_with
    from tqstore.errors import ConfigError

    try:
        reexec_with("openblas", argv)  # the script path and its arguments
    except ConfigError as e:
        sys.exit(f"--openblas: {e}")


def choose_blas(argv: list[str], openblas: bool, threads: int | None) -> None:
    """Run this script with `threads` OpenBLAS threads (read when OpenBLAS loads, so the script
    starts again with OPENBLAS_NUM_THREADS set) and on Debian's OpenBLAS if `openblas`."""
    if threads is not None and os.environ.get("OPENBLAS_NUM_THREADS") != str(threads):
        os.environ["OPENBLAS_NUM_THREADS"] = str(threads)
        os.execv(sys.executable, [sys.executable, *argv])
    if openblas:
        use_openblas(argv)


def blas_name() -> str:
    from tqstore.models.blas import active_blas

    return "OpenBLAS (preloaded)" if active_blas() == "openblas" else "bundled reference BLAS (mlx[cpu] wheel)"


def machine_line() -> str:
    import mlx.core as mx

    import mlx_lm

    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        cpu = platform.processor() or cpu
    return (f"{cpu}, {os.cpu_count()} cores, {platform.system()} {platform.machine()}, Python "
            f"{platform.python_version()}, MLX {mx.__version__} ({mx.default_device()}), mlx-lm "
            f"{mlx_lm.__version__}, BLAS: {blas_name()}")


def git_revision() -> str:
    """HEAD's short hash, with "+changes" when tracked files differ from it: a table must not name
    a commit that is not the code that ran (the device's copy of the tree keeps the .git of the
    session's first copy, so its HEAD is often older than its files)."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
        changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                                 text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return f"{head}+changes" if changed else head


def stamp(argv: list[str]) -> str:
    """The provenance sentence under a table: command, git revision, date, machine."""
    import datetime

    script = f"bench/{Path(argv[0]).name}"
    return (f"Command: `python {' '.join([script, *argv[1:]])}` (git {git_revision()}, {datetime.date.today()}). "
            f"Machine: {machine_line()}.")


def print_and_write(marker: str, body: str, write: bool, argv: list[str] | None) -> int:
    """Print `body`; with `write`, put it with its provenance (`stamp` of this command line, or
    of `argv` after the script name) into docs/benchmarks.md, section `marker`. Returns 0."""
    print(body)
    if not write:
        return 0
    command = [sys.argv[0], *(sys.argv[1:] if argv is None else argv)]
    replace_section(Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md", marker,
                    f"{stamp(command)}\n\n{body}")
    return 0


def replace_section(path: Path, marker: str, body: str) -> None:
    """Replace the text between `<!-- marker:start -->` and `<!-- marker:end -->` (appending if absent)."""
    start, end = f"<!-- {marker}:start -->", f"<!-- {marker}:end -->"
    text = path.read_text() if path.exists() else ""
    block = f"{start}\n{body.rstrip()}\n{end}"
    if start in text and end in text:
        text = text[:text.index(start)] + block + text[text.index(end) + len(end):]
    else:
        text = text.rstrip() + ("\n\n" if text else "") + block + "\n"
    path.write_text(text)


def load_real_model(path: Path):
    """The real model in float32 (MLX's CPU half-precision matmul is very slow)."""
    import mlx.core as mx
    from mlx_lm import load

    if not path.exists():
        sys.exit(f"model not found at {path}: run `tqstore model install qwen2.5-coder-0.5b` or pass --model")
    model, tokenizer = load(str(path))
    model.set_dtype(mx.float32)
    return model, tokenizer


def text_tokens(tokenizer, path: Path, n: int) -> list[int]:
    """The first n tokens of a corpus text (after its licence header)."""
    tokens = tokenizer.encode(path.read_text(errors="replace")[LICENCE_CHARS:])
    if len(tokens) < n:
        sys.exit(f"{path} has only {len(tokens)} tokens; {n} needed")
    return tokens[:n]


class LocalS3:
    """A moto S3 server on loopback with fake credentials and one bucket (benchmarks only)."""

    def __init__(self, bucket: str = "tqstore-bench"):
        import logging

        import boto3
        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)
        for name in ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_SESSION_TOKEN"):
            os.environ.pop(name, None)
        os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1")
        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self.server.start()
        host, port = self.server.get_host_and_port()
        self.endpoint = f"http://{host}:{port}"
        self.bucket = bucket
        self.client = boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1")
        self.client.create_bucket(Bucket=bucket)

    def url(self, prefix: str) -> str:
        return f"s3://{self.bucket}/{prefix}"

    def stop(self) -> None:
        self.server.stop()


def drop_page_cache(path: Path) -> None:
    """Evict one file from the page cache (posix_fadvise DONTNEED), not the whole machine's."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def family_arguments(doc: str, tokens: int, argv: list[str] | None):
    """--tokens, --families and --out of the per-family tables (docs/models.md by default)."""
    import argparse

    argv = sys.argv if argv is None else argv
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=tokens)
    parser.add_argument("--families", nargs="*", help="default: every family that builds")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent.parent / "docs" / "models.md")
    return parser.parse_args(argv[1:])


def evaluated_seconds(build, runs: int, warm: int) -> list[float]:
    """Wall seconds of `runs` rounds of building a graph with `build()` and evaluating it (after
    `warm` untimed rounds): for device micro-benchmarks."""
    import mlx.core as mx

    for _ in range(warm):
        mx.eval(build())
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        mx.eval(build())
        times.append(time.perf_counter() - t0)
    return times


def markdown_table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def compressed(model, raw, scheme: str):
    """(snapshot of the raw caches `raw` under `scheme`, seconds to compress and evaluate it)."""
    import mlx.core as mx

    from turboquant import TurboQuantKVCache, make_prompt_cache, restore_as, snapshot

    caches = restore_as(raw, make_prompt_cache(model, scheme))
    mx.eval([c.state for c in caches])
    t0 = time.perf_counter()
    for c in caches:
        if isinstance(c, TurboQuantKVCache):
            c.compress()
    snap = snapshot(caches)
    mx.eval(snap.arrays())
    return snap, time.perf_counter() - t0
