"""Fused attention over compressed K/V on MLX's GPU backends: decode steps, and questions and
prefill chunks through the same kernels (`fused_prefill`).

`fused_decode(queries, key_side, value_side, arrays, scale, shifts, tail, sinks=...)` is what
`turboquant.attention.compressed.compressed_attention` calls for one query token (L == 1) without an array
mask. It returns `(out, lse)`:

- `out` [B, Hq, 1, D] in the queries' dtype: softmax(q K^T * scale) V over the stored rows and
  the raw `tail` (native K, V [B, H, n, D], the newest rows that do not fill a block yet),
  normalised, in the original basis (the inverse value rotation is applied; on CUDA pass 2
  writes it in that dtype, so no conversion op follows);
- `lse` [B, Hq, 1] float32: the natural-log log-sum-exp of those rows' scaled scores.

`sinks` [Hq] (attention sinks, gpt-oss; any float dtype, natural-log units like the scaled
scores): one logit per query head that joins the softmax normaliser and adds nothing to the
numerator, out_h = sum_j e^(s_j - m) v_j / (e^(sink_h - m) + sum_j e^(s_j - m)), and `lse`
includes it. Pass 2 takes it as one more block (`merge.py`); pass 1 is the same with or without
sinks, and sinks=None runs exactly the kernels it ran before.

It returns None, and the caller uses the plain-ops path, when no kernel applies: the CPU (or
any device other than the GPU), a GPU backend other than CUDA and Metal, L != 1, an unsupported
layout or shape (native values, head dims that are not a multiple of 8 in [8, 256], key and
value head dims that differ, more than 1024 * 4096 tokens, sinks of another shape than [Hq]),
`TQSTORE_KERNELS=0`, or a Metal kernel that failed its self-check.

`tuning` (`KernelTuning`, a frozen value: lane shapes, threadgroup target, the tensor-core pass 1
and its thresholds) says how kernels are picked and launched; None is `KernelTuning.from_env()`,
the defaults (`DEFAULT_TUNING`) with the TQSTORE_KERNEL_* variables applied.

Kernels per call: pass 1 over blocks of stored rows (transforming the query itself for
Hadamard rotations and plain scales; other rotations add a pass-0 kernel), pass 2 merging the
blocks, un-rotating the values and, on CUDA, attending over the raw tail (Metal merges the tail
with plain ops, `merge_tail`); `query.py`, `template.py` and `merge.py` explain them. The kernels read the cache's
buffers, the query and the tail through their strides, so on CUDA a decode step's attention is
two graph nodes. On CUDA, fp16/bf16
activations run pass 1 on the tensor cores at every length where it applies (`mma.py`: fp16
products, float32 sums; TurboQuant or affine keys, TurboQuant values), so the kernels a layer
needs do not depend on the context length; otherwise scores, softmax and sums are float32 FMAs (no
TF32) and affine rows are dequantized unrounded (scale * code + bias in float32, as
mx.quantized_matmul does), which is more exact than the plain path's mx.dequantize into the
scale dtype.

Builds: one module per variant and process (MLX keeps it in memory); on CUDA its first launch
also writes the compiled module to MLX's cache folder (`cubin_cache.py`), so a later process
loads it instead of compiling.

Backends: CUDA (`cuda.py`, proven on an H200) when the default device is the GPU and
`mx.cuda.is_available()`; Metal (`metal.py`) when `mx.metal.is_available()`; both from one
template per pass (`query.py`, `template.py`, `merge.py`, over the macros of `dialects.py`).
Layouts: rawk-turbo (native K in f16/bf16/f32, TurboQuant V), affinek-turbo (affine K,
TurboQuant V), turbo and calibrated (TurboQuant K and V, per-block key means), affine (affine K
and V, 4 or 8 bits); TurboQuant bits 1-5 (the tensor-core pass 1: keys 1-5, values 1-4) with
row norms in float32, float16 (turbo5vN, autoB) or bfloat16, so every per-layer key layout an
autoB allocation chooses has a kernel; any GQA ratio (8 query rows share one read of their KV
head; on the tensor cores, with more than 8 rows and d <= 128, 16 rows in two tiles; larger
ratios and a question's R * L rows read it once per 8 or 16 rows).

The tests' emulator (tests/kernel_support/emulate.py) runs the very same kernel text on the CPU
(one OS thread per GPU thread), which is how the CPU tests check the kernels' logic;
`reference.py` builds caches and the float64 attention for the benchmark and the tests.
"""

