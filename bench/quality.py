"""Quality of every scheme on the real model: KL vs the raw cache, top-1, perplexity, bits.

    python bench/quality.py --openblas                       # every scheme, writes docs/quality.md
    python bench/quality.py --openblas --experiment calibration --no-write
    python bench/quality.py --openblas --experiment residence --schemes turbo4 turbo8v3
    python bench/quality.py --openblas --protocol --schemes turbo4 turbo3   # issue 31's protocol

Prefills a raw prefix once (default 1024 tokens of the Devil's Dictionary), loads it into each
scheme's caches, compresses, and evaluates the next 1024 positions through the compressed
multi-token path (turboquant/quality.py).

--protocol is issue 31's: 2,048 document tokens of each of three texts (the Python docs held out
from all tuning), compressed as at save and round-tripped through a snapshot, then 512 real
continuation tokens; KL per position (first 128 / all 512), top-1, and bits per value with
everything the snapshot holds counted. The raw prefill and the raw cache's log-probabilities are
computed once per text and kept under $TQSTORE_HOME/quality/ (about 330 MB per text).
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (DEFAULT_MODEL, DEFAULT_TEXT, HOME, LICENCE_CHARS, git_revision, machine_line,  # noqa: E402
                    replace_section, use_openblas)

ALL_SCHEMES = ["raw", "affine8", "affine4", "turbo0v4", "turbo0v3", "turbo0v2", "turbo8v4", "turbo8v3", "turbo8v2",
               "turbo4", "turbo3", "turbo2", "turbo4v2"]
PEERS = {"mlx-lm-q8": 8, "mlx-lm-q4": 4}  # mlx-lm's own QuantizedKVCache (kv_bits), group size 64
# Issue 31's texts: two used while tuning, the third (Python docs) held out from all tuning.
PROTOCOL_TEXTS = {"devils": "devils_dictionary.txt", "jargon": "jargon_file.txt",
                  "python-docs (held out)": "python_docs_tutorial_howto.txt"}
PROTOCOL_SCHEMES = ["turbo4", "turbo5v4", "turbo8v3", "turbo3", "auto3.5", "auto6", "affine8", "mlx-lm-q8",
                    "mlx-lm-q4"]


def mlx_lm_quantized(bits: int):
    """mlx-lm's QuantizedKVCache holding the raw prefix (what `kv_bits` makes of a KVCache)."""

    def factory(model, raw):
        from mlx_lm.models.cache import make_prompt_cache as mlx_make_prompt_cache

        from turboquant import restore_as

        caches = restore_as(raw, mlx_make_prompt_cache(model))
        return [c.to_quantized(group_size=64, bits=bits) for c in caches]

    return factory


def experiment_runs(name: str, schemes: list[str]):
    from turboquant.codec.calibration import CalibrationConfig

    if name == "schemes":  # mlx-lm's own caches by their PEERS names
        return [(s, "default", {"factory": mlx_lm_quantized(PEERS[s])} if s in PEERS else {}) for s in schemes]
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
    if name == "wide-keys":  # what turbo5v4 is made of (docs/quality.md), with --protocol
        return wide_key_runs()
    raise SystemExit(f"unknown experiment {name!r}")


def wide_key_runs():
    """turbo5v4 against its parts: float32 norms, whole-layer or no protection; 4- and 3-bit keys
    with float16 norms for the smaller budgets."""
    from dataclasses import replace

    from turboquant import parse_scheme

    t5 = parse_scheme("turbo5v4")
    f32 = replace(t5, name="turbo5v4-f32", norm_dtype=None, protect_values=True)
    return [(t5, "f16 norms, keys protected", {}), (t5, "f16 norms, none protected", {"protect": "none"}),
            (f32, "f32 norms, K+V protected", {}),
            (replace(parse_scheme("turbo4v3"), name="turbo4v3-f16", norm_dtype="float16", protect_values=False),
             "f16 norms, none protected", {"protect": "none"}),
            (replace(parse_scheme("turbo3"), name="turbo3-f16", norm_dtype="float16", protect_values=False),
             "f16 norms, keys protected", {})]


