"""Decode-attention calls over compressed caches, for a kernel profiler to measure (Nsight Compute).

Builds one 64k-token cache per scheme (B=1, 32 query / 8 KV heads, d=128, fp16, random rows: the
shapes of `bench/decode.py --compare`) and runs the cache's own attention `--calls` times per
scheme, the schemes in the order given. On its own it only prints what it ran; under `ncu` every
launch of the pass-1 kernels is profiled at the profiler's fixed clocks, so two schemes' or two
trees' kernel times compare to a fraction of a percent, where chained timings spread by 5-10%:

  ncu --kernel-name regex:tq_decode1mma_t --launch-count 4 --section SpeedOfLight \\
      --section Occupancy --section SchedulerStats --section LaunchStats \\
      python bench/kernel_profile.py turbo4 turbo5v4

Needs an MLX GPU backend (the tensor-core pass 1 is CUDA's).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # kernel_support: the synthetic caches

import mlx.core as mx  # noqa: E402

from kernel_support.synthetic import build_cache  # noqa: E402

HQ, HKV, D = 32, 8, 128


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("schemes", nargs="+")
    ap.add_argument("--tokens", type=int, default=65536)
    ap.add_argument("--calls", type=int, default=2)
    args = ap.parse_args()
    q = mx.random.normal((1, HQ, 1, D), key=mx.random.key(0)).astype(mx.float16)
    for scheme in args.schemes:
        cache = build_cache(scheme, HKV, D, mx.float16, args.tokens)
        for _ in range(args.calls):
            mx.eval(cache.attention(q, D ** -0.5))
        print(f"{scheme}: {args.calls} calls at {args.tokens} tokens", flush=True)


if __name__ == "__main__":
    main()
