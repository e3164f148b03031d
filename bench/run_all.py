"""Run every CPU benchmark and write docs/benchmarks.md (tables, PNG plots, machine, command).

    python bench/run_all.py --quick               # 1k context, three schemes (the default turbo5v4 among them)
    python bench/run_all.py --openblas            # 1k/4k/8k contexts, six schemes, OpenBLAS prefill
    python bench/run_all.py --sections bench-storage --storage-runs 3   # some sections only

Timing assertions live nowhere: these are measurements. The GPU decode kernels have their own
script (bench/decode.py, run on the H200) and section.
"""

from __future__ import annotations

import argparse
import datetime
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (DEFAULT_MODEL, DEFAULT_TEXT, LocalS3, git_revision, load_real_model,  # noqa: E402
                    machine_line, markdown_table, replace_section, text_tokens, use_openblas)
from storage import memcpy_floor  # noqa: E402

DOCS = Path(__file__).resolve().parent.parent / "docs"
FULL = {"contexts": [1024, 4096, 8192], "schemes": ["raw", "affine8", "turbo0v4", "turbo8v3", "turbo4", "turbo5v4"]}
QUICK = {"contexts": [1024], "schemes": ["raw", "turbo8v3", "turbo5v4"]}
MODEL_SECTIONS = ("bench-ttft", "bench-throughput", "bench-transfer", "bench-compression", "bench-peers")
SECTIONS = ("bench-setup", *MODEL_SECTIONS, "bench-storage", "bench-blas")


def mb(n: float) -> str:
    return f"{n / 1e6:.2f}"


def gbps(nbytes: float, seconds: float) -> str:
    return f"{nbytes / seconds / 1e9:.2f}" if seconds > 0 else "-"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--openblas", action="store_true", help="prefill with Debian's OpenBLAS (AVX-512 CPUs)")
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--text", type=Path, default=DEFAULT_TEXT)
    parser.add_argument("--contexts", type=int, nargs="+")
    parser.add_argument("--schemes", nargs="+")
    parser.add_argument("--blas-tokens", type=int, default=128)
    parser.add_argument("--out", type=Path, default=DOCS / "benchmarks.md")
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, help="write only these sections (default: all)")
    parser.add_argument("--storage-tokens", type=int, default=16384)
    parser.add_argument("--storage-runs", type=int, default=3)
    args = parser.parse_args(argv[1:])
    if args.openblas:
        use_openblas(argv)

    wanted = set(args.sections or SECTIONS)
    command = "python bench/run_all.py " + " ".join(argv[1:])
    sections = {"bench-setup": setup_line(command, args.text)}
    if "bench-storage" in wanted:
        import storage

        runs = storage.measure(args.storage_tokens, ["raw", "turbo4", "turbo8v3"], args.storage_runs)
        sections["bench-storage"] = (f"{datetime.date.today()}, git {git_revision()}, `{command}`, "
                                     f"{machine_line()}; {args.storage_runs} runs.\n\n"
                                     + storage.table(runs, args.storage_tokens))
    if wanted & set(MODEL_SECTIONS):
        sections.update(model_sections(args))
    if "bench-blas" in wanted:
        sections["bench-blas"] = blas_section(args)
    for name, body in sections.items():
        if name in wanted:
            replace_section(args.out, name, body)
    print(f"wrote {args.out}")
    return 0


def setup_line(command: str, text: Path) -> str:
    return (f"Machine: {machine_line()}.  \nDate: {datetime.date.today()}, git {git_revision()}.  \n"
            f"Command: `{command}`. Model: Qwen2.5-Coder-0.5B-Instruct (float32 on the CPU), text: "
            f"{text.name}. S3 is a moto server on loopback.")


