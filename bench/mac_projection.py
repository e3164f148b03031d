"""Project the first-token ratio of a stored context on a Mac from measured per-GB store costs.

    python bench/mac_projection.py --measured results.json            # a bench/restore_vs_recompute.py --json file
    python bench/mac_projection.py --measured results.json --write    # put the table into docs/benchmarks.md

Nothing here is measured on a Mac: the store's costs per stored GB come from a
`bench/restore_vs_recompute.py --json` run (the Engine's restore seconds over stored bytes, from
memory and from LMDB with its pages dropped, medians over runs at the longest context measured),
the bytes per token of each scheme from the same run (scaled from its layers to the projected
model's; for raw, an fp16 cache's 4 bytes per K/V pair and channel, since the run's random K/V
compress where real ones do not; for turbo4 the measured bytes overstate a 32-layer model's,
whose protected boundary layers are 4 of 32 rather than 4 of 8), and the Mac's side from flags with published or stated values:

- `--prefill-rates`: an 8B model's prefill at short context in tokens/s (default 500, 1000, 2000:
  issue 28's "about 1k tokens/s, newer Max chips several times faster"), slowed at long context by
  attention's FLOPs (2 * layers * hidden * N per token on average over N tokens, against 2 *
  parameters per token for the rest), as if attention ran as efficiently as the matmuls (which
  flatters the cold prefill, so the ratios are conservative);
- `--ssd-gbps`: the internal SSD's sequential read (default 5 GB/s);
- `--memory-gbps`: unified memory bandwidth (default 400 GB/s, an M3 Max), which bounds the
  question's prefill after a restore (the weights read once, the stored context read once);
- `--host-speed`: how much faster a Mac core runs the store's host work than the measuring
  machine's (default 1.0: no credit taken).

A restore from LMDB costs the larger of the SSD read and the store's measured host work (they
overlap on read-ahead threads); from memory, the measured memory restore. The "at the SSD floor"
column is what the same restore would cost if the store's host work vanished.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import markdown_table, replace_section, stamp  # noqa: E402

DOCS = Path(__file__).resolve().parent.parent / "docs"
MARKER = "bench-mac-projection"
QUESTION_TOKENS = 16


@dataclass(frozen=True)
class Model:
    """The projected model's shapes (Llama-3.1-8B by default)."""

    layers: int = 32
    hidden: int = 4096
    kv_heads: int = 8
    head_dim: int = 128
    parameters: float = 8.03e9
    weight_bytes: float = 4.5e9  # 4-bit weights with their scales, as Mac users run an 8B model


@dataclass(frozen=True)
class Mac:
    """The Mac's side of the projection (see the module docstring)."""

    prefill_rate: float
    ssd_gbps: float
    memory_gbps: float
    host_speed: float


@dataclass(frozen=True)
class StoreCosts:
    """Measured per scheme: seconds per stored GB and stored bytes per token per layer."""

    memory_s_per_gb: float
    lmdb_s_per_gb: float
    bytes_per_token_layer: float


def measured_costs(results: dict) -> dict[str, StoreCosts]:
    """Per scheme, the medians at the longest context of a restore_vs_recompute run."""
    rows = [r for r in results["rows"] if "error" not in r]
    layers = results["meta"].get("layers") or _layers_from(results["meta"]["model"])
    costs = {}
    for scheme in sorted({r["scheme"] for r in rows}):
        mine = [r for r in rows if r["scheme"] == scheme]
        longest = max(r["tokens"] for r in mine)
        at = [r for r in mine if r["tokens"] == longest]
        per_gb = {tier: statistics.median(r[tier]["restore_seconds"] / (r["stored_bytes"] / 1e9) for r in at)
                  for tier in ("memory", "lmdb")}
        per_token = statistics.median(r["stored_bytes"] / r["tokens"] / layers for r in at)
        if scheme == "raw":  # random K/V compress under zstd where real ones do not: an fp16 cache's bytes
            per_token = 2 * 2 * Model.kv_heads * Model.head_dim
        costs[scheme] = StoreCosts(per_gb["memory"], per_gb["lmdb"], per_token)
    return costs


def _layers_from(model_line: str) -> int:
    """The layer count in restore_vs_recompute's model description ("a Llama model (8 layers, ...")."""
    return int(model_line.split("(", 1)[1].split(" layers", 1)[0])


