"""`python -m turboquant`: the codebook tables, the scheme table and a round-trip demo."""

from __future__ import annotations

import argparse
import sys

import mlx.core as mx

from turboquant.codec.codebook import lloyd_max_codebook
from turboquant.codec.turbo import TurboCodec
from turboquant.codec.schemes import SCHEMES


def codebook_table(d: int) -> list[str]:
    """Positive halves of the exact codebooks and D_mse at head dim d."""
    lines = [f"Lloyd-Max codebooks, d={d} (positive half; symmetric)", "",
             "| bits | centroids | boundaries | D_mse |", "|---|---|---|---|"]
    for bits in (1, 2, 3, 4, 5):
        cb = lloyd_max_codebook(d, bits)
        half = cb.levels // 2
        c = " ".join(f"{x:.8f}" for x in cb.centroids[half:])
        t = " ".join(f"{x:.8f}" for x in cb.boundaries[len(cb.boundaries) // 2:])
        lines.append(f"| {bits} | {c} | {t} | {cb.d_mse:.6g} |")
    return lines


def scheme_table(dims: tuple[int, ...] = (64, 128)) -> list[str]:
    """Bytes per token per KV head (K + V, fp16 model, norms included) and ratio to fp16."""
    head = "| scheme | K | V | fragile | " + " | ".join(f"B/token d={d} | x fp16 d={d}" for d in dims) + " |"
    lines = ["Schemes (bytes per token per KV head, fp16 activations; ratios against fp16)", "",
             head, "|" + "---|" * (4 + 2 * len(dims))]
    for spec in SCHEMES.values():
        k = f"{spec.key_format.value} {spec.key_bits or ''}".strip()
        v = f"{spec.value_format.value} {spec.value_bits or ''}".strip()
        cells = " | ".join(f"{spec.bytes_per_token(d)} | {spec.compression(d):.2f}" for d in dims)
        lines.append(f"| {spec.name} | {k} | {v} | {'yes' if spec.fragile else 'no'} | {cells} |")
    return lines


def round_trip_demo(d: int = 128, rows: int = 4096, seed: int = 0) -> list[str]:
    """Encode Gaussian rows and report measured vs exact D_mse per bit width."""
    x = mx.random.normal((rows, d), key=mx.random.key(seed))
    lines = [f"Round trip, {rows} Gaussian rows, d={d}", "",
             "| bits | packed words/row | measured D_mse | exact D_mse | ratio |", "|---|---|---|---|---|"]
    for bits in (2, 3, 4, 5):
        codec = TurboCodec(d, bits, seed)
        packed, norms = codec.encode(x)
        err = mx.sum((x - codec.decode(packed, norms)) ** 2, axis=-1) / mx.sum(x * x, axis=-1)
        measured = mx.mean(err).item()
        exact = lloyd_max_codebook(d, bits).d_mse
        lines.append(f"| {bits} | {packed.shape[-1]} | {measured:.5f} | {exact:.5f} | {measured / exact:.3f} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m turboquant", description=__doc__)
    parser.add_argument("--d", type=int, nargs="+", default=[64, 128], help="head dims for the tables")
    args = parser.parse_args(argv)
    blocks = [codebook_table(d) for d in args.d]
    blocks.append(scheme_table(tuple(args.d)))
    blocks.append(round_trip_demo(d=max(args.d)))
    print("\n\n".join("\n".join(b) for b in blocks))
    return 0


if __name__ == "__main__":
    sys.exit(main())
