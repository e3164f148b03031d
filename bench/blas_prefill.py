"""Prefill speed of the real model on MLX's CPU backend with the bundled BLAS and with OpenBLAS.

Each BLAS runs in its own process (the library is chosen at load time), on the same tokens.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

PROBE = r"""
import json, sys, time
import mlx.core as mx
sys.path.insert(0, {bench!r})
from common import load_real_model, text_tokens, DEFAULT_TEXT
from pathlib import Path
model, tok = load_real_model(Path({model!r}))
from mlx_lm.models.cache import make_prompt_cache
tokens = mx.array(text_tokens(tok, DEFAULT_TEXT, {n}))[None]
mx.eval(model.model(tokens[:, :8], cache=make_prompt_cache(model)))  # warm up
t0 = time.perf_counter()
mx.eval(model.model(tokens, cache=make_prompt_cache(model)))
from tqstore.models.blas import active_blas
print(json.dumps({{"blas": active_blas(), "tokens": {n}, "seconds": time.perf_counter() - t0}}))
"""


def measure(model: Path, n: int, blas: str) -> dict:
    """Prefill `n` tokens in a fresh process using `blas` ("bundled" or "openblas")."""
    from tqstore.models.blas import openblas_environment

    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "TQSTORE_BLAS_ACTIVE", "OPENBLAS_CORETYPE")}
    if blas == "openblas":
        env.update(openblas_environment())
    code = PROBE.format(bench=str(Path(__file__).resolve().parent), model=str(model), n=n)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])
