"""What the length of an `mx.fast.cuda_kernel`'s source costs each call on the host (GPU only).

    python bench/kernel_source_cost.py --rounds 7

MLX 0.32.4 assembles a custom kernel's whole source on every call and names the kernel's module
by a hash of that source, so a long source may cost each launch time in proportion to its
length, compiled or not. This times one tiny kernel (one input, a one-line body) whose header
carries comment lines of several lengths, and the same kernel whose long header lies in a file
that a one-line header `#include`s by its absolute path (how `kernels.cuda` hands MLX its
kernels, `kernels/included.py`). Columns as `kernel_call_cost.py`'s: built (the call, nothing
evaluated) and launched (`mx.async_eval` of 64 built calls, per call), median host us over
`--rounds`; each kernel's output is checked once.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import markdown_table, stamp  # noqa: E402
from kernel_call_cost import LAUNCHED, launch_cost, per_call  # noqa: E402

BODY = "unsigned int i = threadIdx.x; out[i] = a[i] + 1.0f;"
PADDED_KB = (0, 9, 27, 54)


def padding(kb: int) -> str:
    """`kb` KB of comment lines (what a long source's length costs, without its compile)."""
    line = "// " + "x" * 76 + "\n"
    return line * (kb * 1024 // len(line))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args(argv)
    import mlx.core as mx

    if mx.default_device().type != mx.DeviceType.gpu or not mx.cuda.is_available():
        sys.exit("kernel_source_cost needs MLX's CUDA backend")
    with tempfile.TemporaryDirectory(prefix="tq-source-cost-") as folder:
        rows = measure(Path(folder), args)
    print(f"One-input cuda_kernel, {mx.default_device()}, median host us per call over {args.rounds} rounds "
          f"({args.calls} builds; {LAUNCHED} launches)\n")
    print(markdown_table(["kernel", "header + body bytes", "built, us", "launched, us"], rows))
    print(f"\n{stamp(sys.argv if argv is None else ['bench/kernel_source_cost.py', *argv])}")
    return 0


def measure(folder: Path, args: argparse.Namespace) -> list[list[str]]:
    """One row per kernel: its label, source bytes and host us built and launched (the included
    headers are written into `folder`, which must outlive the kernels' first launches)."""
    import mlx.core as mx

    a = mx.arange(256, dtype=mx.float32)
    kernels = {}
    for kb in PADDED_KB:
        kernels[f"header of {kb} KB"] = (padding(kb), f"tq_source_cost_{kb}")
    for kb in PADDED_KB[1:]:
        path = folder / f"padding_{kb}.cuh"
        path.write_text(padding(kb))
        kernels[f"{kb} KB header through #include"] = (f'#include "{path}"\n', f"tq_source_cost_inc_{kb}")

    rows = []
    for label, (header, name) in kernels.items():
        kernel = mx.fast.cuda_kernel(name=name, input_names=["a"], output_names=["out"], source=BODY, header=header)

        def call(kernel=kernel):
            return kernel(inputs=[a], grid=(256, 1, 1), threadgroup=(256, 1, 1), output_shapes=[(256,)],
                          output_dtypes=[mx.float32])[0]

        if not mx.array_equal(call(), a + 1).item():
            sys.exit(f"{label}: wrong output")
        source = len(header) + len(BODY)
        rows.append([label, f"{source:,}", f"{per_call(call, args.calls, args.rounds):.1f}",
                     f"{launch_cost(call, LAUNCHED, args.rounds):.1f}"])
    return rows


if __name__ == "__main__":
    raise SystemExit(main())
