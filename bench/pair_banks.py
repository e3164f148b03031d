"""Expected shared-memory wavefronts of one warp-wide pair-table lookup in the tensor-core pass 1.

Lane l reads copy l mod C of a pair table interleaved C ways (entry e, copy k at word e*C + k),
so a warp's 32 lookups spread over the banks as the entries fall, and the load takes as many
wavefronts as the fullest bank holds distinct words. The two codes of a pair are drawn with the
Lloyd-Max cell frequencies of the codebook (d=128), independently. Nsight Compute measured 2.17
wavefronts a shared load for turbo4's pass 1 and 2.75 for turbo5v4's on an H100 (docs/benchmarks.md,
"Bound by latency").

  python bench/pair_banks.py                 # bits x copies table
  python bench/pair_banks.py --trials 20000
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from turboquant.codec.codebook import lloyd_max_codebook  # noqa: E402

BANKS = 32
D = 128


def wavefronts(bits: int, copies: int, trials: int, rng: np.random.Generator) -> float:
    """Mean wavefronts of a warp's lookup of random pairs (`trials` lookups)."""
    p = np.array(lloyd_max_codebook(D, bits).cell_probabilities, dtype=np.float64)
    p = p / p.sum()
    lo = rng.choice(p.size, size=(trials, 32), p=p)
    hi = rng.choice(p.size, size=(trials, 32), p=p)
    word = (lo | (hi << bits)) * copies + (np.arange(32) & (copies - 1))
    bank = word % BANKS
    total = 0
    for w, b in zip(word, bank):
        distinct = {}
        for bk, wd in zip(b.tolist(), w.tolist()):
            distinct.setdefault(bk, set()).add(wd)
        total += max(len(v) for v in distinct.values())
    return total / trials


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=5000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = np.random.default_rng(args.seed)
    copies = (1, 2, 4, 8, 16, 32)
    print(f"Wavefronts a warp-wide pair lookup, {args.trials} lookups each (python bench/pair_banks.py "
          f"--trials {args.trials} --seed {args.seed})\n")
    print("| code bits | " + " | ".join(f"{c} copies" for c in copies) + " |")
    print("|---|" + "---|" * len(copies))
    for bits in (2, 3, 4, 5):
        cells = [f"{wavefronts(bits, c, args.trials, rng):.2f}" for c in copies]
        print(f"| {bits} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
