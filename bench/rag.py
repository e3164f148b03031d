"""RAG composition on the real model: stored 512-token chunks reused in shuffled orders.

    python bench/rag.py --openblas --ks 8,4 --orders 2 --continuation 96     # writes docs/rag.md

For each k and order: k chunks of real text (about 512 tokens each, from the corpus files) after
the chat template's prefix, then a continuation of real text (the tokens that follow the last
chunk in its source), whose first --question tokens play the question. Reference: a full prefill of the same prompt (float32, uncompressed).
Composed: the chunks stored once (tqstore chunk entries, scheme raw or turbo4), restored,
moved and partly recomputed (compose.py). Quality: KL(full || composed) of the next-token
distributions over the continuation, and top-1 agreement. TTFT: restore + compose + the
question's forward (time to its first logits), against the full prefill + the same forward,
side by side in one run.
"""

from __future__ import annotations

import argparse
import datetime
import math
import random
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (DEFAULT_MODEL, HOME, LICENCE_CHARS, git_revision, machine_line, replace_section,  # noqa: E402
                          use_openblas)

DOCS = Path(__file__).resolve().parent.parent / "docs"
CHUNK_TOKENS = 512


@dataclass(frozen=True)
class Variant:
    label: str
    scheme: str
    budget: float | str  # a fraction, or "sinks" (each moved chunk's first tokens only)
    select: str | None = None  # None: the default selection


VARIANTS = [
    Variant("0 (concatenation)", "raw", 0.0), Variant("0 (concatenation)", "turbo4", 0.0),
    Variant("first tokens only", "turbo4", "sinks"),
    Variant("5%", "turbo4", 0.05), Variant("15%", "raw", 0.15), Variant("15%", "turbo4", 0.15),
    Variant("15% by deviation", "turbo4", 0.15, "deviation"), Variant("20%", "turbo4", 0.20),
    Variant("30%", "turbo4", 0.30),
]


def experiment(budgets: str, selects: str, scheme: str) -> list[Variant]:
    """Variants for comparing selections: every budget under every selection."""
    return [Variant(f"{float(b):.0%} {sel}", scheme, float(b), sel) for b in budgets.split(",")
            for sel in selects.split(",")]


def corpus_pieces(tokenizer, corpus: Path, n: int, continuation: int) -> list[tuple[str, list[int]]]:
    """(chunk text, continuation tokens) pieces of about CHUNK_TOKENS tokens, taken round-robin
    from the corpus files so a prompt mixes sources."""
    streams = []
    for path in sorted(corpus.glob("*.txt")):
        # No special tokens: a BOS inside a piece would be a document's text.
        tokens = tokenizer.encode(path.read_text(errors="replace")[LICENCE_CHARS:], add_special_tokens=False)
        streams.append(tokens)
    pieces, at = [], [0] * len(streams)
    while len(pieces) < n:
        i = len(pieces) % len(streams)
        tokens = streams[i]
        piece = tokens[at[i]:at[i] + CHUNK_TOKENS]
        cont = tokens[at[i] + CHUNK_TOKENS:at[i] + CHUNK_TOKENS + continuation]
        at[i] += CHUNK_TOKENS * 3  # leave a gap: pieces of one source are not consecutive
        pieces.append((tokenizer.decode(piece), cont))
    return pieces