from __future__ import annotations

import functools

import mlx.core as mx

from turboquant.attention.kernels import cuda, host, ragged, steps
from turboquant.attention.kernels.host import DEFAULT_TUNING, KernelTuning, merge_tail
from turboquant.environment import setting

__all__ = ["DEFAULT_TUNING", "KernelTuning", "fused_decode", "fused_prefill", "merge_tail", "ragged_decode",
           "select_backend"]


def select_backend() -> str | None:
    """"cuda", "metal" or None (plain ops) for the current default device."""
    if setting("TQSTORE_KERNELS", "1") == "0":
        return None
    return _backend(mx.default_device().type)


@functools.lru_cache(maxsize=4)
def _backend(device_type: mx.DeviceType) -> str | None:
    # (once per device type: every attention call of every layer asks, twice a decode step)
    try:
        if device_type != mx.DeviceType.gpu:
            return None
        if mx.cuda.is_available():
            return "cuda"
        if mx.metal.is_available():
            return "metal"
    except (AttributeError, RuntimeError):
        return None
    return None


def fused_decode(queries: mx.array, key_side, value_side, arrays: dict[str, mx.array], scale: float,
                 shifts: mx.array | None = None, tail: tuple[mx.array, mx.array] | None = None,
                 rows: int | None = None, tail_rows: int | None = None,
                 sinks: mx.array | None = None, tuning: KernelTuning | None = None,
                 causal: int = 0, memo: dict | None = None) -> tuple[mx.array, mx.array] | None:
    """(out, lse) of the stored rows and the raw `tail` through the GPU kernels, or None (see the
    module docstring). `rows` / `tail_rows`: `arrays` / `tail` are token buffers of which only
    the first `rows` / `tail_rows` tokens count (the kernels read them in place, so a decode step
    adds no slicing ops to the graph); None: all of them. `sinks`: [Hq] attention-sink logits
    in the normaliser, or None. `tuning`: how kernels are picked and launched (None: the
    defaults with the environment's settings, `KernelTuning.from_env()`). `causal` (L > 1, what
    `fused_prefill` passes): the query rows are L tokens per query head ([B, Hq * L, 1, D]), the
    tail's last L rows, and token l sees the tail only up to its own row. `memo`: a dict the
    caller owns beside the buffers (a cache), where the step is prepared once and replayed while
    the buffers, the stored rows and the query's shape stay the same (`steps.py`; CUDA)."""
    backend = select_backend()
    if backend is None or not host.check_sinks(sinks, queries):
        return None
    tuning = host.resolve(tuning)
    if backend == "cuda":
        # (without a memo, the call is prepared from the process's template all the same)
        hit = steps.run({} if memo is None else memo, cuda.kernel, queries, key_side, value_side, arrays, scale,
                        shifts, tail, rows, tail_rows, sinks, tuning, causal)
        if hit is not None:
            return hit
    call = host.describe(queries, key_side, value_side, arrays, shifts, tensor_cores=backend == "cuda", rows=rows,
                         tuning=tuning)
    if call is None:
        return None
    if backend == "cuda":
        return host.launch(cuda.kernel, call, queries, key_side, value_side, arrays, scale, shifts, tail=tail,
                           tail_rows=tail_rows, out_dtype=queries.dtype, sinks=sinks, tuning=tuning,
                           causal=causal)
    from turboquant.attention.kernels import metal

    if rows is not None:  # the self-check's plain-ops reference needs exact views
        arrays = {n: a[:, :, :rows] for n, a in arrays.items()}
    if tail is not None and tail_rows is not None:
        tail = (tail[0][:, :, :tail_rows], tail[1][:, :, :tail_rows])
    stored = metal.verdict(call, lambda: host.launch(metal.kernel, call, queries, key_side, value_side, arrays,
                                                     scale, shifts, sinks=sinks, tuning=tuning),
                           lambda: host.plain_decode(queries, key_side, value_side, arrays, scale, shifts, sinks),
                           sinks=sinks is not None)
    if stored is None:
        return None
    # (the stored rows' lse includes the sink, so merging the tail keeps it in the normaliser)
    out, lse = host.merge_tail_rows(queries, *stored, tail, scale, causal)
    return out.astype(queries.dtype), lse


