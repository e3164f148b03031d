"""Where `tqstore serve`'s model thread spends its time (issue 30): bursts of concurrent streams
through the server's own worker (tqstore/serve/worker.py, in this process, no HTTP), while a
sampler thread reads the model thread's Python stack every `--interval` seconds.

    python bench/server_probe.py --model 8b --schemes raw turbo5v4      # GPU
    python bench/server_probe.py --openblas --blas-threads 1            # CPU, the tiny llama

    python bench/server_probe.py --model 8b --timeline --profile-own   # GPU: wall time by part

With `--timeline` there is no sampler: the model thread's methods are timed instead, and the
bursts' wall time (1 stream, then `--streams`) is split into the prefill steps (their
`mx.eval`, the rest), the shared prefill of requests that arrived together (`prefill_rows`,
their start of decoding included, and each job on to its first row), the decode steps (graph build, `mx.async_eval`, the wait for the last
step's tokens), the served rows' resumption and what is left (admitting, idle);
`--profile-own` adds a cProfile of the prefill steps, `--profile-steps` one of the decode steps.
Otherwise:

Per scheme: one stream alone (tokens/s), then `--bursts` bursts of `--streams` streams; the
samples taken during the bursts are summed per frame, inclusive (the frame is on the stack) and
self (the innermost Python frame, by its current line: time in a C call is the line that made
it). Read the shares, not the tokens/s: the sampler takes the GIL every interval, and the
switch interval is cut to a fifth of it while sampling, so it slows the thread it watches.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import io
import os
import pstats
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(1, str(ROOT))
sys.path.insert(2, str(ROOT / "tests"))

from common import choose_blas  # noqa: E402


class Sampler:
    """Samples one thread's Python stack while `on` is set."""

    def __init__(self, thread: threading.Thread, interval: float):
        self.thread, self.interval = thread, interval
        self.on = threading.Event()
        self.samples = 0
        self.inclusive: collections.Counter = collections.Counter()
        self.self_lines: collections.Counter = collections.Counter()
        self._stop = False
        self._runner = threading.Thread(target=self._run, daemon=True)
        self._runner.start()

    def _run(self) -> None:
        while not self._stop:
            time.sleep(self.interval)
            if not self.on.is_set():
                continue
            frame = sys._current_frames().get(self.thread.ident)
            if frame is None:
                continue
            self.samples += 1
            self.self_lines[_where(frame, frame.f_lineno)] += 1
            seen = set()
            while frame is not None:
                where = _where(frame, frame.f_code.co_firstlineno)
                if where not in seen:
                    seen.add(where)
                    self.inclusive[where] += 1
                frame = frame.f_back

    def close(self) -> None:
        self._stop = True

    def report(self, top: int) -> list[str]:
        n = max(self.samples, 1)
        lines = [f"{self.samples} samples; inclusive (function, first line):"]
        lines += [f"  {100 * c / n:5.1f}% {w}" for w, c in self.inclusive.most_common(top)]
        lines.append("self (innermost Python line):")
        lines += [f"  {100 * c / n:5.1f}% {w}" for w, c in self.self_lines.most_common(top)]
        return lines


