"""Where `tqstore serve`'s model thread spends its time (issue 30): bursts of concurrent streams
through the server's own worker (tqstore/serve/worker.py, in this process, no HTTP), while a
sampler thread reads the model thread's Python stack every `--interval` seconds.

    python bench/server_probe.py --model 8b --schemes raw turbo5v4      # GPU
    python bench/server_probe.py --openblas --blas-threads 1            # CPU, the tiny llama

Per scheme: one stream alone (tokens/s), then `--bursts` bursts of `--streams` streams; the
samples taken during the bursts are summed per frame, inclusive (the frame is on the stack) and
self (the innermost Python frame, by its current line: time in a C call is the line that made
it). Read the shares, not the tokens/s: the sampler takes the GIL every interval, and the
switch interval is cut to a fifth of it while sampling, so it slows the thread it watches.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(1, str(ROOT))
sys.path.insert(2, str(ROOT / "tests"))

from common import use_openblas  # noqa: E402


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
    parser.add_argument("--openblas", action="store_true")
    parser.add_argument("--blas-threads", type=int, default=None)
    argv = sys.argv if argv is None else argv
    args = parser.parse_args(argv[1:])
    if args.blas_threads is not None and os.environ.get("OPENBLAS_NUM_THREADS") != str(args.blas_threads):
        os.environ["OPENBLAS_NUM_THREADS"] = str(args.blas_threads)  # read when OpenBLAS loads: start again
        os.execv(sys.executable, [sys.executable, *argv])
    if args.openblas:
        use_openblas(argv)

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
        for scheme in args.schemes:
            worker = ModelWorker(Engine(store), str(folder), scheme=scheme, max_running=args.streams,
                                 policy=SavePolicy(False))
            worker.start()
            worker.ready.wait()
            if worker.load_error is not None:
                raise worker.load_error
            sampler = Sampler(worker._thread, args.interval)
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
