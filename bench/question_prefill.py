"""The question after a restore, on a GPU: a 16-token question and the first token over T stored
rows, compressed against raw, and what each new context length builds (issue 28).

    python bench/question_prefill.py                        # 4k, 16k, 64k; turbo4 and raw; 2 fresh processes
    python bench/question_prefill.py --tokens 4096 --runs 3 --processes 1
    python bench/question_prefill.py --mma-ab               # also the decode kernels' pass 1 A/B at 1k, 4k, 16k
    python bench/question_prefill.py --ab-prefill           # also each compressed cell with its rows decoded
    python bench/question_prefill.py --render a.json b.json --labels "A" "B" --write   # kept runs into the docs
    python bench/question_prefill.py --breakdown --tokens 4096 65536   # GPU time of the 15-token attention's parts

A model with Llama-3.1-8B's shapes (hidden 4096, 32 query / 8 KV heads, head dim 128, MLP 14336,
vocabulary 32,000), N of its layers (default 8), random bf16 weights, built in memory. Per cell
(T, scheme) the caches get T rows of random K/V (the compressed ones then compressed, as a
restore leaves them), and the question runs as the Engine runs it: a forward over its first 15
tokens (a prefill chunk over stored rows: `turboquant/attention/prefill.py` on the compressed caches),
then one over the last token (the fused decode kernels), to the argmax. The first question of a
cell is timed alone (what a new context length pays the first time), then `--runs` more (warm:
median and min-max); the caches are trimmed back after each. With `--ab-prefill` every compressed
cell runs twice on the same caches: the question through the decode kernels (`fused_prefill`,
the default) and with `TQSTORE_KERNEL_PREFILL=0` (the stored rows decoded into float32 and
MLX's SDPA, turboquant/attention/prefill.py), with the largest difference of their last-token logits.

Each run of cells is a fresh process; all processes share one MLX kernel cache folder
(`MLX_PTX_CACHE_DIR`, empty at the start), so the first process shows what is compiled and the
second what a later process pays with the compiled modules on disk. After every phase the child
lists the modules MLX wrote to that folder since the last phase (`custom_kernel_*` are ours, the
rest MLX's own JIT) and the decode-kernel variants `turboquant.attention.kernels.cuda.kernel` built.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests"))  # kernel_support: the synthetic caches and their float64 reference

QUESTION = 16
MARKER = "bench-question-prefill"


def llama_config(layers: int) -> dict:
    return {"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": layers, "intermediate_size": 14336,
            "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "rms_norm_eps": 1e-5,
            "vocab_size": 32000, "rope_theta": 500000.0, "max_position_embeddings": 131072,
            "tie_word_embeddings": False}


class Builds:
    """Modules MLX compiled into the cache folder and decode-kernel variants built, per phase."""

    def __init__(self, folder: Path):
        from turboquant.attention.kernels import cuda

        self.folder = folder
        self.seen = self._modules()
        self.variants: list[str] = []
        self.taken = 0
        make = cuda.kernel

        def recording(variant):
            if variant.name not in self.variants:
                self.variants.append(variant.name)
            return make(variant)

        cuda.kernel = recording

    def _modules(self) -> set[str]:
        return {p.stem for p in self.folder.glob("*.ptx")} if self.folder.is_dir() else set()

    def since(self) -> dict:
        now = self._modules()
        new, self.seen = sorted(now - self.seen), now
        variants, self.taken = self.variants[self.taken:], len(self.variants)
        return {"modules": new, "variants": variants}


def fill_caches(model, scheme: str, T: int, seed: int):
    """`model`'s caches under `scheme` holding T random K/V rows, as the Engine leaves a context
    before its first decode step (`start_decoding`: TurboQuant layers compressed from a block of
    256 rows up, shorter ones decoding raw until they hold one)."""
    import mlx.core as mx

    from turboquant.adapter.making import make_prompt_cache, start_decoding

    caches = make_prompt_cache(model, scheme)
    for i, c in enumerate(caches):
        k = mx.random.normal((1, 8, T, 128), key=mx.random.key(seed + 2 * i)).astype(mx.bfloat16)
        v = mx.random.normal((1, 8, T, 128), key=mx.random.key(seed + 2 * i + 1)).astype(mx.bfloat16)
        c.update_and_fetch(k, v)
    start_decoding(caches)
    mx.eval([c.state for c in caches])
    return caches


def ask(model, caches, question) -> tuple[float, float]:
    """(seconds of the 15-token forward, seconds of the last token's forward to the argmax)."""
    import mlx.core as mx

    t0 = time.perf_counter()
    logits = model(question[:, :-1], cache=caches)
    mx.eval(logits)
    t1 = time.perf_counter()
    logits = model(question[:, -1:], cache=caches)
    mx.eval(mx.argmax(logits[:, -1], axis=-1))
    t2 = time.perf_counter()
    for c in caches:
        c.trim(QUESTION)
    return t1 - t0, t2 - t1


def logits(model, caches, question):
    import mlx.core as mx
    import numpy as np

    out = model(question, cache=caches)[:, -1].astype(mx.float32)
    mx.eval(out)
    for c in caches:
        c.trim(QUESTION)
    return np.array(out)


MODE_ENV = ("TQSTORE_KERNEL_PREFILL", "TQSTORE_KERNEL_TILES")


def _set_mode(env: dict[str, str]) -> None:
    for name in MODE_ENV:
        if name in env:
            os.environ[name] = env[name]
        else:
            os.environ.pop(name, None)


def cells(model, builds: Builds, T: int, scheme: str, runs: int, ab_prefill: bool, ab_tiles: bool = False) -> list[dict]:
    """The cell's rows: the default path, with `ab_prefill` the decoded-rows path and with
    `ab_tiles` the tensor-core pass 1 at one row tile per threadgroup (K/V read once per 8 query
    rows, as before two tiles) on the same caches (alternating warm runs)."""
    import mlx.core as mx
    import numpy as np

    compressed = scheme != "raw"
    modes = ({scheme: {"TQSTORE_KERNEL_PREFILL": "1"}}
             | ({f"{scheme} (rows decoded)": {"TQSTORE_KERNEL_PREFILL": "0"}} if ab_prefill and compressed else {})
             | ({f"{scheme} (one row tile)": {"TQSTORE_KERNEL_TILES": "1"}} if ab_tiles and compressed else {}))
    rows = {label: {"tokens": T, "scheme": label} for label in modes}
    t0 = time.perf_counter()
    caches = fill_caches(model, scheme, T, seed=T)
    rows[scheme]["fill"] = time.perf_counter() - t0
    rows[scheme]["fill_builds"] = builds.since()
    question = mx.random.randint(1, 31999, (1, QUESTION), key=mx.random.key(T + 7))
    for label, env in modes.items():
        _set_mode(env)
        rows[label]["first"] = ask(model, caches, question)
        rows[label]["first_builds"] = builds.since()
        rows[label]["warm"] = []
    for _ in range(runs):
        for label, env in modes.items():
            _set_mode(env)
            rows[label]["warm"].append(ask(model, caches, question))
    if ab_prefill and compressed:
        got = {}
        for label in (scheme, f"{scheme} (rows decoded)"):
            _set_mode(modes[label])
            got[label] = logits(model, caches, question)
        a, b = got.values()
        rows[scheme]["logits_vs_decoded"] = float(np.abs(a - b).max() / np.abs(b).max())
    _set_mode({})
    del caches
    mx.clear_cache()
    return list(rows.values())


def mma_ab(reps: int = 3) -> list[dict]:
    """Chained fused decode calls at 1k, 4k and 16k: the CUDA-core pass 1 against the tensor-core
    one on the same caches, alternating."""
    import mlx.core as mx

    from decode import chained
    from turboquant.attention import kernels
    from turboquant.attention.kernels import KernelTuning
    from kernel_support.synthetic import build_cache, stored

    rows = []
    for T in (1024, 4096, 16384):
        caches = [build_cache("turbo4", 8, 128, mx.bfloat16, T, seed=i) for i in range(8)]
        q = mx.random.normal((1, 32, 1, 128), key=mx.random.key(1)).astype(mx.bfloat16)
        tunings = {"CUDA cores": KernelTuning(mma=False), "tensor cores": KernelTuning(mma_min_tokens=0)}
        times: dict[str, list[float]] = {k: [] for k in tunings}
        for _ in range(reps):
            for label, tuning in tunings.items():
                steps = [lambda x, c=c, t=tuning: kernels.fused_decode(x, c._key_side, c._value_side, stored(c), 0.088,
                                                                      c._shifts, tuning=t)[0] for c in caches]
                times[label].append(chained(steps, q, 64, reps=3) * 1e6)
        rows += [{"tokens": T, "pass1": label, "us_per_call": v} for label, v in times.items()]
        del caches
    return rows


def breakdown(tokens: list[int], layers: int = 8, calls: int = 64, schemes: tuple[str, ...] = ("turbo4",)) -> list[dict]:
    """GPU us per layer of the 15-token question's attention over T stored rows of each scheme (bf16),
    batched over `layers` caches: the whole `fused_prefill` (pass 1, pass 2 with the causal tail),
    pass 1 alone, pass 2 alone, and raw SDPA over the same number of bf16 rows with the causal
    mask (the floor), plus the bytes pass 1 reads per call (K/V once per row group), and pass 1
    at one row tile per threadgroup (the layout before two tiles) on the same caches."""
    import mlx.core as mx

    from decode import timed
    from turboquant.attention.kernels import KernelTuning, cuda, fused_prefill, host
    from kernel_support.synthetic import build_cache, stored

    L, scale = QUESTION - 1, 1 / math.sqrt(128)
    rows = []
    for T, scheme in ((T, s) for T in tokens for s in schemes):
        caches = [build_cache(scheme, 8, 128, mx.bfloat16, T, seed=i, tail=L) for i in range(layers)]
        q = mx.random.normal((1, 32, L, 128), key=mx.random.key(2)).astype(mx.bfloat16)
        rq = q.reshape(1, 32 * L, 1, 128)
        parts, one_tile = [], []
        for c in caches:
            arrays = stored(c)
            for tuning, into in ((None, parts), (KernelTuning(tiles=1), one_tile)):
                call = host.describe(rq, c._key_side, c._value_side, arrays, c._shifts, tensor_cores=True,
                                     tuning=tuning)
                a1 = host.pass1_args(cuda.kernel, call, rq, c._key_side, c._value_side, arrays, scale, c._shifts,
                                     tuning=tuning)
                po, pm, pl = cuda.kernel(call.pass1)(**a1)
                a2 = host.pass2_args(call, c._value_side, a1["inputs"][0], po, pm, pl)
                mx.eval(po, pm, pl)
                into.append((c, call, a1, a2))
        call = parts[0][1]
        nbytes = sum(a.nbytes for a in stored(caches[0]).values()) * -(-call.R // call.pass1.rmax)
        tails = [(c._tail.arrays["keys"], c._tail.arrays["values"]) for c in caches]
        fns = {
            "fused_prefill": [lambda c=c, t=t: fused_prefill(q, c._key_side, c._value_side, c._store.arrays, scale,
                                                             "causal", c._shifts, t, c.stored, L) for c, t in zip(caches, tails)],
            "pass 1": [lambda p=p: cuda.kernel(p[1].pass1)(**p[2])[0] for p in parts],
            "pass 1 (one row tile)": [lambda p=p: cuda.kernel(p[1].pass1)(**p[2])[0] for p in one_tile],
            "pass 2 (merge only)": [lambda p=p: cuda.kernel(p[1].pass2)(**p[3])[0] for p in parts],
        }
        ks = [mx.random.normal((1, 8, T + L, 128), key=mx.random.key(i)).astype(mx.bfloat16) for i in range(layers)]
        mx.eval(ks)
        fns["raw SDPA (causal)"] = [lambda k=k: mx.fast.scaled_dot_product_attention(q, k, k, scale=scale, mask="causal")
                                    for k in ks]
        got = {name: timed(f, calls, 3)[0] * 1e6 for name, f in fns.items()}
        rows.append({"tokens": T, "scheme": scheme, "pass1_reads": -(-call.R // call.pass1.rmax), "pass1_mb": nbytes / 1e6,
                     **got})
        print("ROW " + json.dumps({"breakdown": rows[-1]}), flush=True)
        del caches, parts, ks, fns
        mx.clear_cache()
    return rows


def child(args) -> None:
    import mlx.core as mx
    from mlx_lm.models import llama

    mx.set_memory_limit(100 << 30)
    builds = Builds(Path(os.environ["MLX_PTX_CACHE_DIR"]))
    t0 = time.perf_counter()
    mx.random.seed(0)
    model = llama.Model(llama.ModelArgs.from_dict(llama_config(args.layers)))
    model.set_dtype(mx.bfloat16)
    mx.eval(model.parameters())
    print("ROW " + json.dumps({"setup": time.perf_counter() - t0, "builds": builds.since()}), flush=True)
    for T in args.tokens:
        for scheme in args.schemes:
            for row in cells(model, builds, T, scheme, args.runs, args.ab_prefill, args.ab_tiles):
                print("ROW " + json.dumps(row), flush=True)
    if args.mma_ab:
        for row in mma_ab():
            print("ROW " + json.dumps({"mma_ab": row}), flush=True)


def spread(values: list[float], scale: float = 1.0, digits: int = 3) -> str:
    values = [v * scale for v in values]
    med = statistics.median(values)
    return f"{med:.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def short(module: str) -> str:
    """A module name for a table: our variants without the prefix and source hash, MLX's fused
    graphs cut."""
    if module.startswith("custom_kernel_"):
        return module[len("custom_kernel_"):].rsplit("_", 1)[0]
    return module if len(module) <= 40 else module[:24] + "..."


def table(processes: list[list[dict]]) -> str:
    from common import markdown_table

    cells = {}
    for p, rows in enumerate(processes):
        for r in rows:
            if "tokens" in r:
                cells.setdefault((r["tokens"], r["scheme"]), {})[p] = r
    lines = []
    for (T, scheme), by in cells.items():
        warm = [sum(w) for r in by.values() for w in r["warm"]]
        raw = cells.get((T, "raw"))
        ratio = ""
        if scheme != "raw" and raw:
            raw_warm = [sum(w) for r in raw.values() for w in r["warm"]]
            ratio = f"{statistics.median(warm) / statistics.median(raw_warm):.2f}x"
        first = " / ".join(f"{sum(by[p]['first']):.3f}" for p in sorted(by))
        built = by[min(by)]["first_builds"]
        lines.append([f"{T:,}", scheme, first, spread([w[0] for r in by.values() for w in r["warm"]]),
                      spread([w[1] for r in by.values() for w in r["warm"]]), spread(warm), ratio,
                      f"{len(built['modules'])}: {', '.join(map(short, built['modules']))}" if built["modules"] else "0",
                      " / ".join(f"{r['logits_vs_decoded']:.1e}" for r in by.values() if "logits_vs_decoded" in r)])
    return markdown_table(["tokens", "scheme", "first question + token s, process 1 / 2 ...",
                           "warm 15-token forward s", "warm last-token forward s", "warm total s",
                           "total vs raw", "modules compiled at the first question (process 1)",
                           "last-token logits vs rows decoded (max diff / max)"], lines)


def mma_table(processes: list[list[dict]]) -> str:
    from common import markdown_table

    rows = [r["mma_ab"] for p in processes for r in p if "mma_ab" in r]
    return markdown_table(["stored rows", "pass 1", "us per call, chained (3 runs)"],
                          [[f"{r['tokens']:,}", r["pass1"], ", ".join(f"{v:.1f}" for v in r["us_per_call"])]
                           for r in rows]) if rows else ""


def render(files: list[Path], labels: list[str]) -> str:
    """The tables of kept runs (`--json` files), each under its label."""
    parts = []
    for path, label in zip(files, labels + [""] * len(files)):
        processes = json.loads(path.read_text())
        parts.append(f"{label}\n\n{table(processes)}".strip())
        if mma_table(processes):
            parts.append(mma_table(processes))
    return "\n\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384, 65536])
    parser.add_argument("--schemes", nargs="+", default=["raw", "turbo4"])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--mma-ab", action="store_true")
    parser.add_argument("--ab-prefill", action="store_true")
    parser.add_argument("--ab-tiles", action="store_true", help="also the tensor-core pass 1 at one row tile (before)")
    parser.add_argument("--cache-dir", type=Path, help="MLX_PTX_CACHE_DIR shared by the processes (default: a new one)")
    parser.add_argument("--json", type=Path, help="write every process's rows here")
    parser.add_argument("--render", type=Path, nargs="+", help="only print the tables of these --json files")
    parser.add_argument("--labels", nargs="+", default=[], help="a caption per --render file")
    parser.add_argument("--write", action="store_true", help="put the rendered tables into docs/benchmarks.md")
    parser.add_argument("--breakdown", action="store_true", help="only the GPU time of the question attention's parts")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.child:
        child(args)
        return 0
    if args.breakdown:
        breakdown(args.tokens, args.layers, schemes=tuple(s for s in args.schemes if s != "raw") or ("turbo4",))
        return 0
    if args.render:
        body = render(args.render, args.labels)
        if args.write:
            from common import replace_section

            replace_section(ROOT / "docs" / "benchmarks.md", MARKER, body)
        print(body)
        return 0
    folder = args.cache_dir or Path(tempfile.mkdtemp(prefix="mlx-ptx-"))
    env = dict(os.environ, MLX_PTX_CACHE_DIR=str(folder), USE_TORCH="0")
    processes = []
    for p in range(args.processes):
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--layers", str(args.layers), "--runs",
               str(args.runs), "--tokens", *map(str, args.tokens), "--schemes", *args.schemes]
        if args.ab_prefill:
            cmd.append("--ab-prefill")
        if args.ab_tiles:
            cmd.append("--ab-tiles")
        if args.mma_ab and p == args.processes - 1:
            cmd.append("--mma-ab")
        t0 = time.perf_counter()
        run = subprocess.run(cmd, env=env, capture_output=True, text=True)
        rows = [json.loads(line[4:]) for line in run.stdout.splitlines() if line.startswith("ROW ")]
        print(f"process {p + 1}: {time.perf_counter() - t0:.1f} s, exit {run.returncode}", flush=True)
        if run.returncode:
            print(run.stderr[-3000:], flush=True)
        for r in rows:
            print(json.dumps(r), flush=True)
        processes.append(rows)
        if args.json:
            args.json.write_text(json.dumps(processes, indent=1))
    print(table(processes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
