"""Stored bytes per token of every mlx-lm family at turbo4 and turbo8v3, against raw.

    python bench/family_bytes.py            # writes the family table into docs/models.md

Each family's tiny random config (tests/arch_configs.py, widened here to heads of 64, hidden 256
and MLA latents of 256 with a rope part of 64, the proportions of real models; 4 layers) prefills
the same tokens (256 in the docs) under raw, turbo4 and turbo8v3. The table is the snapshot's
layer bytes per token (codes, norms, scales, calibration), with activation-dtype arrays counted
at 2 bytes (fp16, as every ratio in the docs; the models compute in float32, which MLX's CPU
needs for MoE layers), and raw over it. Bytes that do not grow with the tokens (recurrent
states, sliding-window rings and attention chunks kept whole, a model's own cache fields) are
a separate column; shared codec arrays (per model) are left out. The residence columns count
the layers each scheme compresses in memory / at rest / leaves native. A family whose widened
config does not build or run is measured at the generic one (heads of 16: turbo8v3's affine
keys fit no group size there and stay native), and marked so.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT / "tests"))

from common import family_arguments, git_revision, machine_line, markdown_table, replace_section  # noqa: E402

SCHEMES = ("turbo4", "turbo8v3")
MARKER = "family-bytes"
HIDDEN = ("hidden_size", "d_model", "n_embd", "dim", "embed_dim", "model_dim")
WIDE = {**{name: 256 for name in HIDDEN}, "head_dim": 64, "kv_lora_rank": 256, "q_lora_rank": 256,
        "qk_rope_head_dim": 64, "qk_nope_head_dim": 64, "v_head_dim": 64, "intermediate_size": 512}
ALWAYS_FLOAT32 = ("_norms", "keys_shift")  # stored float32 whatever the activations are


def fp16_bytes(record) -> int:
    """A record's bytes with activation-dtype arrays at 2 bytes per element (see the docstring)."""
    import mlx.core as mx

    total = sum(a.nbytes for a in record.calibration.values())
    for name, a in record.arrays.items():
        floating = a.dtype in (mx.float32, mx.float16, mx.bfloat16)
        total += a.size * 2 if floating and not name.endswith(ALWAYS_FLOAT32) else a.nbytes
    return total


def split_bytes(records) -> tuple[int, int]:
    """(bytes that grow with the tokens, bytes that do not: recurrent states and their block
    checkpoints, sliding-window rings and chunks kept whole, a model's own cache fields)."""
    from turboquant.records import Layout, split_children

    grows = fixed = 0
    for r in records:
        if r.layout is Layout.LIST:
            g, f = split_bytes(split_children(r))
            grows, fixed = grows + g, fixed + f
        elif r.layout in (Layout.STATE, Layout.ROTATING, Layout.CHUNKED, Layout.FIELDS):
            fixed += fp16_bytes(r)
        else:
            grows += fp16_bytes(r)
    return grows, fixed


def build(family: str, wide: bool):
    """The family at WIDE dimensions, or at the generic config."""
    import arch_configs

    generic = dict(arch_configs.GENERIC)
    try:
        if wide:
            arch_configs.GENERIC.update(WIDE)
        return arch_configs.build(family)
    finally:
        arch_configs.GENERIC.clear()
        arch_configs.GENERIC.update(generic)


def family_row(family: str, tokens: int, wide: bool = True) -> list:
    """[family, raw B/token, fixed bytes, then per scheme B/token, x raw, in memory/at rest/native]."""
    import mlx.core as mx

    from turboquant.adapter.making import compress_caches, make_prompt_cache
    from turboquant.adapter.snapshots import snapshot
    from turboquant.adapter.residence import Residence, residence_of

    model = build(family, wide)
    prompt = mx.arange(tokens)[None] % 100 + 1
    row: list = [family if wide else f"{family} (heads of 16)"]
    raw = None
    for scheme in ("raw", *SCHEMES):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            caches = make_prompt_cache(model, scheme)
        model(prompt, cache=caches)
        compress_caches(caches)
        grows, fixed = split_bytes(snapshot(caches).layers)
        per_token = grows / tokens
        if scheme == "raw":
            raw = per_token
            row += [f"{per_token:.0f}", f"{fixed:,}"]
            continue
        counts = [sum(residence_of(c) is r for c in caches) for r in Residence]
        ratio = f"{raw / per_token:.2f}" if per_token else "-"
        row += [f"{per_token:.0f}", ratio, "/".join(map(str, counts))]
    return row


def main(argv: list[str] | None = None) -> int:
    args = family_arguments(__doc__, 512, argv)

    from arch_configs import NOT_BUILDABLE, families

    rows = []
    for family in args.families or [f for f in families() if f not in NOT_BUILDABLE]:
        try:
            try:
                rows.append(family_row(family, args.tokens))
            except Exception:  # the widened config breaks an assumption of the family's code
                rows.append(family_row(family, args.tokens, wide=False))
        except Exception as e:  # a family that fails here is reported in the table, not hidden
            rows.append([family, f"fails: {type(e).__name__}: {e}"[:80]] + [""] * 7)
        print(" | ".join(map(str, rows[-1])), flush=True)
    header = ["family", "raw B/token", "fixed bytes"] + [h for s in SCHEMES for h in (f"{s} B/token", f"{s} x raw",
                                                                      f"{s} in memory/at rest/native")]
    body = (f"Stored bytes per token of every family's tiny config ({args.tokens} tokens; heads of 64, fp16 "
            f"accounting, layer arrays only: see bench/family_bytes.py; revision {git_revision()}; "
            f"{machine_line()}). Layers: compressed in memory / at rest / native.\n\n" + markdown_table(header, rows))
    replace_section(args.out, MARKER, body)
    print(body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