def table(results, command: str) -> str:
    lines = ["| scheme | variant | KL | top-1 | PPL (raw cache) | bits/element | x fp16 |", "|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r.scheme} | {r.variant} | {r.kl:.4f} | {r.top1:.3f} | {r.ppl:.2f} ({r.ref_ppl:.2f}) | "
                     f"{r.bits_per_element:.2f} | {r.compression:.2f} |")
    first = results[0]
    lines += ["", f"{first.positions} evaluated positions after a compressed prefix of {first.prefix} tokens. "
              f"Command: `{command}` (git {git_revision()}, {datetime.date.today()}).", f"Machine: {machine_line()}."]
    return "\n".join(lines)


def protocol_table(by_text: dict[str, dict], runs: list[tuple[str, str]], note: str, default: str = "") -> str:
    """Scheme rows, one column group per text: bits, KL first 128 / all 512, top-1 ("not run"
    where a text has no result for the run). `by_text` maps text -> {(scheme, variant): result}."""
    labels = list(by_text)
    variants = any(v != "default" for _, v in runs)
    head = "| scheme | " + ("variant | " if variants else "") + " | ".join(
        f"{t}: bits, KL 128 / 512, top-1" for t in labels) + " |"
    lines = [head, "|---|" + ("---|" if variants else "") + "---|" * len(labels)]
    for scheme, variant in runs:
        cells = []
        for results in by_text.values():
            r = results.get((scheme, variant))
            cells.append("not run" if r is None else f"{r.bits:.2f}, {r.kl_mean(128):.4f} / {r.kl_mean():.4f}, {r.top1:.3f}")
        name = f"{scheme} (default)" if scheme == default else scheme
        lines.append(f"| {name} | " + (f"{variant} | " if variants else "") + " | ".join(cells) + " |")
    return "\n".join(lines + ["", note])


