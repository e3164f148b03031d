"""Where a long prompt's compression goes on a GPU: the whole encode of a prompt's rows in one
evaluation and in the server's steps, and each stage of one layer side, this tree's codebook
search and packing against the forms they replaced (issue 28's compress rate, issue 30's long
prompt beside short requests).

    python bench/encode_stages.py                      # 16,384 rows x 8 layers of 8 KV heads, d=128
    python bench/encode_stages.py --tokens 512         # a quick look (this CPU: the host stages)

The former forms, kept here as references: the codebook search compared each rotated
coordinate with every boundary (`sum(y[..., None] > boundaries)`: 2**bits - 1 bytes written per
coordinate), the packing summed masked fields per output word (about four operations per bit).
This tree's: a binary search over the sorted boundaries (`bits` comparisons) and the codes' bit
planes laid out as the stream. Both give the same codes and words (checked here on the timed
inputs). On a CPU the encode takes the numpy host stages (turboquant/codec/numpy_stages.py), so
the whole-encode rows compare nothing there; the stage rows still time MLX's forms.

Rows of the first table: the compression of `--tokens` rows in each of `--layers` caches
(`start_decoding`: one evaluation per decision for all layers), in one evaluation and in steps
of `--step-rows` rows over all layers (the server's `COMPRESS_ROWS`), per run in ms. Second
table: one layer side's stages over `--step-rows / --layers` rows and over `--step-rows` rows,
medians of `--repeats` evaluations (min-max).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import mlx.core as mx  # noqa: E402

import turboquant.codec.turbo as turbo  # noqa: E402
from bench.common import markdown_table, print_and_write  # noqa: E402
from tqstore.engine.batch import COMPRESS_ROWS  # noqa: E402
from turboquant import parse_scheme  # noqa: E402
from turboquant.adapter.making import start_decoding, starting  # noqa: E402
from turboquant.cache.compressed import TurboQuantKVCache  # noqa: E402
from turboquant.codec.packing import CHUNK, _layout, _padded, pack, packed_width  # noqa: E402
from turboquant.codec.plan import plan_layer  # noqa: E402

THIS_SEARCH = turbo.TurboCodec.quantize_rotated


def former_search(codec: turbo.TurboCodec, y: mx.array) -> mx.array:
    """The codebook search before the binary one: every boundary compared."""
    return mx.sum(y[..., None] > codec.boundaries, axis=-1).astype(mx.uint32)


def former_pack(indices: mx.array, bits: int) -> mx.array:
    """The packing before the bit planes: per output word, masked sums of shifted fields."""
    d, lead = indices.shape[-1], indices.shape[:-1]
    n_chunks = -(-d // CHUNK)
    codes = _padded(indices.astype(mx.uint32), n_chunks * CHUNK).reshape(*lead, n_chunks, CHUNK)
    word, shift, spill, spill_shift = _layout(bits)
    low = mx.left_shift(codes, shift)
    high = mx.where(spill, mx.right_shift(codes, spill_shift), mx.array(0, mx.uint32))
    zero = mx.array(0, mx.uint32)
    words = [mx.sum(mx.where(word == k, low, zero), axis=-1)
             + mx.sum(mx.where(spill & (word + 1 == k), high, zero), axis=-1) for k in range(bits)]
    return mx.stack(words, axis=-1).astype(mx.uint32).reshape(*lead, n_chunks * bits)[..., :packed_width(d, bits)]


FORMS = {"this tree": (THIS_SEARCH, pack), "former search and packing": (former_search, former_pack)}


def use(form: str) -> None:
    """Make the codec encode with `form`'s codebook search and packing."""
    turbo.TurboCodec.quantize_rotated, turbo.pack = FORMS[form]


def caches(args, scheme: str, tokens: int) -> list[TurboQuantKVCache]:
    """`--layers` caches holding `tokens` raw rows each (random bf16 keys and values), uncompressed."""
    out = []
    for i in range(args.layers):
        cache = TurboQuantKVCache(plan_layer(parse_scheme(scheme), args.heads, args.head_dim, args.head_dim, "bfloat16"))
        shape = (1, args.heads, tokens, args.head_dim)
        keys = mx.random.normal(shape, key=mx.random.key(i)).astype(mx.bfloat16)
        values = mx.random.normal(shape, key=mx.random.key(1000 + i)).astype(mx.bfloat16)
        cache.update_and_fetch(keys, values)
        queries = mx.random.normal((1, 4 * args.heads, 256, args.head_dim), key=mx.random.key(2000 + i))
        cache.observe_queries(queries.astype(mx.bfloat16), args.head_dim ** -0.5)
        out.append(cache)
    mx.eval([a for c in out for a in c._tail.arrays.values()])
    return out


