"""Write turboquant/codec/codebook_table.py: the Lloyd-Max codebooks of the common head dims, computed.

    python tools/codebook_table.py

Every value is written as Python's repr of the float64, which reads back bit for bit;
tests/test_codebook.py checks each entry against `turboquant.codec.codebook.compute_codebook`.
Run it again after any change to the iteration (the test fails until then).
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from turboquant.codec.codebook import MAX_BITS, compute_codebook  # noqa: E402

# Head dims of the model families tqstore runs (and of its tests' tiny models).
DIMS = (16, 32, 48, 64, 72, 80, 96, 112, 128, 160, 192, 256)
OUT = ROOT / "turboquant" / "codebook_table.py"


def _floats(values) -> str:
    return "(" + ", ".join(repr(float(v)) for v in values) + ("," if len(values) == 1 else "") + ")"


def render() -> str:
    """The module's text."""
    lines = ['"""Lloyd-Max codebooks of the common head dims, precomputed (turboquant/codec/codebook.py).',
             "",
             "Written by `python tools/codebook_table.py`; do not edit. (d, bits) -> (centroids, boundaries,",
             'cell probabilities, D_mse), float64 values as Python reprs (exact)."""',
             "",
             "TABLE: dict[tuple[int, int], tuple[tuple[float, ...], tuple[float, ...], tuple[float, ...], float]] = {"]
    for d in DIMS:
        for bits in range(1, MAX_BITS + 1):
            cb = compute_codebook(d, bits)
            lines.append(f"    ({d}, {bits}): (")
            for values in (cb.centroids, cb.boundaries, cb.cell_probabilities):
                lines.append(f"        {_floats(values)},")
            lines.append(f"        {cb.d_mse!r},")
            lines.append("    ),")
    lines.append("}")
    return "\n".join(lines) + "\n"


def main() -> int:
    OUT.write_text(render())
    print(f"wrote {OUT.relative_to(ROOT)} ({len(DIMS)} head dims, bits 1..{MAX_BITS})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