def plot_positions(by_text: dict[str, list], path: Path, window: int = 32) -> None:
    """KL against continuation position (moving mean over `window`), one panel per text."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(1, len(by_text), figsize=(5 * len(by_text), 3.8), squeeze=False, sharey=True)
    order = list(dict.fromkeys(r.scheme for results in by_text.values() for r in results))  # one colour per scheme
    for ax, (label, results) in zip(axes[0], by_text.items()):
        for r in results:
            smooth = np.convolve(r.kl, np.ones(window) / window, mode="valid")
            ax.plot(np.arange(smooth.shape[0]) + window // 2, smooth, label=f"{r.scheme} ({r.bits:.2f} b)",
                    color=f"C{order.index(r.scheme) % 10}")
        ax.set_yscale("log")
        ax.set_title(label)
        ax.set_xlabel("continuation position")
        ax.grid(True, alpha=0.3)
    axes[0][0].set_ylabel(f"KL vs raw cache (mean over {window})")
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=75)
    plt.close(fig)


def run_protocol(args, model, tokenizer, command: str) -> int:
    """Issue 31's protocol over PROTOCOL_TEXTS (or --text), references cached per text, each
    (text, scheme) result kept in --results as it finishes (a rerun skips those it holds)."""
    import mlx.core as mx

    import quality_store
    from tqstore.models.blas import active_blas
    from turboquant.quality import evaluate_saved, load_reference, reference, save_reference

    # One text when one is named (--text, or --label with the default text), else all three.
    texts = ({args.label or args.text.stem: args.text} if args.text != DEFAULT_TEXT or args.label
             else {label: HOME / "corpus" / name for label, name in PROTOCOL_TEXTS.items()})
    runs = experiment_runs(args.experiment, args.schemes)
    store = {} if args.fresh else quality_store.load(args.results)
    revision = git_revision()
    # The held-out text first: its figures are the ones the targets are judged on.
    for label in sorted(texts, key=lambda t: "held out" not in t):
        path = texts[label]
        todo = [r for r in runs if quality_store.key(getattr(r[0], "name", r[0]), r[1]) not in store.get(label, {})]
        if not todo or args.no_run:
            continue
        tokens = tokenizer.encode(path.read_text(errors="replace")[LICENCE_CHARS:])[: args.prefix + args.positions]
        cached = HOME / "quality" / f"{path.stem}-{args.prefix}-{args.positions}-{active_blas()}.npz"
        if cached.exists():
            ref = load_reference(model, cached, args.chunk)
        else:
            print(f"{label}: raw prefill of {args.prefix} tokens and the reference continuation", flush=True)
            ref = reference(model, mx.array(tokens), args.prefix, args.chunk)
            save_reference(ref, cached)
        print(f"{label}:", flush=True)
        for run in todo:
            (result,) = evaluate_saved(model, ref, [run], args.chunk, progress=lambda m: print(m, flush=True))
            quality_store.put(args.results, store, label, result, revision)
    names = [(getattr(s, "name", s), v) for s, v, _ in runs]
    by_text = {label: {(r["scheme"], r["variant"]): quality_store.as_result(r)
                       for r in store.get(label, {}).values()} for label in texts}
    records = [r for label in texts for r in store.get(label, {}).values() if (r["scheme"], r["variant"]) in names]
    revisions = sorted({r["git"] for r in records})
    dates = sorted({r["date"] for r in records})
    note = (f"2,048 document tokens compressed as at save and restored from a snapshot, then {args.positions} "
            f"continuation positions. Command: `{command}` (rows measured at git {', '.join(revisions)}, "
            f"{' to '.join(dict.fromkeys([dates[0], dates[-1]])) if dates else 'never'}; per-position KL in "
            f"`{args.results.relative_to(args.out.parent.parent) if args.results.is_relative_to(args.out.parent.parent) else args.results}`).\n"
            f"Machine: {machine_line()}.")
    body = protocol_table(by_text, names, note, default=args.default_scheme)
    print(body)
    if not args.no_write:
        suffix = f"-{args.label}" if args.label else ""
        replace_section(args.out, f"quality-protocol-{args.experiment}{suffix}", body)
        plot_positions({label: [res[n] for n in names if n in res] for label, res in by_text.items()},
                       args.out.parent / "img" / f"quality_kl_{args.experiment}{suffix}.png")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--text", type=Path, default=DEFAULT_TEXT)
    parser.add_argument("--prefix", type=int, help="prefilled tokens (default 1024; 2048 with --protocol)")
    parser.add_argument("--positions", type=int, help="evaluated tokens (default 1024; 512 with --protocol)")
    parser.add_argument("--chunk", type=int, default=128)
    parser.add_argument("--schemes", nargs="+", help="default: every scheme (PROTOCOL_SCHEMES with --protocol)")
    parser.add_argument("--experiment", default="schemes",
                        choices=["schemes", "calibration", "protection", "peers", "residence", "wide-keys"])
    parser.add_argument("--openblas", action="store_true", help="preload Debian's OpenBLAS (AVX-512 CPUs)")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent.parent / "docs" / "quality.md")
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--label", default="", help="suffix of the docs section (e.g. another text)")
    parser.add_argument("--results", type=Path, default=Path(__file__).resolve().parent / "results" / "quality-protocol.json",
                        help="--protocol: per-(text, scheme) results, kept as they finish and reused by a rerun")
    parser.add_argument("--fresh", action="store_true", help="--protocol: recompute every result")
    parser.add_argument("--no-run", action="store_true",
                        help="--protocol: table and plot from --results only (what is missing shows as not run)")
    parser.add_argument("--default-scheme", default="turbo4", help="the row marked (default)")
    parser.add_argument("--protocol", action="store_true",
                        help="issue 31's protocol: 2048 + 512 tokens over three texts, save round trip")
    args = parser.parse_args(argv[1:])
    args.prefix = args.prefix or (2048 if args.protocol else 1024)
    args.positions = args.positions or (512 if args.protocol else 1024)
    args.schemes = args.schemes or (PROTOCOL_SCHEMES if args.protocol else ALL_SCHEMES)
    if args.openblas:
        use_openblas(argv)

    import mlx.core as mx
    from mlx_lm import load

    from turboquant.quality import evaluate

    if not args.model.exists():
        sys.exit(f"model not found at {args.model}: run `tqstore model install qwen2.5-coder-0.5b` or pass --model")
    model, tokenizer = load(str(args.model))
    model.set_dtype(mx.float32)  # MLX's CPU fp16 matmul is very slow; f32 is also the reference
    command = "python bench/quality.py " + " ".join(argv[1:])
    if args.protocol:
        return run_protocol(args, model, tokenizer, command)
    text = args.text.read_text(errors="replace")[LICENCE_CHARS:]
    tokens = mx.array(tokenizer.encode(text)[: args.prefix + args.positions])
    runs = experiment_runs(args.experiment, args.schemes)
    results = evaluate(model, tokens, args.prefix, runs, chunk=args.chunk, progress=print)
    body = table(results, command)
    print(body)
    if not args.no_write:
        replace_section(args.out, f"quality-{args.experiment}" + (f"-{args.label}" if args.label else ""), body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
