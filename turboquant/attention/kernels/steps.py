"""A layer's attention call prepared once and replayed (CUDA): the kernels, their inputs and launch
shapes are the same from one token to the next until the stored rows, a buffer or the query's
shape changes, so a decode step only swaps in its query and its sizes.

Two levels, because a call's cost has two parts:

- `Template`, kept per process (`TEMPLATES`) under a key of values only (shapes, dtypes, the
  sides' layouts, sizes, tuning): which kernels run and how they are launched, what
  `host.describe`, `host.pass1_sizes` and the variant lookups work out. Every restore makes new
  caches and sides, so a question after a restore, and its first decode step, found nothing
  prepared and built both calls from scratch: about 70 us of host time per layer and call more
  than a raw layer's on this CPU (8 layers, stubbed kernels), where the H100 measured the 4k
  first token 1.26-1.32x raw's with the same device time (docs/benchmarks.md). A template holds
  no arrays, so it keeps nothing of a cache alive.
- `Step`, kept in a dict the cache owns beside its buffers (`memo`): a template with this
  cache's arrays filled in (buffers, per-side tables), checked by identity, so a decode step
  costs a lookup, two array swaps and two launches. Measured on the H200 (issue 30): building
  the two kernel calls from scratch cost about 45 us of Python per layer and step against 2 us
  for mlx-lm's SDPA.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import mlx.core as mx

from turboquant.attention.kernels import host
from turboquant.memo import keep, same

# Templates kept per process: a model's layers share one per call shape (their layouts agree),
# so this bounds the shapes, not the layers (question and decode, for several stored lengths,
# schemes and models at once), dropped oldest first.
TEMPLATES_KEPT = 256
TEMPLATES: dict[tuple, Template | None] = {}
_UNSEEN = object()


@dataclass(frozen=True)
class Template:
    """What a call of one shape launches: the kernels bound to their dtypes, the input names of
    each pass, the launch keywords besides the inputs, and the sizes `params` carries."""

    sizes: tuple  # `host.pass1_sizes`: params before the tail rows and causal count
    tail_cap: int  # the most tail rows pass 2 takes (0: no tail)
    kernels: tuple  # (pass 1, pass 2) callables
    p1: object  # the pass-1 variant (`host.pass1_inputs` reads its layout)
    p2: object  # the pass-2 variant (`host.pass2_inputs`)
    names: tuple  # (pass-1 input names, pass-2 input names)
    picks: tuple  # (pass-1, pass-2) `operator.itemgetter`s of those names: the inputs in order
    slots: tuple  # (pass-1 params, pass-1 query, pass-2 query or -1): what a step swaps in
    launch: tuple  # (pass-1 keywords, pass-2 keywords) besides the inputs
    H: int
    D: int


@dataclass
class Step:
    """One layer's prepared call: `template` with the inputs of the objects in `refs` (compared
    by identity: the cache's buffers, sides, key means, tail, sinks) in place, placeholders for
    the per-step entries at the template's `slots`."""

    key: tuple
    refs: tuple
    template: Template
    named: tuple  # (pass-1 inputs by name, pass-2 inputs by name), as filled
    inputs: tuple  # (pass 1 inputs, pass 2 inputs)


def _key(queries, scale, rows, tail, tuning, causal) -> tuple:
    return (queries.shape, queries.dtype, scale, rows, tuning, causal,
            None if tail is None else (tail[0].shape, tail[0].dtype))


def _refs(key_side, value_side, arrays, shifts, tail, sinks) -> tuple:
    return (key_side, value_side, *arrays.values(), shifts, *(tail or (None, None)), sinks)


def _side_key(side) -> tuple:
    """What of a side decides the kernels: its storage (`host._side`), names, head dim, rotation."""
    codec = getattr(side, "codec", None)
    rotation = getattr(codec, "rotation", None)
    return (side.name, host._side(side), getattr(codec, "d", None), None if rotation is None else rotation.kind)


def _shape_key(key: tuple, key_side, value_side, arrays, shifts, tail, sinks) -> tuple:
    """The template's key: the step key and everything else `host.describe` and the launch read,
    as values."""
    return (key, _side_key(key_side), _side_key(value_side),
            tuple((n, a.shape, a.dtype) for n, a in arrays.items()),
            None if shifts is None else (shifts.shape, shifts.dtype),
            None if tail is None else (tail[1].shape, tail[1].dtype),
            None if sinks is None else (sinks.shape, sinks.dtype))


def run(memo: dict, make_kernel, queries, key_side, value_side, arrays, scale, shifts, tail, rows, tail_rows, sinks,
        tuning, causal) -> tuple[mx.array, mx.array] | None:
    """(out, lse) through the step kept in `memo`, made from the process's template for this
    call's shape when it does not fit (one is built the first time, `host.describe`); None when
    no prepared call applies (the caller launches from scratch, `host.launch`)."""
    key = _key(queries, scale, rows, tail, tuning, causal)
    refs = _refs(key_side, value_side, arrays, shifts, tail, sinks)
    step = memo.get("decode")
    if step is not None and step.key == key and same(refs, step.refs):
        # (None: the tail outgrew pass 2, which filling the template again would not change)
        return _launch(step, queries, tail, tail_rows, causal)
    shape = (make_kernel, *_shape_key(key, key_side, value_side, arrays, shifts, tail, sinks))
    template = TEMPLATES.get(shape, _UNSEEN)
    if template is _UNSEEN:
        template = _template(make_kernel, queries, key_side, value_side, arrays, scale, shifts, tail, rows,
                             tail_rows, sinks, tuning, causal)
        keep(TEMPLATES, shape, template, TEMPLATES_KEPT)
    if template is None:
        return None
    step = memo["decode"] = _fill(template, key, refs, queries, key_side, value_side, arrays, scale, shifts, tail,
                                  sinks, step)
    return _launch(step, queries, tail, tail_rows, causal)


