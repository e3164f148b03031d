"""How often one save, one ask and one pull cross from tqstore into turboquant (issue 32), traced
as they run: every call from a tqstore module into a turboquant function, by the front-door name
it belongs to. The plain data between the two (`turboquant.records`), the scheme grammar
(`parse_scheme`) and the calls every mlx-lm cache answers (`trim`, `state`, ...) are not
crossings: they are the shared vocabulary, not turboquant doing the walk's work; nor is what the
model calls while it runs (its attention, through whichever dispatch a test or the server left
installed in this process).
docs/architecture.md lists the same crossings under each walk."""

from __future__ import annotations

import sys
from collections import Counter

import pytest
from mlx_lm.models.cache import KVCache

from model_folder import write_model_folder
from test_store_s3 import s3_store
from tqstore.engine.engine import Engine

DOCUMENT = ("The contract says the seller pays for delays. Clause seven covers delivery, payment and "
            "penalties. ") * 12
SHARED = ("turboquant.records", "turboquant.codec.schemes")
CACHE_PROTOCOL = frozenset(name for name in dir(KVCache) if not name.startswith("_"))  # what every mlx-lm cache answers
FACE = {"turboquant.adapter.making.codec_snapshot": "codec_snapshot"}


def _crossings(run) -> Counter:
    """{front-door name: calls} of the calls from tqstore into turboquant while `run()` runs."""
    seen: Counter = Counter()

    def profile(frame, event, arg):
        if event != "call" or frame.f_back is None:
            return
        callee, caller = frame.f_globals.get("__name__", ""), frame.f_back.f_globals.get("__name__", "")
        if not callee.startswith("turboquant") or not caller.startswith("tqstore") or callee.startswith(SHARED):
            return
        qualname = frame.f_code.co_qualname
        if "." in qualname and qualname.rsplit(".", 1)[1] in CACHE_PROTOCOL:
            return
        if _inside_the_model(frame.f_back):  # its attention, through whatever dispatch is installed
            return
        name = f"{callee}.{qualname}"
        seen[FACE.get(name, qualname.split(".")[0])] += 1

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return seen


def _inside_the_model(frame) -> bool:
    """Whether `frame` runs inside a model's forward pass: what the model calls (its attention
    over the caches, through TurboQuant's dispatch or the server's batched one) is the model's
    work, not a call of the walk."""
    while frame is not None:
        if frame.f_globals.get("__name__", "").startswith("mlx_lm.models."):
            return True
        frame = frame.f_back
    return False


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_model_folder(tmp_path_factory.mktemp("model") / "tiny-qwen2", kind="qwen2")


def test_save_ask_and_pull_enter_turboquant_through_two_names_at_most(s3, tmp_path, model_dir):
    home = s3_store(tmp_path / "a", s3)
    save = _crossings(lambda: Engine(home, prefill_chunk=64).save("doc", DOCUMENT, model=str(model_dir)))
    # a fresh engine, as a new `tqstore ask` process has: nothing of the save remembered
    ask = _crossings(lambda: Engine(home, prefill_chunk=64).ask("doc", "Who pays?", max_tokens=2))
    home.push("doc")
    other = s3_store(tmp_path / "b", s3)
    pull = _crossings(lambda: other.pull("doc"))
    # the codec's description (the lookup's and the keys' digest), then the caches themselves
    assert set(save) == set(ask) == {"codec_snapshot", "Context"}, (save, ask)
    assert save["codec_snapshot"] == ask["codec_snapshot"] == 1
    assert pull == Counter()
    home.close()
    other.close()