def timed_ms(work, repeats: int) -> str:
    """Median (min-max) ms of `repeats` synchronized calls, after one warm-up."""
    work()
    seconds = []
    for _ in range(repeats):
        mx.synchronize()
        t0 = time.perf_counter()
        work()
        mx.synchronize()
        seconds.append(time.perf_counter() - t0)
    return f"{statistics.median(seconds) * 1e3:.2f} ({min(seconds) * 1e3:.2f}-{max(seconds) * 1e3:.2f})"


def whole_encode(args, scheme: str) -> list[list]:
    rows = []
    for form in FORMS:
        use(form)
        for label, go in (("one evaluation", start_decoding),
                          (f"steps of {args.step_rows} rows", lambda cs: list(starting(cs, args.step_rows)))):
            runs = []
            for _ in range(args.runs + 1):  # the first builds this shape's kernels: not counted
                held = caches(args, scheme, args.tokens)
                mx.synchronize()
                t0 = time.perf_counter()
                go(held)
                mx.synchronize()
                runs.append(time.perf_counter() - t0)
            rows.append([scheme, form, label, ", ".join(f"{t * 1e3:.1f}" for t in runs[1:])])
    use("this tree")
    return rows


def stages(args, scheme: str) -> list[list]:
    use("this tree")
    held = caches(args, scheme, 512)
    start_decoding(held)
    rows = []
    for count in sorted({max(1, args.step_rows // args.layers), args.step_rows}):
        x = mx.random.normal((1, args.heads, count, args.head_dim), key=mx.random.key(7)).astype(mx.bfloat16)
        for name, side in (("keys", held[0]._key_side), ("values", held[0]._value_side)):
            codec = side.codec
            y = codec.rotation.forward(x)
            codes = THIS_SEARCH(codec, y)
            mx.eval(y, codes)
            if not (mx.array_equal(codes, former_search(codec, y)).item()
                    and mx.array_equal(pack(codes, codec.bits), former_pack(codes, codec.bits)).item()):
                raise SystemExit("the former and this tree's forms disagree: the comparison is void")
            row = [scheme, name, f"{codec.bits}", f"{count:,}", timed_ms(lambda: mx.eval(side.encode(x)), args.repeats),
                   timed_ms(lambda: mx.eval(codec.rotation.forward(x)), args.repeats)]
            for search, packer in FORMS.values():
                row.append(timed_ms(lambda: mx.eval(search(codec, y)), args.repeats))
                row.append(timed_ms(lambda: mx.eval(packer(codes, codec.bits)), args.repeats))
            rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384, help="rows per layer to compress (default 16384)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=8, help="KV heads (default 8: Llama-3.1-8B)")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--schemes", nargs="+", default=["turbo4", "turbo5v4"])
    parser.add_argument("--step-rows", type=int, default=COMPRESS_ROWS, help="rows per step over all layers")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=7, help="evaluations per stage timing")
    parser.add_argument("--write", action="store_true", help="put the tables into docs/benchmarks.md")
    args = parser.parse_args(argv)
    whole, parts = [], []
    for scheme in args.schemes:
        whole += whole_encode(args, scheme)
        parts += stages(args, scheme)
    body = (f"Compressing {args.tokens:,} rows in each of {args.layers} layers ({args.heads} KV heads, d="
            f"{args.head_dim}, bf16), ms per run ({args.runs} runs after one uncounted):\n\n"
            + markdown_table(["scheme", "codebook search and packing", "evaluations", "ms per run"], whole)
            + "\n\nOne layer side's stages, ms, median (min-max) of "
            f"{args.repeats} evaluations:\n\n"
            + markdown_table(["scheme", "side", "bits", "rows", "whole side encode (this tree)", "rotation",
                              "search: this tree", "packing: this tree", "search: former", "packing: former"], parts))
    return print_and_write("bench-encode-stages", body, args.write, argv)


if __name__ == "__main__":
    sys.exit(main())
