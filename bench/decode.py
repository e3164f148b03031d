"""Decode-attention time per call: fp16 SDPA against the fused kernels over compressed caches.

B=1, 32 query heads, 8 KV heads, d=128, one query token, at each context length. For every
method, in one process and run: the time per call when each call's query is the previous
call's output ("chained": a decode step's latency, as a model's layers wait for each other), with
many independent calls evaluated together ("batched": throughput, calls may overlap on the GPU)
and with `mx.eval` after each call ("sync"), the bytes the call must read (K and V
as stored, scales, norms and key means included) and the achieved bandwidth (no share of a
copy ceiling: a fused call does far more work per byte than a copy, so that share says nothing).
Each method cycles over several layers' worth of caches so that the working set is far larger
than the L2 cache (as a model's layers are). Where the tensor-core pass 1 serves a scheme
(CUDA: fp16/bf16 activations, TurboQuant or affine keys), the CUDA-core pass 1 is timed on the same
caches too.

  python bench/decode.py                    # table to stdout
  python bench/decode.py --write-docs       # also into docs/benchmarks.md (decode-kernels section)
  python bench/decode.py --sweep            # lane-shape / unroll / threadgroup sweep first
  python bench/decode.py --breakdown        # also the GPU time of each pass alone
  python bench/decode.py --sinks            # also the entry point with attention sinks, side by side
  python bench/decode.py --model --runs 3    # instead: a model's decode tokens/s, raw against compressed
  python bench/decode.py --compare turbo4,turbo5v4,auto3.75:mixed --runs 3 --contexts 4096,16384,65536
                                            # schemes side by side, alternating, per-run ranges
  python bench/decode.py --tails 0,1,32,128,255 --runs 3 --contexts 4096,16384 --schemes turbo4
                                            # instead: the cache's call against its raw tail's length

`--model` (issue 30): tokens/s of one decode stream through mlx-lm's `generate_step` (what
`Engine.generate` runs) on N layers of Llama-3.1-8B's shapes with random bf16 weights, after
contexts of 16 tokens to 64k: every scheme's caches (`make_prompt_cache`) hold the same context of
random K/V rows, left as the Engine leaves a context before its first decode step
(`start_decoding`: compressed from a block of 256 rows up, raw below until a block is held), and
per run the schemes take turns on the same context; the caches are trimmed back after each run.

Needs an MLX GPU backend (CUDA or Metal).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests"))  # kernel_support: the synthetic caches and their float64 reference

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from turboquant.attention import kernels  # noqa: E402
from turboquant.attention.kernels import host  # noqa: E402
from turboquant.attention.kernels.mma import MmaPass1  # noqa: E402
from kernel_support.synthetic import attention64, build_cache, dequantized, stored  # noqa: E402

HQ, HKV, D = 32, 8, 128
SCALE = 1 / math.sqrt(D)
SCHEMES = ["turbo0v4", "turbo8v3", "turbo4", "turbo3", "affine8"]
CONTEXTS = [4096, 16384, 65536, 131072]
CHECK_UP_TO = 16384  # contexts whose fused output is also checked against float64 here
TENSOR_CORES = kernels.select_backend() == "cuda"  # what `fused_decode` does on this backend
WORKING_SET = 400 << 20  # fp16 bytes cycled over per context (many times the 50 MB L2)


@contextlib.contextmanager
def kernel_env(**values):
    """The TQSTORE_KERNEL_* variables set for a block (`KernelTuning.from_env` reads them at every
    call, so the cache's own attention path sees them), then as they were."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update({name: str(v) for name, v in values.items()})
    try:
        yield
    finally:
        for name, v in saved.items():
            if v is None:
                os.environ.pop(name)
            else:
                os.environ[name] = v


def device_line() -> str:
    name = "unknown GPU"
    try:
        name = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=20).stdout.strip() or name
    except (OSError, subprocess.SubprocessError):
        if kernels.select_backend() == "metal":
            name = platform.processor() or "Apple GPU"
    return f"{name}; MLX {mx.__version__} ({kernels.select_backend()} backend), Python {platform.python_version()}"