class Timeline:
    """Wall time of the model thread by part, while `on`: prefill and other own steps, shared
    prefill passes, decode steps (graph build, `mx.async_eval`, waiting for the launched tokens) and each served row's
    resumption (detokenizing, stop checks, sending); the rest is admitting and waiting."""

    def __init__(self, profile: bool = False, profile_steps: bool = False):
        import mlx.core as mx
        from tqstore.engine.batch import DecodeBatch
        from tqstore.serve.scheduling import Scheduler

        self.on = False
        self.profile = cProfile.Profile() if profile else None
        self.step_profile = cProfile.Profile() if profile_steps else None
        self.reset()
        self._depth = 0
        own, advance, shared = Scheduler._own_step, Scheduler._advance, Scheduler._prefill
        step, launch, async_eval, evaluate = DecodeBatch.step, DecodeBatch._launch, mx.async_eval, mx.eval
        timeline = self
        self._own = False

        def timed(part, fn):
            def wrapper(*a, **k):
                t0 = time.perf_counter()
                timeline._depth += 1
                try:
                    return fn(*a, **k)
                finally:
                    timeline._depth -= 1
                    if timeline.on:
                        timeline.seconds[part] += time.perf_counter() - t0
            return wrapper

        def resumed(self_, running):
            if timeline._depth:  # inside an own step: counted there
                return advance(self_, running)
            return timed("rows resumed", advance)(self_, running)

        timed_step = timed("step", step)

        def stepped(self_, model, rows, keep=None):
            profiling = timeline.on and timeline.step_profile is not None
            if timeline.on:
                timeline.steps += 1
                timeline.rows += len(rows)
            if profiling:
                timeline.step_profile.enable()
            try:
                return timed_step(self_, model, rows, keep)
            finally:
                if profiling:
                    timeline.step_profile.disable()

        timed_own = timed("own steps", own)

        def own_step(self_, running):
            timeline._own = True
            if timeline.on and timeline.profile is not None:
                timeline.profile.enable()
            try:
                return timed_own(self_, running)
            finally:
                timeline._own = False
                if timeline.profile is not None:
                    timeline.profile.disable()

        Scheduler._own_step = own_step
        Scheduler._prefill = timed("shared prefill", shared)
        timed_evaluate = timed("own steps: mx.eval", evaluate)
        mx.eval = lambda *a: timed_evaluate(*a) if timeline._own else evaluate(*a)
        Scheduler._advance = resumed
        DecodeBatch.step = stepped
        DecodeBatch._launch = timed("step: launch", launch)
        timed_eval = timed("step: async_eval", async_eval)
        # only a decode step's launch: the prefills' evaluations count as own steps
        mx.async_eval = lambda *a: timed_eval(*a) if timeline._depth >= 2 else async_eval(*a)

    def reset(self) -> None:
        self.seconds = collections.Counter()
        self.steps = self.rows = 0

    def report(self, wall: float) -> list[str]:
        s = self.seconds
        parts = {"own steps (prefills): mx.eval": s["own steps: mx.eval"],
                 "own steps (prefills): the rest": s["own steps"] - s["own steps: mx.eval"],
                 "shared prefill (and each job to its first row)": s["shared prefill"],
                 "step: graph build": s["step: launch"] - s["step: async_eval"],
                 "step: mx.async_eval": s["step: async_eval"],
                 "step: wait and bookkeeping": s["step"] - s["step: launch"],
                 "rows resumed": s["rows resumed"]}
        parts["admitting, idle"] = wall - sum(parts.values())
        lines = [f"{wall * 1e3:.0f} ms of bursts, {self.steps} decode steps, {self.rows / max(self.steps, 1):.2f} rows per step"]
        lines += [f"  {100 * v / wall:5.1f}% {v * 1e3 / max(self.steps, 1):7.3f} ms/step  {k}" for k, v in parts.items()]
        if self.profile is not None:
            lines.append(_profile_text("own steps", self.profile))
            self.profile = cProfile.Profile()
        if self.step_profile is not None:
            lines.append(_profile_text("decode steps", self.step_profile))
            self.step_profile = cProfile.Profile()
        return lines


def _profile_text(title: str, profile: cProfile.Profile) -> str:
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("cumulative").print_stats(45)
    pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(25)
    return f"{title}, cProfile:\n" + out.getvalue()


def _where(frame, line: int) -> str:
    return f"{frame.f_code.co_name} ({Path(frame.f_code.co_filename).name}:{line})"