# Query rows per KV head that `fused_prefill` takes: the kernels read the stored K/V once per 8
# rows (16 on the tensor cores at d <= 128), so a chunk's cost grows with R * L where decoding the
# rows once does not. Measured at 60 rows (R = 4, a 15-token question: 8 reads, 3.8x faster than
# decoding at 64k on the H200); the cap keeps it within 2x of that. Longer chunks decode the rows
# (turboquant/attention/prefill.py).
MAX_PREFILL_ROWS = 128


def fused_prefill(queries: mx.array, key_side, value_side, arrays: dict[str, mx.array], scale: float,
                  mask, shifts: mx.array | None, tail: tuple[mx.array, mx.array] | None,
                  rows: int | None = None, tail_rows: int | None = None,
                  tuning: KernelTuning | None = None, memo: dict | None = None) -> mx.array | None:
    """Attention of L > 1 queries [B, Hq, L, D] (a question or a prefill chunk) over the stored
    rows and the raw tail through the decode kernels, or None (the caller decodes the rows,
    turboquant/attention/prefill.py): the out in the queries' dtype.

    Every stored row precedes every query (they are the tail's last L rows), so no mask applies
    to them: the L tokens of each query head go to the kernels as L more query rows of its KV
    head ([B, Hq * L, 1, D], a GQA ratio of R * L; the kernels read K/V once per 8 rows), and the
    raw tail joins under the causal mask: in pass 2 on CUDA (up to 256 tail rows), else with
    plain ops (`host.merge_tail_rows`). None when `mask` is an
    array or another string, when the tail holds fewer than L rows (some queries are stored:
    they would need a mask inside the stored rows), beyond `MAX_PREFILL_ROWS` query rows per KV
    head (a long chunk: decoding the rows once costs less), when no kernel applies (the CPU), or with
    `TQSTORE_KERNEL_PREFILL=0` (benchmarks: the decoded rows against the kernels). `memo`: as
    `fused_decode`'s (the decode step after a question takes the inputs the question filled in)."""
    B, Hq, L, D = queries.shape
    if not (mask is None or mask == "causal") or setting("TQSTORE_KERNEL_PREFILL", "1") == "0":
        return None
    H = next(iter(arrays.values())).shape[1]
    if H == 0 or Hq % H or Hq // H * L > MAX_PREFILL_ROWS:
        return None
    n = 0 if tail is None else (tail[0].shape[2] if tail_rows is None else tail_rows)
    if mask == "causal" and n < L:
        return None
    # (one query row per token; on CUDA pass 2 attends over the tail, causal per row)
    rows_q = queries.reshape(B, Hq * L, 1, D)
    stored = fused_decode(rows_q, key_side, value_side, arrays, scale, shifts, tail if n else None, rows, n,
                          tuning=tuning, causal=L if mask == "causal" else 0, memo=memo)
    if stored is None:
        return None
    return stored[0].reshape(B, Hq, L, D).astype(queries.dtype)


def ragged_decode(queries: mx.array, keys: mx.array, values: mx.array, lengths: mx.array,
                  scale: float) -> mx.array | None:
    """Each row's one-token attention over its first `lengths[b]` keys in one CUDA launch
    (ragged.py says why and what), or None where no kernel applies: not on CUDA, or shapes
    `ragged.variant` refuses."""
    if select_backend() != "cuda":
        return None
    v = ragged.variant(queries, keys, values, scale)
    if v is None:
        return None
    made = cuda.kernel(v)
    bound = getattr(made, "bound", None)  # (the tests' CPU emulator hands out no kernel object)
    dtype = queries.dtype
    run = made if bound is None else bound([dtype, dtype, dtype, mx.int32], [dtype])
    lengths = lengths if lengths.dtype == mx.int32 else lengths.astype(mx.int32)
    B, Hq, _, D = queries.shape
    return run(inputs=[queries, keys, values, lengths], grid=(B * v.H * v.threads, 1, 1),
               threadgroup=(v.threads, 1, 1), output_shapes=[(B, Hq, 1, D)], output_dtypes=[dtype])[0]