def _launch(step: Step, queries, tail, tail_rows, causal) -> tuple[mx.array, mx.array] | None:
    """(out, lse) of `step` with this call's query and sizes swapped in, or None when the tail
    holds more rows than its pass 2 takes."""
    t = step.template
    n = 0 if tail is None else (tail[0].shape[2] if tail_rows is None else tail_rows)
    if tail is not None and not 0 < n <= min(t.tail_cap, tail[0].shape[2]):
        return None
    params = host.params_array(*t.sizes, n, causal if tail is not None else 0)
    in1, in2 = (list(x) for x in step.inputs)
    i_params, i_q, i_tq = t.slots
    in1[i_params], in1[i_q] = params, queries
    k1, k2 = t.kernels
    po, pm, pl = k1(inputs=in1, **t.launch[0])
    in2[0:4] = [params, po, pm, pl]
    if i_tq >= 0:
        in2[i_tq] = queries
    return tuple(k2(inputs=in2, **t.launch[1]))


def _template(make_kernel, queries, key_side, value_side, arrays, scale, shifts, tail, rows, tail_rows, sinks,
              tuning, causal) -> Template | None:
    """The template of this call's shape, or None when its call cannot be replayed: pass 1 must
    read the raw query (no pass-0 kernel or query ops), and a tail, if any, be attended in
    pass 2."""
    call = host.describe(queries, key_side, value_side, arrays, shifts, tensor_cores=True, rows=rows, tuning=tuning)
    if call is None or not call.pass1.q_dtype:
        return None
    dtype = "" if queries.dtype == mx.float32 else host.DTYPE_NAMES.get(queries.dtype, "")  # as `host.launch`
    p2 = host.tail_pass2(call, queries, tail, tail_rows, dtype) if tail is not None else None
    if tail is not None and p2 is None:
        return None
    if p2 is None and dtype:
        p2 = host.pass2_variant(call.D, call.pass2.rotate, "", "", dtype)
    if sinks is not None:
        p2 = host.with_sinks(p2 or call.pass2)
    p2 = p2 or call.pass2
    n = 0 if tail is None else (tail[0].shape[2] if tail_rows is None else tail_rows)
    args1 = host.pass1_args(make_kernel, call, queries, key_side, value_side, arrays, scale, shifts, None, n,
                            tuning, causal if tail is not None else 0)
    if args1 is None:
        return None
    cq = host.query_scale(key_side, scale, call)
    po = pm = pl = args1["inputs"][0]  # placeholders: pass 1's outputs at every launch
    args2 = host.pass2_args(call, value_side, args1["inputs"][0], po, pm, pl, p2, queries, cq, tail, sinks)
    in1, in2 = args1.pop("inputs"), args2.pop("inputs")
    names = (tuple(call.pass1.input_names()), tuple(p2.input_names()))
    return Template(
        sizes=host.pass1_sizes(call, shifts, None, tuning), tail_cap=p2.threads if tail is not None else 0,
        kernels=(_direct(make_kernel(call.pass1), [a.dtype for a in in1], args1["output_dtypes"]),
                 _direct(make_kernel(p2), [a.dtype for a in in2[:1]] + list(args1["output_dtypes"])
                         + [a.dtype for a in in2[4:]], args2["output_dtypes"])),
        p1=call.pass1, p2=p2, names=names, picks=tuple(operator.itemgetter(*n) for n in names),
        slots=(names[0].index("params"), names[0].index("q_raw"), names[1].index("tq") if "tq" in names[1] else -1),
        launch=(args1, args2), H=call.H, D=call.D)


def _fill(template: Template, key: tuple, refs: tuple, queries, key_side, value_side, arrays, scale, shifts, tail,
          sinks, before: Step | None) -> Step:
    """`template` with these objects' inputs in place (`host.pass1_inputs`, `host.pass2_inputs`),
    or with those of `before` where it was filled from the same objects (a question's step
    before the first decode step: only the query's shape changed)."""
    names1, names2 = template.names
    if (before is not None and same(refs, before.refs)
            and set(names1) <= before.named[0].keys() and set(names2) <= before.named[1].keys()):
        ins1, ins2 = before.named
    else:
        placeholder = host.params_array(*template.sizes, 0, 0)
        ins1 = host.pass1_inputs(template.p1, template.H, template.D, placeholder, queries, key_side, value_side,
                                 arrays, scale, shifts)
        ins2 = host.pass2_inputs(template.p2, value_side, placeholder, placeholder, placeholder, placeholder,
                                 queries, ins1["cq"], tail, sinks)
    pick1, pick2 = template.picks
    return Step(key=key, refs=refs, template=template, named=(ins1, ins2), inputs=(pick1(ins1), pick2(ins2)))


def _direct(kernel, input_dtypes: list, output_dtypes: list):
    """What a replay calls for `kernel`: MLX's kernel object itself where the factory's kernel can
    hand it out (`cuda.CachedKernel.bound`, the launch's dtypes checked once here), else the
    kernel (the tests' emulator). Pass 2's inputs 1-3 are pass 1's outputs."""
    bound = getattr(kernel, "bound", None)
    return kernel if bound is None else bound(input_dtypes, output_dtypes)
