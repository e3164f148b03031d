"""Quality of every scheme on the real model: KL vs the raw cache, top-1, perplexity, bits.

    python bench/quality.py --openblas                       # every scheme, writes docs/quality.md
    python bench/quality.py --openblas --experiment calibration --no-write
    python bench/quality.py --openblas --experiment residence --schemes turbo4 turbo8v3

Prefills a raw prefix once (default 1024 tokens of the Devil's Dictionary), loads it into each
scheme's caches, compresses, and evaluates the next 1024 positions through the compressed
multi-token path (turboquant/quality.py).
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (DEFAULT_MODEL, DEFAULT_TEXT, LICENCE_CHARS, git_revision, machine_line,  # noqa: E402
                    replace_section, use_openblas)

ALL_SCHEMES = ["raw", "affine8", "affine4", "turbo0v4", "turbo0v3", "turbo0v2", "turbo8v4", "turbo8v3", "turbo8v2",
               "turbo4", "turbo3", "turbo2", "turbo4v2"]
PEERS = {"mlx-lm-q8": 8, "mlx-lm-q4": 4}  # mlx-lm's own QuantizedKVCache (kv_bits), group size 64


def mlx_lm_quantized(bits: int):
    """mlx-lm's QuantizedKVCache holding the raw prefix (what `kv_bits` makes of a KVCache)."""

    def factory(model, raw):
        from mlx_lm.models.cache import make_prompt_cache as mlx_make_prompt_cache

        from turboquant import restore_as

        caches = restore_as(raw, mlx_make_prompt_cache(model))
        return [c.to_quantized(group_size=64, bits=bits) for c in caches]

    return factory


def experiment_runs(name: str, schemes: list[str]):
    from turboquant.calibration import CalibrationConfig

    if name == "schemes":
        return [(s, "default", {}) for s in schemes]
    if name == "peers":
        return [(peer, "mlx-lm QuantizedKVCache", {"factory": mlx_lm_quantized(bits)}) for peer, bits in PEERS.items()]
    if name == "calibration":
        configs = {
            "none": CalibrationConfig(False, False, False),
            "rotated": CalibrationConfig(False, False, True),
            "center": CalibrationConfig(True, False, False),
            "channel": CalibrationConfig(False, True, False),
            "center+channel": CalibrationConfig(True, True, False),
            "all three": CalibrationConfig(True, True, True),
        }
        return [(s, f"{label}, {mode}", {"calibration": cfg, "protect": mode})
                for s in schemes for label, cfg in configs.items() for mode in ("position", "none")]
    if name == "residence":  # every layer compressed in memory, or at rest only (native attention)
        return [(s, label, {"at_rest": label == "at rest"}) for s in schemes for label in ("in memory", "at rest")]
    if name == "protection":
        return [(s, mode, {"protect": mode}) for s in schemes for mode in ("stats", "position", "none")]
    raise SystemExit(f"unknown experiment {name!r}")


def table(results, command: str) -> str:
    lines = ["| scheme | variant | KL | top-1 | PPL (raw cache) | bits/element | x fp16 |", "|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r.scheme} | {r.variant} | {r.kl:.4f} | {r.top1:.3f} | {r.ppl:.2f} ({r.ref_ppl:.2f}) | "
                     f"{r.bits_per_element:.2f} | {r.compression:.2f} |")
    first = results[0]
    lines += ["", f"{first.positions} evaluated positions after a compressed prefix of {first.prefix} tokens. "
              f"Command: `{command}` (git {git_revision()}, {datetime.date.today()}).", f"Machine: {machine_line()}."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--text", type=Path, default=DEFAULT_TEXT)
    parser.add_argument("--prefix", type=int, default=1024)
    parser.add_argument("--positions", type=int, default=1024)
    parser.add_argument("--chunk", type=int, default=128)
    parser.add_argument("--schemes", nargs="+", default=ALL_SCHEMES)
    parser.add_argument("--experiment", default="schemes", choices=["schemes", "calibration", "protection", "peers", "residence"])
    parser.add_argument("--openblas", action="store_true", help="preload Debian's OpenBLAS (AVX-512 CPUs)")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent.parent / "docs" / "quality.md")
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--label", default="", help="suffix of the docs section (e.g. another text)")
    args = parser.parse_args(argv[1:])
    if args.openblas:
        use_openblas(argv)

    import mlx.core as mx
    from mlx_lm import load

    from turboquant.quality import evaluate

    if not args.model.exists():
        sys.exit(f"model not found at {args.model}: run `tqstore model install qwen2.5-coder-0.5b` or pass --model")
    model, tokenizer = load(str(args.model))
    model.set_dtype(mx.float32)  # MLX's CPU fp16 matmul is very slow; f32 is also the reference
    text = args.text.read_text(errors="replace")[LICENCE_CHARS:]
    tokens = mx.array(tokenizer.encode(text)[: args.prefix + args.positions])
    runs = experiment_runs(args.experiment, args.schemes)
    results = evaluate(model, tokens, args.prefix, runs, chunk=args.chunk, progress=print)
    command = "python bench/quality.py " + " ".join(argv[1:])
    body = table(results, command)
    print(body)
    if not args.no_write:
        replace_section(args.out, f"quality-{args.experiment}" + (f"-{args.label}" if args.label else ""), body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