def timed(fns, calls: int, reps: int = 5) -> tuple[float, float, float]:
    """(gpu, host, sync) seconds per call; `fns` cycles over layers. gpu: `calls` calls built
    first, then evaluated together (the timed part); host: building them (Python and MLX graph);
    sync: build, `mx.eval` and wait for each call alone."""
    mx.eval([f() for f in fns])  # warm up: compile, allocate
    gpu, build = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        outs = [fns[i % len(fns)]() for i in range(calls)]
        t1 = time.perf_counter()
        mx.eval(outs)
        gpu.append((time.perf_counter() - t1) / calls)
        build.append((t1 - t0) / calls)
        del outs
    sync = []
    for i in range(calls * 2):
        t = time.perf_counter()
        mx.eval(fns[i % len(fns)]())
        sync.append(time.perf_counter() - t)
    return statistics.median(gpu), statistics.median(build), statistics.median(sync[calls // 2:])


def chained(fns, q: mx.array, calls: int, reps: int = 5) -> float:
    """Seconds per call when each call's query is the previous call's output (as a model's
    layers are): `calls` calls built, then evaluated together; no two calls can overlap on the
    GPU, so this is the latency of a decode step's attention, not the throughput of independent
    ones. `fns` take the query and cycle over layers."""
    x = q
    for f in fns:
        x = f(x)
    mx.eval(x)
    times = []
    for _ in range(reps):
        x = q
        for i in range(calls):
            x = fns[i % len(fns)](x)
        t = time.perf_counter()
        mx.eval(x)
        times.append((time.perf_counter() - t) / calls)
    return statistics.median(times)


def layers_for(T: int) -> int:
    return max(2, min(48, -(-WORKING_SET // (2 * 2 * T * HKV * D))))


def stored_bytes(cache) -> int:
    n = sum(a.nbytes for a in stored(cache).values())
    if cache._shifts is not None:
        n += cache._shifts.nbytes
    return n


def check(cache, q) -> float:
    """Relative error of the fused call against float64 (guards the numbers below)."""
    k64, v64 = dequantized(cache)
    ref, _ = attention64(q, k64, v64, SCALE)
    out = np.array(cache.attention(q, SCALE).astype(mx.float32)).astype(np.float64)
    return float(np.abs(out - ref).max() / np.abs(ref).max())


def sink_rows(T: int, scheme: str, caches, q: mx.array, calls: int, base: dict, nbytes: int) -> list[dict]:
    """`fused_decode` on the stored rows without and with attention sinks (one logit per query
    head, as gpt-oss), timed side by side on the same caches."""
    sinks = mx.random.normal((HQ,), key=mx.random.key(5))
    views = [(c, stored(c)) for c in caches]
    mx.eval(sinks, [a for _, v in views for a in v.values()])
    rows = []
    for label, sk in (("", None), (" + sinks", sinks)):
        steps = [lambda x, c=c, v=v, sk=sk: kernels.fused_decode(x, c._key_side, c._value_side, v, SCALE, c._shifts,
                                                                  sinks=sk)[0] for c, v in views]
        rows.append(dict(T=T, method=f"{scheme} fused_decode{label}", bytes=nbytes, err=None,
                         **measure(steps, q, calls, base)))
    return rows


def bench_context(T: int, schemes: list[str], calls: int, plain: bool, tail: int,
                  sinks: bool = False) -> list[dict]:
    nl = layers_for(T)
    rows = []
    q = mx.random.normal((1, HQ, 1, D), key=mx.random.key(T)).astype(mx.float16)
    ks = [mx.random.normal((1, HKV, T, D), key=mx.random.key(i)).astype(mx.float16) for i in range(nl)]
    vs = [mx.random.normal((1, HKV, T, D), key=mx.random.key(100 + i)).astype(mx.float16) for i in range(nl)]
    mx.eval(ks, vs)
    steps = [lambda x, k=k, v=v: mx.fast.scaled_dot_product_attention(x, k, v, scale=SCALE) for k, v in zip(ks, vs)]
    fp16_bytes = 2 * T * HKV * D * 2
    rows.append(dict(T=T, method="fp16 SDPA", bytes=fp16_bytes, err=None, **measure(steps, q, calls)))
    del ks, vs, steps
    base = rows[0]
    for scheme in schemes:
        caches = [build_cache(scheme, HKV, D, mx.float16, T, seed=i) for i in range(nl)]
        err = check(caches[0], q) if T <= CHECK_UP_TO else None
        call = host.describe(q, caches[0]._key_side, caches[0]._value_side, stored(caches[0]), caches[0]._shifts,
                             tensor_cores=TENSOR_CORES)
        mma = isinstance(call.pass1, MmaPass1)
        steps = [lambda x, c=c: c.attention(x, SCALE) for c in caches]
        nbytes = stored_bytes(caches[0])
        rows.append(dict(T=T, method=f"{scheme} fused" + (" (tensor cores)" if mma else ""), bytes=nbytes, err=err,
                         kernel=call.pass1.name, **measure(steps, q, calls, base)))
        if mma:  # the CUDA-core pass 1 on the same caches, for comparison
            with kernel_env(TQSTORE_KERNEL_MMA=0):
                cerr = check(caches[0], q) if T <= CHECK_UP_TO else None
                rows.append(dict(T=T, method=f"{scheme} fused (CUDA cores)", bytes=nbytes, err=cerr,
                                 **measure(steps, q, calls, base)))
        if sinks:
            rows += sink_rows(T, scheme, caches, q, calls, base, nbytes)
        if plain:
            os.environ["TQSTORE_KERNELS"] = "0"
            try:
                rows.append(dict(T=T, method=f"{scheme} plain ops", bytes=nbytes, err=None,
                                 **measure(steps[:2], q, max(4, calls // 16), base, reps=3)))
            finally:
                os.environ.pop("TQSTORE_KERNELS")
        if tail:
            kt = mx.random.normal((1, HKV, tail, D), key=mx.random.key(7)).astype(mx.float16)
            for c in caches:
                c.update_and_fetch(kt, kt)
            mx.eval([c.state for c in caches])
            rows.append(dict(T=T, method=f"{scheme} fused + {tail}-row tail", bytes=nbytes + 2 * tail * HKV * D * 2,
                             err=None, **measure(steps, q, calls, base)))
        del caches, steps
        mx.clear_cache()
    for r in rows:
        r["gbs"] = r["bytes"] / r["batched"] / 1e9
    return rows


def tail_sweep(contexts: list[int], schemes: list[str], tails: list[int], runs: int, calls: int) -> list[dict]:
    """Chained seconds per call of fp16 SDPA over T rows and of each scheme's cache call with
    n raw tail rows after T stored rows, per (T, scheme, n) and run."""
    rows = []
    for T in contexts:
        nl = layers_for(T)
        q = mx.random.normal((1, HQ, 1, D), key=mx.random.key(T)).astype(mx.float16)
        ks = [mx.random.normal((1, HKV, T, D), key=mx.random.key(i)).astype(mx.float16) for i in range(nl)]
        mx.eval(ks)
        sdpa = [lambda x, k=k: mx.fast.scaled_dot_product_attention(x, k, k, scale=SCALE) for k in ks]
        for scheme in schemes:
            caches = {n: [build_cache(scheme, HKV, D, mx.float16, T, seed=i, tail=n) for i in range(nl)] for n in tails}
            mx.eval([c.state for cs in caches.values() for c in cs])
            got: dict = {"sdpa": []} | {n: [] for n in tails}
            for _ in range(runs):
                got["sdpa"].append(chained(sdpa, q, calls))
                for n, cs in caches.items():
                    got[n].append(chained([lambda x, c=c: c.attention(x, SCALE) for c in cs], q, calls))
            rows.append(dict(T=T, scheme=scheme, got=got))
            del caches
            mx.clear_cache()
        del ks, sdpa
    return rows


def tail_table(rows: list[dict], tails: list[int]) -> str:
    from storage import span as ranged

    def span(xs: list[float]) -> str:
        return ranged([x * 1e6 for x in xs], "{:.1f}")

    lines = ["| context | scheme | fp16 SDPA | " + " | ".join(f"{n}-row tail" for n in tails) + " |",
             "|---|---|---|" + "---|" * len(tails)]
    for r in rows:
        lines.append(f"| {ctx(r['T'])} | {r['scheme']} | {span(r['got']['sdpa'])} | "
                     + " | ".join(span(r["got"][n]) for n in tails) + " |")
    return "\n".join(lines)


def measure(steps, q: mx.array, calls: int, base: dict | None = None, reps: int = 5) -> dict:
    """Every timing of one method: batched, host, sync (`timed`, independent calls) and chained
    (each call's query the previous output), with the speeds against `base` (fp16 SDPA)."""
    b, h, s = timed([lambda f=f: f(q) for f in steps], calls, reps)
    c = chained(steps, q, calls, reps)
    out = dict(batched=b, host=h, sync=s, chained=c)
    if base is not None:
        out.update(vs_fp16=base["batched"] / b, vs_fp16_chained=base["chained"] / c)
    return out


SWEEP_CONTEXTS = (4096, 131072)
CANDIDATES = [(ns, u, tgs) for ns, u in ((1, 2), (1, 4), (2, 2), (1, 8)) for tgs in (512, 1024, 2048, 4096)]


def breakdown(scheme: str, T: int, calls: int) -> str:
    """GPU time per call of the parts: whole attention, q prep + both passes, pass 1, pass 2."""
    from turboquant.attention.kernels import cuda, metal

    make = cuda.kernel if kernels.select_backend() == "cuda" else metal.kernel
    nl = layers_for(T)
    q = mx.random.normal((1, HQ, 1, D), key=mx.random.key(1)).astype(mx.float16)
    caches = [build_cache(scheme, HKV, D, mx.float16, T, seed=i) for i in range(nl)]
    parts = []
    for c in caches:
        arrays = stored(c)
        call = host.describe(q, c._key_side, c._value_side, arrays, c._shifts, tensor_cores=TENSOR_CORES)
        a1 = host.pass1_args(make, call, q, c._key_side, c._value_side, arrays, SCALE, c._shifts)
        po, pm, pl = make(call.pass1)(**a1)
        a2 = host.pass2_args(call, c._value_side, a1["inputs"][0], po, pm, pl)
        mx.eval(po, pm, pl, *a1["inputs"])
        parts.append((c, call, arrays, a1, a2))
    res = {}
    res["attention"] = timed([lambda c=c: c.attention(q, SCALE) for c, *_ in parts], calls, 3)[0]
    res["q prep + passes"] = timed([lambda p=p: host.launch(make, p[1], q, p[0]._key_side, p[0]._value_side, p[2],
                                                            SCALE, p[0]._shifts)[0] for p in parts], calls, 3)[0]
    res["pass 1"] = timed([lambda p=p: make(p[1].pass1)(**p[3])[0] for p in parts], calls, 3)[0]
    res["pass 2"] = timed([lambda p=p: make(p[1].pass2)(**p[4])[0] for p in parts], calls, 3)[0]
    return ", ".join(f"{k} {v * 1e6:.1f} us" for k, v in res.items())


def sweep(calls: int) -> tuple[int, int, int]:
    """Lane shape (ns), unroll and threadgroup target for the benchmark shape (R = 4): GPU us per
    call; returns the configuration with the smallest sum of times relative to each case's best."""
    print("sweep (GPU us per call, batched):", flush=True)
    scores = {c: 0.0 for c in CANDIDATES}
    for T in SWEEP_CONTEXTS:
        nl = layers_for(T)
        q = mx.random.normal((1, HQ, 1, D), key=mx.random.key(1)).astype(mx.float16)
        for scheme in ("turbo4", "turbo8v3"):
            caches = [build_cache(scheme, HKV, D, mx.float16, T, seed=i) for i in range(nl)]
            fns = [lambda c=c: c.attention(q, SCALE) for c in caches]
            got = {}
            for ns, u, tgs in CANDIDATES:
                with kernel_env(TQSTORE_KERNEL_NS=ns, TQSTORE_KERNEL_UNROLL=u, TQSTORE_KERNEL_THREADGROUPS=tgs):
                    got[(ns, u, tgs)] = timed(fns, calls, reps=3)[0]
            best = min(got.values())
            for k, v in got.items():
                scores[k] += v / best
            print(f"  T={T} {scheme}: " + " ".join(f"ns{k[0]}u{k[1]}t{k[2]}={v * 1e6:.1f}" for k, v in got.items()),
                  flush=True)
            del caches, fns
            mx.clear_cache()
    win = min(scores, key=scores.get)
    print(f"  chosen: ns={win[0]} unroll={win[1]} threadgroups={win[2]} (score {scores[win]:.2f}; "
          f"default {scores.get((0, 0, 0), float('nan'))})", flush=True)
    return win


def ctx(T: int) -> str:
    return f"{T // 1024}k" if T % 1024 == 0 else str(T)


def table(rows: list[dict]) -> str:
    lines = ["| context | method | GPU us/call (chained) | GPU us/call (batched) | host us/call (graph build) "
             "| sync us/call | MB read/call | GB/s (batched) | speed vs fp16 SDPA (chained) "
             "| speed vs fp16 SDPA (batched) | max rel err vs f64 |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        sdpa = r["method"] == "fp16 SDPA"
        vs = "1.00x" if sdpa else f"{r['vs_fp16']:.2f}x"
        vsc = "1.00x" if sdpa else f"{r['vs_fp16_chained']:.2f}x"
        err = "" if r["err"] is None else f"{r['err']:.1e}"
        lines.append(f"| {ctx(r['T'])} | {r['method']} | {r['chained'] * 1e6:.1f} | {r['batched'] * 1e6:.1f} | "
                     f"{r['host'] * 1e6:.1f} | {r['sync'] * 1e6:.1f} | "
                     f"{r['bytes'] / 1e6:.1f} | {r['gbs']:.0f} | {vsc} | {vs} | {err} |")
    return "\n".join(lines)


def mixed_caches(scheme: str, T: int, n: int) -> list:
    """`n` layers' caches of an autoB scheme whose layers cycle through every key layout its
    allocation can give a layer (base, wider TurboQuant keys, 8-bit affine keys): what a model's
    mixed allocation decodes."""
    from turboquant.codec.plan import plan_layer
    from turboquant.codec.schemes import parse_scheme

    options = plan_layer(parse_scheme(scheme), HKV, D, D, mx.float16).key_options()
    return [build_cache(scheme, HKV, D, mx.float16, T, seed=i, keys=options[i % len(options)]) for i in range(n)]


def compare(contexts: list[int], schemes: list[str], runs: int, calls: int) -> list[dict]:
    """Chained GPU us per decode call of each scheme's fused path and fp16 SDPA, side by side on
    caches built once per context: `runs` runs, the methods taking turns in each. A scheme
    "autoB:mixed" cycles its layers through every key layout the allocation can choose."""
    rows = []
    for T in contexts:
        nl = max(4, layers_for(T))
        q = mx.random.normal((1, HQ, 1, D), key=mx.random.key(T)).astype(mx.float16)
        ks = [mx.random.normal((1, HKV, T, D), key=mx.random.key(i)).astype(mx.float16) for i in range(nl)]
        vs = [mx.random.normal((1, HKV, T, D), key=mx.random.key(100 + i)).astype(mx.float16) for i in range(nl)]
        mx.eval(ks, vs)
        methods = {"fp16 SDPA": ([lambda x, k=k, v=v: mx.fast.scaled_dot_product_attention(x, k, v, scale=SCALE)
                                  for k, v in zip(ks, vs)], None, 2 * T * HKV * D * 2)}
        for scheme in schemes:
            name, _, mode = scheme.partition(":")
            caches = (mixed_caches(name, T, nl) if mode == "mixed"
                      else [build_cache(name, HKV, D, mx.float16, T, seed=i) for i in range(nl)])
            kernels_used = sorted({host.describe(q, c._key_side, c._value_side, stored(c), c._shifts,
                                                 tensor_cores=TENSOR_CORES).pass1.name for c in caches})
            err = max(check(c, q) for c in caches[:4]) if T <= CHECK_UP_TO else None
            methods[scheme] = ([lambda x, c=c: c.attention(x, SCALE) for c in caches], (err, kernels_used),
                               sum(stored_bytes(c) for c in caches) // nl)
        got = {m: [] for m in methods}
        for _ in range(runs):
            for m, (steps, _, _) in methods.items():
                got[m].append(chained(steps, q, calls))
        for m, (_, info, nbytes) in methods.items():
            rows.append(dict(T=T, method=m, us=[t * 1e6 for t in got[m]], sdpa=[t * 1e6 for t in got["fp16 SDPA"]],
                             first=[t * 1e6 for t in got[schemes[0]]],
                             bytes=nbytes, err=None if info is None else info[0],
                             kernels=[] if info is None else info[1]))
        print(compare_table(rows[-len(methods):], schemes[0]), flush=True)
        del ks, vs, methods
        mx.clear_cache()
    return rows


def _ratio(a: list[float], b: list[float]) -> str:
    xs = [x / y for x, y in zip(a, b)]
    return f"{statistics.median(xs):.2f}x ({min(xs):.2f}-{max(xs):.2f})"


def compare_table(rows: list[dict], first: str) -> str:
    lines = [f"| context | method | chained GPU us/call, per run | median | time vs {first}, per run | "
             "time vs fp16 SDPA | MB read/call | max rel err vs f64 | pass 1 |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        err = "" if r["err"] is None else f"{r['err']:.1e}"
        vs_first = "" if r["method"] in ("fp16 SDPA", first) else _ratio(r["us"], r["first"])
        vs_sdpa = "" if r["method"] == "fp16 SDPA" else _ratio(r["us"], r["sdpa"])
        lines.append(f"| {ctx(r['T'])} | {r['method']} | {', '.join(f'{v:.1f}' for v in r['us'])} | "
                     f"{statistics.median(r['us']):.1f} | {vs_first} | {vs_sdpa} | {r['bytes'] / 1e6:.1f} | {err} | "
                     f"{', '.join(r['kernels'])} |")
    return "\n".join(lines)


MODEL_CONTEXTS = [16, 300, 1024, 4096, 16384, 65536]
MODEL_SCHEMES = ["raw", "turbo4", "turbo8v3"]


def model_decode(contexts: list[int], schemes: list[str], runs: int, tokens: int, layers: int) -> list[dict]:
    """Decode tokens/s per (context, scheme, run): `tokens` tokens through `generate_step` after
    the context, timed from the first token to the last (the first, which pays the prompt's last
    token and any first-use build, is left out)."""
    from mlx_lm.generate import generate_step
    from mlx_lm.models import llama
    from question_prefill import fill_caches, llama_config

    mx.random.seed(0)
    model = llama.Model(llama.ModelArgs.from_dict(llama_config(layers)))
    model.set_dtype(mx.bfloat16)
    mx.eval(model.parameters())
    rows = []
    for T in contexts:
        caches = {s: fill_caches(model, s, T, seed=T) for s in schemes}
        prompt = mx.array([7], dtype=mx.uint32)

        def one(scheme: str) -> float:
            times = []
            for _ in generate_step(prompt, model, prompt_cache=caches[scheme], max_tokens=tokens):
                times.append(time.perf_counter())
            for c in caches[scheme]:
                c.trim(tokens)
            return (len(times) - 1) / (times[-1] - times[0])

        def split(scheme: str, steps: int = 16) -> tuple[float, float]:
            """(host ms to build a step's graph, ms to evaluate it and wait), medians over
            `steps` steps run one at a time (no overlap of host and GPU, unlike generate_step)."""
            build, run = [], []
            y = prompt[None]
            for _ in range(steps):
                t0 = time.perf_counter()
                logits = model(y, cache=caches[scheme])
                t1 = time.perf_counter()
                mx.eval(logits)
                run.append(time.perf_counter() - t1)
                build.append(t1 - t0)
            for c in caches[scheme]:
                c.trim(steps)
            return statistics.median(build) * 1e3, statistics.median(run) * 1e3

        for scheme in schemes:  # warm up: first-use builds, allocations
            one(scheme)
        got = {s: [] for s in schemes}
        for _ in range(runs):
            for scheme in schemes:
                got[scheme].append(one(scheme))
        parts = {s: split(s) for s in schemes}
        for scheme in schemes:
            rows.append(dict(T=T, scheme=scheme, tps=got[scheme], raw=got.get("raw"), split=parts[scheme]))
        print(model_table(rows[-len(schemes):]), flush=True)
        del caches
        mx.clear_cache()
    return rows


def model_table(rows: list[dict]) -> str:
    lines = ["| context | scheme | decode tokens/s, per run | median | x raw, per run (min-max) "
             "| step alone: graph build ms | step alone: eval + wait ms |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = ""
        if r["raw"] and r["scheme"] != "raw":
            xs = [a / b for a, b in zip(r["tps"], r["raw"])]
            ratio = f"{statistics.median(xs):.2f}x ({min(xs):.2f}-{max(xs):.2f})"
        lines.append(f"| {r['T']:,} | {r['scheme']} | {', '.join(f'{v:.0f}' for v in r['tps'])} | "
                     f"{statistics.median(r['tps']):.0f} | {ratio} | {r['split'][0]:.2f} | {r['split'][1]:.2f} |")
    return "\n".join(lines)


def _heading(title: str, dev: str) -> str:
    """A docs section's title and its line naming the device, the date and this run's command."""
    command = "python bench/decode.py " + " ".join(sys.argv[1:])
    return f"### {title}\n\nDevice: {dev}. Date: {datetime.date.today().isoformat()}. Command: `{command}`.\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--contexts", default=",".join(map(str, CONTEXTS)))
    ap.add_argument("--schemes", default=",".join(SCHEMES))
    ap.add_argument("--calls", type=int, default=64)
    ap.add_argument("--tail", type=int, default=128, help="also time with this many raw tail rows (0: skip)")
    ap.add_argument("--plain", action="store_true", help="also time the plain-ops path")
    ap.add_argument("--sinks", action="store_true", help="also time fused_decode without and with attention sinks")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--breakdown", action="store_true", help="also time the passes alone (4k and 128k)")
    ap.add_argument("--write-docs", action="store_true")
    ap.add_argument("--model", action="store_true", help="a model's decode tokens/s instead (issue 30)")
    ap.add_argument("--runs", type=int, default=3, help="--model: runs per cell")
    ap.add_argument("--tokens", type=int, default=64, help="--model: tokens per run")
    ap.add_argument("--layers", type=int, default=8, help="--model: layers of Llama-3.1-8B's shapes")
    ap.add_argument("--compare", help="instead: these schemes side by side (comma-separated; autoB:mixed cycles "
                                      "the allocation's key layouts over the layers), --runs runs")
    ap.add_argument("--tails", help="instead: the cache's call with raw tails of these row counts (comma-separated), "
                                    "chained, beside fp16 SDPA over the stored rows, --runs runs")
    args = ap.parse_args()
    if kernels.select_backend() is None and not args.model:
        sys.exit("bench/decode.py needs an MLX GPU backend (CUDA or Metal) as the default device")
    mx.set_memory_limit(60 << 30)
    dev = device_line()
    print(dev, flush=True)
    if args.compare:
        schemes = args.compare.split(",")
        contexts = list(map(int, args.contexts.split(",")))
        rows = compare(contexts, schemes, args.runs, args.calls)
        body = (_heading("Decode kernels of the newer schemes against turbo4's", dev) +
                f"B=1, {HQ} query / {HKV} KV heads, d={D}, fp16 activations, one query token, the cache's own "
                f"attention path (the fused kernels; on CUDA the tensor-core pass 1); {args.calls} chained calls "
                f"(each call's query the previous output) cycling over several layers' caches; {args.runs} runs, "
                f"the methods taking turns in each run on the same caches. Ratios are per run (median, min-max). "
                f"`:mixed`: the layers cycle through every key layout the scheme's allocation can choose."
                f"\n\n{compare_table(rows, schemes[0])}\n")
        emit(body, "decode-schemes", args.write_docs)
        return
    if args.tails:
        tails = list(map(int, args.tails.split(",")))
        rows = tail_sweep(list(map(int, args.contexts.split(","))), args.schemes.split(","), tails, args.runs,
                          args.calls)
        body = (_heading("A decode call against its raw tail's length", dev) +
                f"B=1, {HQ} query / {HKV} KV heads, d={D}, fp16, one query token; the cache's own attention call "
                f"(stored rows through the fused kernels, the raw tail in pass 2 on CUDA) with n raw tail rows "
                f"after T stored rows, and fp16 SDPA over the T rows; GPU us per call, {args.calls} chained calls "
                f"(each call's query the previous output) cycling over several layers' caches; ranges over "
                f"{args.runs} runs, the tail lengths taking turns in each run.\n\n{tail_table(rows, tails)}\n")
        emit(body, "decode-tails", False)
        return
    if args.model:
        contexts = MODEL_CONTEXTS if args.contexts == ",".join(map(str, CONTEXTS)) else list(map(int, args.contexts.split(",")))
        schemes = MODEL_SCHEMES if args.schemes == ",".join(SCHEMES) else args.schemes.split(",")
        rows = model_decode(contexts, schemes, args.runs, args.tokens, args.layers)
        body = (_heading("One decode stream of a model: compressed against raw", dev) +
                f"{args.layers} layers of Llama-3.1-8B's shapes, random bf16 weights; {args.tokens} tokens per run "
                f"through mlx-lm's `generate_step` after the context, timed from the first token to the last; "
                f"the schemes take turns on the same context in every run. Step alone: 16 more steps one at a "
                f"time, the host's graph build (Python, mlx-lm and ours) and the evaluation it then waits for "
                f"(medians; generate_step overlaps the next build with this evaluation).\n\n{model_table(rows)}\n")
        emit(body, "decode-model", args.write_docs)
        return
    tuning = ""
    if args.sweep:
        ns, u, tgs = sweep(args.calls)
        # (the rest of the run: the cache's attention path reads them at every call)
        os.environ.update(TQSTORE_KERNEL_NS=str(ns), TQSTORE_KERNEL_UNROLL=str(u), TQSTORE_KERNEL_THREADGROUPS=str(tgs))
        tuning = f" Kernel tuning from the sweep: ns={ns}, unroll={u}, threadgroups={tgs}."
    if args.breakdown:
        for scheme in ("turbo4", "turbo8v3"):
            for T in SWEEP_CONTEXTS:
                print(f"breakdown {scheme} {ctx(T)}: {breakdown(scheme, T, args.calls)}", flush=True)
    rows = []
    for T in map(int, args.contexts.split(",")):
        new = bench_context(T, args.schemes.split(","), args.calls, args.plain, args.tail, args.sinks)
        print(table(new), flush=True)
        rows += new
    text = table(rows)
    body = (_heading("Fused decode kernels vs fp16 SDPA", dev) +
            f"B=1, {HQ} query / {HKV} KV heads, d={D}, fp16 activations, one query token; caches built by "
            f"`TurboQuantKVCache` from synthetic rows (T stored rows, no tail unless the method says so). "
            f"Chained: {args.calls} calls, each call's query the previous call's output (as a model's layers "
            f"are: no two calls overlap on the GPU), built first, then evaluated together (timed); batched: "
            f"{args.calls} independent calls evaluated together (MLX may run them concurrently, so this is "
            f"throughput, not a decode step's latency); sync: `mx.eval` after each call (median). "
            f"MB read: K and V as stored (scales, norms, key means included); each method cycles over "
            f"several layers' caches so the working set exceeds the L2 cache. GPU us/call: the calls' graphs are "
            f"built first, then evaluated together (timed); host us/call: building them (Python and MLX).{tuning}"
            f"\n\n{text}\n")
    emit(body, "decode-kernels", args.write_docs)


def emit(body: str, marker: str, write: bool) -> None:
    """Print a section and, with `write`, put it into docs/benchmarks.md between its markers."""
    print(body)
    if write:
        from common import replace_section

        replace_section(ROOT / "docs" / "benchmarks.md", marker, body)
        print(f"wrote docs/benchmarks.md ({marker} section)")


if __name__ == "__main__":
    main()
