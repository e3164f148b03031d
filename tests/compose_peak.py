"""Run in a subprocess by tests/test_compose_memory.py: compose copies of one stored chunk on a
model folder and print one JSON line per composition: the estimate and the measured peak.

    python tests/compose_peak.py HOME MODEL COPIES:RECOMPUTE [COPIES:RECOMPUTE ...]

The chunk (DOCUMENT) is stored first; the resident set is read after that, so each peak is the
composition's and its answer's. `peak_mlx` is MLX's own count of what it allocated (reset
before each composition); `peak_rss` is the rise of the process's peak resident set over its
resident set before, or null when this composition did not raise the process's peak (the
resident set's peak cannot be reset, so give the compositions in growing order).
"""

from __future__ import annotations

import json
import resource
import sys

DOCUMENT = ("The Devil's Dictionary defines words with wit. To abscond is to move in a mysterious way, "
            "commonly with the property of another. Clause seven covers delivery, payment and penalties. ") * 6


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def peak_resident_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def main(home: str, model: str, specs: list[str]) -> None:
    import mlx.core as mx

    from tqstore.engine.chunks import Document
    from tqstore.engine.engine import Engine
    from tqstore.store.store import Store

    with Store.open(home) as store:
        engine = Engine(store)
        engine.add_chunk("alpha", DOCUMENT, model=model)
        for spec in specs:
            copies, recompute = spec.split(":")
            mx.clear_cache()
            before, peak_before = resident_bytes(), peak_resident_bytes()
            mx.reset_peak_memory()
            result = engine.ask_documents([Document(name="alpha")] * int(copies), "Who pays?", model=model,
                                          recompute=float(recompute), max_tokens=2)
            peak = peak_resident_bytes()
            print(json.dumps({"copies": int(copies), "recompute": float(recompute),
                              "tokens": result.answer.prompt_tokens, "estimate": result.estimated_bytes,
                              "peak_rss": peak - before if peak > peak_before else None,
                              "peak_mlx": mx.get_peak_memory()}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