def kl_top1(ref, test):
    import mlx.core as mx

    lp, lq = ref - mx.logsumexp(ref, axis=-1, keepdims=True), test - mx.logsumexp(test, axis=-1, keepdims=True)
    kl = mx.mean(mx.sum(mx.exp(lp) * (lp - lq), axis=-1)).item()
    top1 = mx.mean((mx.argmax(ref, axis=-1) == mx.argmax(test, axis=-1)).astype(mx.float32)).item()
    return kl, top1


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--corpus", type=Path, default=HOME / "corpus")
    parser.add_argument("--ks", default="8,4")
    parser.add_argument("--orders", type=int, default=2)
    parser.add_argument("--question", type=int, default=16,
                        help="continuation tokens that play the question in the TTFT (the first logits after them)")
    parser.add_argument("--continuation", type=int, default=96)
    parser.add_argument("--budgets", default="", help="compare selections: budgets (comma-separated fractions)")
    parser.add_argument("--selects", default="deviation,attention,product")
    parser.add_argument("--scheme", default="turbo4", help="chunk scheme of --budgets runs")
    parser.add_argument("--full-layers", type=int, default=None)
    parser.add_argument("--sinks", type=int, default=None)
    parser.add_argument("--tail", type=int, default=None)
    parser.add_argument("--select", default=None, help="deviation, attention or product (default: compose.SELECT)")
    parser.add_argument("--home", type=Path, help="store home to keep chunks between runs (default: a fresh temp dir)")
    parser.add_argument("--openblas", action="store_true", help="preload Debian's OpenBLAS (AVX-512 CPUs)")
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--section", default="rag-table",
                        help="docs/rag.md section the table replaces (and img/<section less -table>.svg)")
    args = parser.parse_args(argv[1:])
    if args.openblas:
        use_openblas(argv)

    import mlx.core as mx

    from tqstore import Store
    from tqstore.engine.chunks import fill_caches, prefix_tokens
    from tqstore.engine.compose import SELECT, SINK_TOKENS, compose, window_sizes
    from tqstore.config import load_config
    from tqstore.engine.engine import Engine
    from turboquant import make_prompt_cache

    options = {"full_layers": args.full_layers,
               "sink_tokens": SINK_TOKENS if args.sinks is None else args.sinks,
               "tail_tokens": args.tail or 0, "select": args.select or SELECT}
    variants = experiment(args.budgets, args.selects, args.scheme) if args.budgets else VARIANTS
    home = args.home or Path(tempfile.mkdtemp(prefix="tqstore-rag-"))
    engine = Engine(Store.open(home, config=load_config(home)))
    loaded = engine.model(str(args.model))
    model, tokenizer = loaded.model, loaded.tokenizer
    windows = window_sizes(make_prompt_cache(model, "raw"))
    ks = [int(k) for k in args.ks.split(",")]
    pieces = corpus_pieces(tokenizer, args.corpus, max(ks) * 2, args.continuation)
    prefix = prefix_tokens(loaded, None)
    doc_tokens = [loaded.prompt.document_tokens(tokenizer, text) for text, _ in pieces]
    rng = random.Random(0)
    prompts = [(k, order, rng.sample(range(len(pieces)), k)) for k in ks for order in range(args.orders)]
    for scheme in sorted({v.scheme for v in variants}):
        for i in sorted({i for _, _, picked in prompts for i in picked}):
            info = engine.chunks.ensure_chunk(loaded, scheme, prefix, doc_tokens[i], None)[0]
            print(f"chunk {i} ({scheme}): {'stored' if info.stored else 'reused'}", flush=True)
    rows: dict[tuple[int, str, str], list] = {}
    for k, order, picked in prompts:
        cont = mx.array(pieces[picked[-1]][1])[None]
        prompt = prefix + [t for i in picked for t in doc_tokens[i]]
        # Full prefill (reference) and its time to the continuation's logits.
        t0 = time.perf_counter()
        caches = make_prompt_cache(model, "raw")
        engine.prefill(loaded, caches, prompt)
        first = model(cont[:, :args.question], cache=caches)[0]
        mx.eval(first)
        full_seconds = time.perf_counter() - t0
        ref = mx.concatenate([first, model(cont[:, args.question:], cache=caches)[0]])
        print(f"k={k} order={order}: {len(prompt)} prompt tokens, full prefill {full_seconds:.2f} s", flush=True)
        for v in variants:
            t0 = time.perf_counter()
            parts = [engine.chunks.ensure_chunk(loaded, v.scheme, prefix, doc_tokens[i], None)[1] for i in picked]
            chunk_total = len(prompt) - len(prefix)
            budget = options["sink_tokens"] * (k - 1) / chunk_total if v.budget == "sinks" else v.budget
            chosen = {**options, "select": v.select or options["select"]}
            composed = compose(model, parts, budget, question=pieces[picked[-1]][1][:args.question],
                               windows=windows, **chosen)
            caches = make_prompt_cache(model, "raw")
            recomputed = composed.recomputed
            fill_caches(caches, composed)
            first = model(cont[:, :args.question], cache=caches)[0]
            mx.eval(first)
            seconds = time.perf_counter() - t0
            test = mx.concatenate([first, model(cont[:, args.question:], cache=caches)[0]])
            kl, top1 = kl_top1(ref, test)
            rows.setdefault((k, v.label, v.scheme), []).append((kl, top1, full_seconds / seconds,
                                                                 recomputed / chunk_total))
            print(f"  {v.scheme:7s} {v.label:20s} KL {kl:.4f} top-1 {top1:.3f} recomputed "
                  f"{recomputed}/{chunk_total} TTFT {seconds:.2f} s ({full_seconds / seconds:.1f}x)",
                  flush=True)
    command = "python bench/rag.py " + " ".join(argv[1:])
    body = table(rows, command, options, args)
    print(body)
    if not args.no_write:
        replace_section(DOCS / "rag.md", args.section, body)
        plot(rows, DOCS / "img" / f"{args.section.removesuffix('-table')}.svg")
    return 0