def cold_seconds(model: Model, mac: Mac, tokens: int) -> float:
    """A cold prefill of `tokens`: the short-context rate slowed by attention's share of FLOPs."""
    attention = 2 * model.layers * model.hidden * tokens
    return tokens / mac.prefill_rate * (1 + attention / (2 * model.parameters))


def question_seconds(model: Model, mac: Mac, context_bytes: float) -> float:
    """A short question after a restore: memory-bound (the weights and the stored context read once)."""
    return (model.weight_bytes + context_bytes) / (mac.memory_gbps * 1e9)


def project(model: Model, mac: Mac, costs: StoreCosts, tokens: int) -> dict[str, float]:
    """Seconds to the first token: cold, from memory, from LMDB, and from LMDB at the SSD floor."""
    stored = costs.bytes_per_token_layer * model.layers * tokens
    question = question_seconds(model, mac, stored)
    ssd = stored / (mac.ssd_gbps * 1e9)
    host = stored / 1e9 * costs.lmdb_s_per_gb / mac.host_speed
    return {"cold": cold_seconds(model, mac, tokens), "stored_gb": stored / 1e9,
            "memory": stored / 1e9 * costs.memory_s_per_gb / mac.host_speed + question,
            "lmdb": max(ssd, host) + question, "floor": ssd + question}


def table(model: Model, macs: list[Mac], costs: dict[str, StoreCosts], contexts: list[int]) -> str:
    rows = []
    for mac in macs:
        for tokens in contexts:
            for scheme, c in costs.items():
                p = project(model, mac, c, tokens)
                rows.append([f"{mac.prefill_rate:,.0f}", f"{tokens:,}", scheme, f"{p['stored_gb']:.2f}",
                             f"{p['cold']:.1f} s", f"{p['memory']:.2f} s ({p['cold'] / p['memory']:.0f}x)",
                             f"{p['lmdb']:.2f} s ({p['cold'] / p['lmdb']:.0f}x)",
                             f"{p['floor']:.2f} s ({p['cold'] / p['floor']:.0f}x)"])
    return markdown_table(["prefill tok/s (short context)", "tokens", "scheme", "stored GB", "cold prefill",
                           "from memory", "from LMDB", "from LMDB at the SSD floor"], rows)


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--measured", type=Path, required=True, help="a restore_vs_recompute.py --json file")
    parser.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--prefill-rates", type=float, nargs="+", default=[500.0, 1000.0, 2000.0])
    parser.add_argument("--ssd-gbps", type=float, default=5.0)
    parser.add_argument("--memory-gbps", type=float, default=400.0)
    parser.add_argument("--host-speed", type=float, default=1.0)
    parser.add_argument("--weights-gb", type=float, default=4.5)
    parser.add_argument("--write", action="store_true", help="put the table into docs/benchmarks.md")
    return parser.parse_args(argv[1:])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv if argv is None else argv
    args = parse(argv)
    results = json.loads(args.measured.read_text())
    costs = measured_costs(results)
    model = Model(weight_bytes=args.weights_gb * 1e9)
    macs = [Mac(rate, args.ssd_gbps, args.memory_gbps, args.host_speed) for rate in args.prefill_rates]
    meta = results["meta"]
    measured = ", ".join(f"{s}: memory {c.memory_s_per_gb:.3f} s/GB, LMDB {c.lmdb_s_per_gb:.3f} s/GB, "
                         f"{c.bytes_per_token_layer:,.0f} B/token/layer" for s, c in costs.items())
    body = (f"Projected, not measured on a Mac: Llama-3.1-8B shapes ({model.layers} layers, {model.kv_heads} KV "
            f"heads, head dim {model.head_dim}), {model.weight_bytes / 1e9:.1f} GB of weights, SSD "
            f"{args.ssd_gbps:g} GB/s, memory {args.memory_gbps:g} GB/s, host speed x{args.host_speed:g}. Store "
            f"costs from `{meta['command']}` (git {meta['revision']}, {meta['date']}; {meta['machine']}): "
            f"{measured}.\n\n{table(model, macs, costs, args.contexts)}\n\n{stamp(argv)}")
    if args.write:
        replace_section(DOCS / "benchmarks.md", MARKER, body)
    print(body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