def model_sections(args) -> dict[str, str]:
    """The sections that need the real model: TTFT, throughput, transfer, compression, peers."""
    import restore as R
    from peers import mlx_lm_files

    from tqstore.models.loading import LoadedModel
    from tqstore.models.identity import ModelIdentity
    from tqstore.models.prompting import prompt_format
    from turboquant.quality import prefill as body_prefill

    plan = QUICK if args.quick else FULL
    contexts = args.contexts or plan["contexts"]
    schemes = args.schemes or plan["schemes"]
    model, tokenizer = load_real_model(args.model)
    root = Path(tempfile.mkdtemp(prefix="tqstore-bench-"))
    identity = ModelIdentity.from_path(args.model, root / "digests", kv_dtype="float32")
    loaded = LoadedModel(model, tokenizer, identity, str(args.model), args.model.resolve(), None,
                         prompt_format(tokenizer))

    def prefill(model, caches, tokens):
        if tokens:
            import mlx.core as mx

            body_prefill(model, mx.array(tokens), caches)

    s3 = LocalS3()
    all_tokens = text_tokens(tokenizer, args.text, max(contexts) + R.QUESTION_TOKENS + 512)
    ttft_rows, save_rows, floors, dedup, peers = [], [], {}, None, []
    try:
        for n in contexts:
            ctx = R.prepare_context(model, all_tokens[:n + R.QUESTION_TOKENS], prefill)
            print(f"context {n}: cold prefill {ctx.prefill_seconds:.1f}s, cold TTFT {ctx.cold_ttft:.1f}s", flush=True)
            for scheme in schemes:
                save, rows = R.run_scheme(ctx, scheme, loaded, R.fresh_home(root, f"h{n}-{scheme}"), s3)
                save_rows.append(save)
                ttft_rows += rows
                print(f"  {scheme}: " + ", ".join(f"{r.tier} {r.ttft_seconds:.3f}s ({r.ratio:.0f}x)" for r in rows),
                      flush=True)
                floors[(n, scheme)] = (memcpy_floor(save.stored_bytes), R.lmdb_put_floor(save.stored_bytes),
                                       *R.boto3_floor(s3, save.stored_bytes))
            if n == contexts[-1]:
                peers = mlx_lm_files(ctx.raw, model)
                dedup = R.dedup_push(loaded, ctx, schemes[-1], R.fresh_home(root, "dedup"), s3,
                                     all_tokens[n + R.QUESTION_TOKENS:n + R.QUESTION_TOKENS + 512])
    finally:
        s3.stop()
        shutil.rmtree(root, ignore_errors=True)

    plot(ttft_rows, save_rows, DOCS / "img")
    return {
        "bench-ttft": markdown_table(
            ["context", "scheme", "tier", "restored tokens", "restore s", "TTFT s", "cold TTFT s", "speed-up"],
            [[r.context, r.scheme, r.tier, r.restored_tokens, f"{r.restore_seconds:.3f}", f"{r.ttft_seconds:.3f}",
              f"{r.cold_ttft_seconds:.2f}", f"{r.ratio:.0f}x"] for r in ttft_rows]),
        "bench-throughput": markdown_table(
            ["context", "scheme", "stored MB", "B/token", "x fp16", "compress s", "put s", "save GB/s (fp16-eq)",
             "restore GB/s memory / lmdb / s3", "memcpy GB/s", "LMDB put GB/s", "boto3 up GB/s"],
            [[s.context, s.scheme, mb(s.stored_bytes), f"{s.bytes_per_token:.0f}",
              f"{s.fp16_bytes / s.stored_bytes:.2f}", f"{s.compress_seconds:.3f}", f"{s.put_seconds:.3f}",
              gbps(s.fp16_bytes, s.compress_seconds + s.put_seconds),
              " / ".join(gbps(s.fp16_bytes, s.restore_seconds[t]) if t in s.restore_seconds else "-"
                         for t in ("memory", "lmdb", "s3")),
              gbps(s.stored_bytes, floors[(s.context, s.scheme)][0]),
              gbps(s.stored_bytes, floors[(s.context, s.scheme)][1]),
              gbps(s.stored_bytes, floors[(s.context, s.scheme)][2])] for s in save_rows]),
        "bench-transfer": markdown_table(
            ["context", "scheme", "stored MB", "push s", "boto3 upload s", "push overhead"],
            [[s.context, s.scheme, mb(s.stored_bytes), f"{s.push_seconds:.3f}",
              f"{floors[(s.context, s.scheme)][2]:.3f}",
              f"{s.push_seconds / floors[(s.context, s.scheme)][2]:.1f}x"] for s in save_rows if s.push_seconds])
        # A pull here lands in the home that pushed the entry, so nothing moves: pulls into an
        # empty home are measured in bench-storage.
        + "\n\nPull into an empty home: see the storage table (bench-storage)."
        + ("" if dedup is None else
           f"\n\nDedup: an entry of {dedup['first_tokens']} tokens pushed {mb(dedup['first_bytes'])} MB; a second "
           f"entry extending it by 512 tokens ({mb(dedup['second_total'])} MB in all) uploaded "
           f"{mb(dedup['second_uploaded'])} MB (its prefix blocks were already in the bucket; the save itself "
           f"restored {dedup['second_reused_tokens']} tokens instead of prefilling them)."),
        "bench-compression": markdown_table(
            ["what", "bytes per token", "x fp16"],
            [["fp16 KV (logical)", f"{save_rows[0].fp16_bytes / save_rows[0].context:.0f}", "1.00"]]
            + [[p.name + " file", f"{p.file_bytes / contexts[-1]:.0f}",
                f"{save_rows[0].fp16_bytes / save_rows[0].context / (p.file_bytes / contexts[-1]):.2f}"] for p in peers]
            + [[f"tqstore {s.scheme} (stored objects)", f"{s.bytes_per_token:.0f}", f"{s.fp16_bytes / s.stored_bytes:.2f}"]
               for s in save_rows if s.context == contexts[-1]]),
        "bench-peers": markdown_table(
            ["what", "MB", "save s", "load s"],
            [[p.name, mb(p.file_bytes), f"{p.save_seconds:.3f}", f"{p.load_seconds:.3f}"] for p in peers]
            + [[f"tqstore {s.scheme} (put / LMDB restore)", mb(s.stored_bytes), f"{s.compress_seconds + s.put_seconds:.3f}",
                f"{s.restore_seconds.get('lmdb', float('nan')):.3f}"] for s in save_rows if s.context == contexts[-1]]),
    }