def table(rows, command: str, options: dict, args) -> str:
    lines = ["| k | budget | chunks stored as | recomputed | KL | top-1 | TTFT vs full prefill |",
             "|---|---|---|---|---|---|---|"]
    for (k, label, scheme), runs in rows.items():
        kl = sum(r[0] for r in runs) / len(runs)
        top1 = sum(r[1] for r in runs) / len(runs)
        speed = [r[2] for r in runs]
        share = sum(r[3] for r in runs) / len(runs)
        lines.append(f"| {k} | {label} | {scheme} | {share:.1%} | {kl:.3f} | {top1:.3f} | "
                     f"{sum(speed) / len(speed):.1f}x ({min(speed):.1f}-{max(speed):.1f}) |")
    lines += ["", f"Chunks of {CHUNK_TOKENS} tokens, {args.orders} orders per k, continuation of {args.continuation} "
              f"real tokens; recompute options {options} (full_layers None: 0 for the attention selection, 2 for "
              "deviation). KL and top-1 are means over orders; TTFT is the mean "
              "ratio (range over orders). Recomputed is the share of chunk tokens run through every layer in "
              "context (besides the first full_layers layers, which run over every token when the budget is "
              "above 0).", "", f"Command: `{command}` (git {git_revision()}, {datetime.date.today()}).",
              f"Model: {args.model.name}. Machine: {machine_line()}."]
    return "\n".join(lines)


def plot(rows, path: Path) -> None:
    """KL against TTFT speed-up, one line per (k, chunk scheme), one point per budget: with
    matplotlib when installed, else a plain SVG written here."""
    series: dict[str, list] = {}
    for (k, label, scheme), runs in rows.items():
        kl = sum(r[0] for r in runs) / len(runs)
        speed = sum(r[2] for r in runs) / len(runs)
        series.setdefault(f"k={k}, chunks {scheme}", []).append((speed, kl, label.split(" ")[0]))
    for points in series.values():
        points.sort()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(svg_chart(series, "TTFT speed-up against a full prefill (x, log scale)",
                              "KL against the full prefill", targets=(4.0, 0.05)))


COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b")


def svg_chart(series: dict[str, list], xlabel: str, ylabel: str, targets: tuple[float, float]) -> str:
    """A line chart as SVG text: series name -> [(x, y, point label)], x on a log2 scale;
    dotted target lines."""
    W, H, left, right, top, bottom = 760, 400, 60, 260, 20, 50
    xs = [p[0] for pts in series.values() for p in pts] + [targets[0]]
    ys = [p[1] for pts in series.values() for p in pts] + [targets[1], 0.0]
    xmin, xmax, ymax = 2 ** math.floor(math.log2(min(xs))), 2 ** math.ceil(math.log2(max(xs))), max(ys) * 1.1

    def X(x):
        return left + (W - left - right) * math.log2(x / xmin) / math.log2(xmax / xmin)

    def Y(y):
        return H - bottom - (H - top - bottom) * y / ymax

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" '
           'font-size="11">', f'<rect width="{W}" height="{H}" fill="white"/>',
           f'<line x1="{left}" y1="{H - bottom}" x2="{W - right}" y2="{H - bottom}" stroke="black"/>',
           f'<line x1="{left}" y1="{top}" x2="{left}" y2="{H - bottom}" stroke="black"/>']
    for i in range(int(math.log2(xmax / xmin)) + 1):
        x = xmin * 2 ** i
        out.append(f'<text x="{X(x):.1f}" y="{H - bottom + 15}" text-anchor="middle">{x:g}</text>')
    for i in range(6):
        y = ymax * i / 5
        out.append(f'<text x="{left - 5}" y="{Y(y) + 4:.1f}" text-anchor="end">{y:.3f}</text>')
    out.append(f'<text x="{(left + W - right) / 2}" y="{H - 12}" text-anchor="middle">{xlabel}</text>')
    out.append(f'<text x="15" y="{(top + H - bottom) / 2}" text-anchor="middle" '
               f'transform="rotate(-90 15 {(top + H - bottom) / 2})">{ylabel}</text>')
    out.append(f'<line x1="{X(targets[0]):.1f}" y1="{top}" x2="{X(targets[0]):.1f}" y2="{H - bottom}" '
               'stroke="grey" stroke-dasharray="3,3"/>')
    out.append(f'<line x1="{left}" y1="{Y(targets[1]):.1f}" x2="{W - right}" y2="{Y(targets[1]):.1f}" '
               'stroke="grey" stroke-dasharray="3,3"/>')
    for n, (name, points) in enumerate(series.items()):
        colour = COLOURS[n % len(COLOURS)]
        coords = " ".join(f"{X(x):.1f},{Y(y):.1f}" for x, y, _ in points)
        out.append(f'<polyline points="{coords}" fill="none" stroke="{colour}"/>')
        for x, y, label in points:
            out.append(f'<circle cx="{X(x):.1f}" cy="{Y(y):.1f}" r="3" fill="{colour}"/>')
            out.append(f'<text x="{X(x) + 4:.1f}" y="{Y(y) - 4:.1f}" font-size="9">{label}</text>')
        ly = top + 15 * n + 10
        out.append(f'<line x1="{W - right + 10}" y1="{ly}" x2="{W - right + 30}" y2="{ly}" stroke="{colour}"/>')
        out.append(f'<text x="{W - right + 35}" y="{ly + 4}">{name}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    sys.exit(main())