def burst(worker, prompts: list, max_tokens: int) -> float:
    """Aggregate tokens/s of one generation per prompt, all queued at once."""
    from tqstore.serve.jobs import Failed, Finished
    from tqstore.serve.openai_schema import GenerationRequest, Sampling

    done = threading.Semaphore(0)
    tokens = []

    def sink(event):
        if isinstance(event, Finished):
            tokens.append(event.value.completion_tokens)
            done.release()
        elif isinstance(event, Failed):
            tokens.append(0)
            print("failed:", event.error, flush=True)
            done.release()

    t0 = time.perf_counter()
    for p in prompts:
        request = GenerationRequest(chat=False, model=None, sampling=Sampling(max_tokens, 0.0, 1.0, None, ()),
                                    stream=True, include_usage=True, prompt=tuple(p))
        worker.generate(request, sink)
    for _ in prompts:
        done.acquire()
    return sum(tokens) / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=("tiny", "8b"), default="tiny")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--schemes", nargs="+", default=["raw", "turbo5v4"])
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--bursts", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--ragged", action="store_true", help="prompts of 16, 19, 22, ... tokens, not all 16")
    parser.add_argument("--interval", type=float, default=0.0005)
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--timeline", action="store_true",
                        help="no sampler: the bursts' wall time by part of the model thread's turns")
    parser.add_argument("--profile-own", action="store_true", help="with --timeline: cProfile the own steps")
    parser.add_argument("--profile-steps", action="store_true", help="with --timeline: cProfile the decode steps")
    parser.add_argument("--openblas", action="store_true")
    parser.add_argument("--blas-threads", type=int, default=None)
    argv = sys.argv if argv is None else argv
    args = parser.parse_args(argv[1:])
    choose_blas(argv, args.openblas, args.blas_threads)

    from server_batch import write_model

    with tempfile.TemporaryDirectory() as root:
        os.environ["TQSTORE_HOME"] = str(Path(root) / "home")
        folder, vocab, described = write_model(args, Path(root))
        print(described, flush=True)
        from tqstore import Store
        from tqstore.config import load_config
        from tqstore.engine.engine import Engine
        from tqstore.serve.autosave import SavePolicy
        from tqstore.serve.worker import ModelWorker

        store = Store.open(config=load_config(None))
        timeline = Timeline(args.profile_own, args.profile_steps) if args.timeline else None
        for scheme in args.schemes:
            worker = ModelWorker(Engine(store), str(folder), scheme=scheme, max_running=args.streams,
                                 policy=SavePolicy(False))
            worker.start()
            worker.ready.wait()
            if worker.load_error is not None:
                raise worker.load_error
            sampler = None if args.timeline else Sampler(worker._thread, args.interval)
            prompts = [[(7 * i + j) % (vocab - 10) + 5 for j in range(16 + (3 * i if args.ragged else 0))]
                       for i in range(args.streams)]
            for _ in range(2):  # warm: builds and first shapes
                burst(worker, prompts[:1], args.tokens)
                burst(worker, prompts, args.tokens)
            for _ in range(3):
                print(f"{scheme} 1 stream: {burst(worker, prompts[:1], args.tokens):.1f} tok/s", flush=True)
            # A thread holding the GIL gives it up only in blocking C calls or after the switch
            # interval (5 ms by default): without a short one the samples land mostly where MLX
            # waits and miss the Python that builds the graphs.
            if timeline is not None:
                for streams in (1, args.streams):
                    timeline.reset()
                    timeline.on, wall = True, 0.0
                    for _ in range(args.bursts):
                        t0 = time.perf_counter()
                        rate = burst(worker, prompts[:streams], args.tokens)
                        wall += time.perf_counter() - t0
                        print(f"{scheme} {streams} streams: {rate:.1f} tok/s", flush=True)
                    timeline.on = False
                    print(f"{scheme}, {streams} streams: " + "\n".join(timeline.report(wall)), flush=True)
                worker.stop()
                continue
            switch = sys.getswitchinterval()
            sys.setswitchinterval(args.interval / 5)
            sampler.on.set()
            for _ in range(args.bursts):
                print(f"{scheme} {args.streams} streams: {burst(worker, prompts, args.tokens):.1f} tok/s", flush=True)
            sampler.on.clear()
            sys.setswitchinterval(switch)
            print(f"{scheme}: " + "\n".join(sampler.report(args.top)), flush=True)
            sampler.close()
            worker.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