def blas_section(args) -> str:
    """Prefill speed with each BLAS library (each in its own process)."""
    from blas_prefill import measure as blas_measure

    from tqstore.models.blas import openblas_environment
    from tqstore.errors import ConfigError

    rows = []
    for blas in ("bundled", "openblas"):
        try:
            if blas == "openblas":
                openblas_environment()
            r = blas_measure(args.model, args.blas_tokens, blas)
            rows.append([r["blas"], r["tokens"], f"{r['seconds']:.2f}", f"{r['tokens'] / r['seconds']:.0f}"])
        except ConfigError as e:
            rows.append([blas, args.blas_tokens, "-", f"not available here: {e}"])
    return markdown_table(["BLAS", "tokens", "prefill s", "tokens/s"], rows)


def plot(ttft_rows, save_rows, folder: Path) -> None:
    """TTFT per tier and scheme, and bytes per token per scheme, as PNGs beside the doc."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    contexts = sorted({r.context for r in ttft_rows})
    fig, axes = plt.subplots(1, len(contexts), figsize=(5 * len(contexts), 4), squeeze=False)
    for ax, n in zip(axes[0], contexts):
        rows = [r for r in ttft_rows if r.context == n]
        labels = [f"{r.scheme}\n{r.tier}" for r in rows]
        ax.bar(range(len(rows)), [r.ttft_seconds for r in rows], color="tab:blue")
        ax.axhline(rows[0].cold_ttft_seconds, color="tab:red", label="cold prefill + first token")
        ax.set_yscale("log")
        ax.set_xticks(range(len(rows)), labels, fontsize=6, rotation=90)
        ax.set_title(f"time to first token, {n}-token context")
        ax.set_ylabel("seconds")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(folder / "ttft.png", dpi=110)
    plt.close(fig)
    last = max(s.context for s in save_rows)
    rows = [s for s in save_rows if s.context == last]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar([s.scheme for s in rows], [s.bytes_per_token for s in rows], color="tab:green")
    ax.axhline(rows[0].fp16_bytes / rows[0].context, color="tab:red", label="fp16")
    ax.set_ylabel("stored bytes per token")
    ax.legend()
    fig.tight_layout()
    fig.savefig(folder / "compression.png", dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
