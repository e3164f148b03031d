"""A layer's decode step prepared once and replayed (CUDA): the kernels, their inputs and launch
shapes are the same from one token to the next until the stored rows, a buffer or the query's
shape changes, so a step only swaps in its query and its sizes.

Measured on the H200 (issue 30): building the two kernel calls from scratch (`host.describe`,
`pass1_args`, `pass2_args`: variant lookups, per-side tables, the input dicts) cost about 45 us
of Python per layer and step against 2 us for mlx-lm's SDPA; a step of 8 layers of an 8B model
then waited on the host. The replay holds only what the key proves unchanged: the memo lives on
the cache that owns the buffers (`TurboQuantKVCache`), never in a module-level table, so no
buffer outlives its cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from turboquant.attention.kernels import host


@dataclass
class Step:
    """One layer's prepared decode step. `key` holds the values it was built for, `refs` the
    objects (compared by identity: the cache's buffers, sides, key means, tail, sinks)."""

    key: tuple
    refs: tuple
    sizes: tuple  # `host.pass1_sizes`: params before the tail rows and causal count
    tail_cap: int  # the most tail rows pass 2 takes (0: no tail)
    kernels: tuple  # (pass 1, pass 2) callables
    inputs: tuple  # (pass 1 inputs, pass 2 inputs) with placeholders for the per-step entries
    slots: tuple  # (pass-1 params, pass-1 query, pass-2 query or -1)
    launch: tuple  # (pass-1 keywords, pass-2 keywords) besides the inputs


def _key(queries, scale, rows, tail, tuning, causal) -> tuple:
    return (queries.shape, queries.dtype, scale, rows, tuning, causal,
            None if tail is None else (tail[0].shape, tail[0].dtype))


def _refs(key_side, value_side, arrays, shifts, tail, sinks) -> tuple:
    return (key_side, value_side, *arrays.values(), shifts, *(tail or (None, None)), sinks)


def replay(memo: dict, queries, key_side, value_side, arrays, scale, shifts, tail, rows, tail_rows, sinks,
           tuning, causal) -> tuple[mx.array, mx.array] | None:
    """(out, lse) through the step kept in `memo`, or None when it does not fit this call."""
    step = memo.get("decode")
    if step is None or step.key != _key(queries, scale, rows, tail, tuning, causal):
        return None
    refs = _refs(key_side, value_side, arrays, shifts, tail, sinks)
    if len(refs) != len(step.refs) or any(a is not b for a, b in zip(refs, step.refs)):
        return None
    n = 0 if tail is None else (tail[0].shape[2] if tail_rows is None else tail_rows)
    if tail is not None and not 0 < n <= min(step.tail_cap, tail[0].shape[2]):
        return None
    params = host.params_array(*step.sizes, n, causal if tail is not None else 0)
    in1, in2 = (list(x) for x in step.inputs)
    i_params, i_q, i_tq = step.slots
    in1[i_params], in1[i_q] = params, queries
    k1, k2 = step.kernels
    po, pm, pl = k1(inputs=in1, **step.launch[0])
    in2[0:4] = [params, po, pm, pl]
    if i_tq >= 0:
        in2[i_tq] = queries
    return tuple(k2(inputs=in2, **step.launch[1]))


def prepare(memo: dict, make_kernel, call: host.Call, queries, key_side, value_side, arrays, scale, shifts, tail,
            rows, tail_rows, sinks, tuning, causal) -> None:
    """Keep this call's step in `memo` when it can be replayed: pass 1 reads the raw query (no
    pass-0 kernel or query ops), and a tail, if any, is attended in pass 2."""
    if not call.pass1.q_dtype:
        return
    dtype = "" if queries.dtype == mx.float32 else host.DTYPE_NAMES.get(queries.dtype, "")  # as `host.launch`
    p2 = host.tail_pass2(call, queries, tail, tail_rows, dtype) if tail is not None else None
    if tail is not None and p2 is None:
        return
    if p2 is None and dtype:
        p2 = host.pass2_variant(call.D, call.pass2.rotate, "", "", dtype)
    if sinks is not None:
        p2 = host.with_sinks(p2 or call.pass2)
    p2 = p2 or call.pass2
    n = 0 if tail is None else (tail[0].shape[2] if tail_rows is None else tail_rows)
    args1 = host.pass1_args(make_kernel, call, queries, key_side, value_side, arrays, scale, shifts, None, n,
                            tuning, causal if tail is not None else 0)
    if args1 is None:
        return
    names1 = call.pass1.input_names()
    cq = host.query_scale(key_side, scale, call)
    po = pm = pl = args1["inputs"][0]  # placeholders: replaced every step
    args2 = host.pass2_args(call, value_side, args1["inputs"][0], po, pm, pl, p2, queries, cq, tail, sinks)
    names2 = p2.input_names()
    sizes = host.pass1_sizes(call, shifts, None, tuning)
    memo["decode"] = Step(
        key=_key(queries, scale, rows, tail, tuning, causal),
        refs=_refs(key_side, value_side, arrays, shifts, tail, sinks),
        sizes=sizes, tail_cap=p2.threads if tail is not None else 0,
        kernels=(_direct(make_kernel(call.pass1), [a.dtype for a in args1["inputs"]], args1["output_dtypes"]),
                 _direct(make_kernel(p2), [a.dtype for a in args2["inputs"][:1]] + list(args1["output_dtypes"])
                         + [a.dtype for a in args2["inputs"][4:]], args2["output_dtypes"])),
        inputs=(tuple(args1.pop("inputs")), tuple(args2.pop("inputs"))),
        slots=(names1.index("params"), names1.index("q_raw"), names2.index("tq") if "tq" in names2 else -1),
        launch=(args1, args2))


def _direct(kernel, input_dtypes: list, output_dtypes: list):
    """What a replay calls for `kernel`: MLX's kernel object itself where the factory's kernel can
    hand it out (`cuda.CachedKernel.bound`, the launch's dtypes checked once here), else the
    kernel (the tests' emulator). Pass 2's inputs 1-3 are pass 1's outputs."""
    bound = getattr(kernel, "bound", None)
    return kernel if bound is None else bound(input_dtypes, output_dtypes)
