"""Where the model thread of `tqstore serve` spends a burst of concurrent requests (issue 30): the
worker in this process (no HTTP), bursts of concurrent 64-token greedy completions of short
prompts, and wall time summed per phase of the scheduler, per burst.

    python bench/worker_phases.py --model 8b --scheme turbo4      # GPU: 8 layers of Llama-3.1-8B shapes
    python bench/worker_phases.py --model tiny --scheme raw       # CPU: the tests' tiny llama
    python bench/worker_phases.py --model 8b --scheme turbo4 --profile   # and a cProfile of the model thread

The phases are nested, not exclusive: `DecodeBatch.step` holds `_launch` (building a step's graph
and starting it) and `_regroup` (rows joining or leaving the group); "shared prefill" holds
`prefill_rows` (the forward pass of the short prompts that arrived together and their
`start_decoding`); "admitting jobs" includes the wait for the next burst's requests while
nothing runs. A first burst of 8 and one of 1 warm up shapes and kernels, untimed.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import random
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "bench"), str(ROOT), str(ROOT / "tests")]

import server_batch  # noqa: E402
from common import stamp, use_openblas  # noqa: E402


class Phases:
    """Wall seconds and calls per wrapped method, summed."""

    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    def wrap(self, owner, name: str, label: str) -> None:
        real = getattr(owner, name)

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return real(*args, **kwargs)
            finally:
                self.seconds[label] += time.perf_counter() - t0
                self.calls[label] += 1

        setattr(owner, name, timed)

    def clear(self) -> None:
        self.seconds.clear()
        self.calls.clear()


class Collect:
    """A job's sink: set when the job ends."""

    def __init__(self):
        self.done = threading.Event()
        self.last = None

    def __call__(self, event):
        from tqstore.serve.jobs import Failed, Finished

        if isinstance(event, (Finished, Failed)):
            self.last = event
            self.done.set()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=("tiny", "8b"), default="tiny")
    parser.add_argument("--layers", type=int, default=8, help="layers of the 8b model")
    parser.add_argument("--scheme", default="turbo4")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--bursts", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=0,
                        help="prompts of this many random token ids, as bench/server_batch.py sends them (default: "
                             "12-word text prompts)")
    parser.add_argument("--profile", action="store_true", help="also print a cProfile of the model thread")
    parser.add_argument("--openblas", action="store_true", help="run on Debian's OpenBLAS, as `tqstore serve` does")
    parser.add_argument("--blas-threads", type=int, default=None, help="OPENBLAS_NUM_THREADS (1 on a shared CPU)")
    args = parser.parse_args(argv[1:])
    if args.blas_threads is not None and os.environ.get("OPENBLAS_NUM_THREADS") != str(args.blas_threads):
        os.environ["OPENBLAS_NUM_THREADS"] = str(args.blas_threads)  # read when OpenBLAS loads: start again
        os.execv(sys.executable, [sys.executable, *argv])
    if args.openblas:
        use_openblas(argv)

    import tqstore.engine.batch as batch
    import tqstore.serve.scheduling as scheduling
    from tqstore.engine.engine import Engine
    from tqstore.serve.autosave import SavePolicy
    from tqstore.serve.jobs import Finished
    from tqstore.serve.metrics import Metrics
    from tqstore.serve.openai_schema import GenerationRequest, Sampling
    from tqstore.serve.worker import ModelWorker

    phases = Phases()
    phases.wrap(scheduling.Scheduler, "_prefill", "shared prefill (+ each job to its first row)")
    phases.wrap(scheduling, "prefill_rows", "prefill_rows")
    phases.wrap(scheduling.Scheduler, "_own_step", "a job's own step (prefill chunk, restore)")
    phases.wrap(scheduling.Scheduler, "_advance", "a job resumed (token handed out, detokenized)")
    phases.wrap(scheduling.Scheduler, "_admit", "admitting jobs")
    phases.wrap(batch.DecodeBatch, "step", "DecodeBatch.step")
    phases.wrap(batch.DecodeBatch, "_launch", "DecodeBatch._launch")
    phases.wrap(batch.DecodeBatch, "_regroup", "DecodeBatch._regroup")
    profile = cProfile.Profile()
    run = scheduling.Scheduler.run

    def profiled_run(self, model):
        if args.profile:
            profile.enable()
        try:
            run(self, model)
        finally:
            profile.disable()

    scheduling.Scheduler.run = profiled_run
    root = Path(tempfile.mkdtemp())
    folder, vocab, described = server_batch.write_model(argparse.Namespace(model=args.model, layers=args.layers), root)
    engine = Engine.open(root / "home")
    worker = ModelWorker(engine, str(folder), scheme=args.scheme, max_running=args.concurrency,
                         policy=SavePolicy(enabled=False), metrics=Metrics())
    worker.start()

    rng = random.Random(0)

    def prompt(seed: int, i: int) -> str | tuple[int, ...]:
        if args.prompt_tokens:  # (none of the first few ids: special tokens in the tiny tokenizer)
            return tuple(rng.randrange(8, vocab - 1) for _ in range(args.prompt_tokens))
        return " ".join(f"w{(seed * 31 + i * 7 + j) % 97}" for j in range(12))

    def burst(n: int, seed: int) -> float:
        sinks, t0 = [], time.perf_counter()
        for i in range(n):
            request = GenerationRequest(chat=False, model=None, stream=True, include_usage=False,
                                        prompt=prompt(seed, i),
                                        sampling=Sampling(max_tokens=args.tokens, temperature=0.0, top_p=1.0,
                                                          seed=None, stop=()))
            sinks.append(Collect())
            worker.generate(request, sinks[-1])
        for sink in sinks:
            if not sink.done.wait(600) or not isinstance(sink.last, Finished):
                raise RuntimeError(f"a request failed: {sink.last}")
        return sum(s.last.value.completion_tokens for s in sinks) / (time.perf_counter() - t0)

    try:
        burst(args.concurrency, 999)
        burst(1, 998)
        phases.clear()
        rates = [burst(args.concurrency, b) for b in range(args.bursts)]
    finally:
        worker.stop()
    print(stamp(argv))
    prompts = f"{args.prompt_tokens}-token" if args.prompt_tokens else "12-word"
    print(f"model: {described}; scheme {args.scheme}; bursts of {args.concurrency} {args.tokens}-token greedy "
          f"completions of {prompts} prompts")
    print(f"tokens/s per burst: {[round(r) for r in rates]}")
    print("| phase | ms per burst | calls per burst |\n|---|---|---|")
    for label in sorted(phases.seconds, key=lambda k: -phases.seconds[k]):
        print(f"| {label} | {phases.seconds[label] * 1e3 / args.bursts:.1f} | {phases.calls[label] / args.bursts:.1f} |")
    if args.profile:
        out = io.StringIO()
        pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(25)
        print(out.getvalue())
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
