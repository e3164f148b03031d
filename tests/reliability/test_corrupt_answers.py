"""Damage ends in answers: every trial answers a question and is judged against a never-damaged control.

The store-level corruption runs (test_corruption.py) count a shorter prefix as a correct result,
and it is one, at the store. What the user sees is the answer: issue 27 found that after a
restore fell back to a shorter prefix, the engine prefilled the question after the lookup's
length, over a hole, and reported every token as cached. Here each trial damages one object of
a saved entry (an LMDB copy, or the bucket's object), asks the question through `Engine.ask`
(what `tqstore ask` runs), `Engine.generate` over a remote lookup (an empty home whose bucket
holds the entry), or a real `tqstore serve`, and compares the answer with controls computed
from the undamaged entry: for each length k that a restore can return (0, each block end, the
whole entry), the answer after restoring exactly k tokens and prefilling the rest.

- a clean miss: the count reported cached is what the damage leaves (the blocks before the
  damaged one), and the answer is that length's control: 12 greedy tokens and the first step's
  log-probabilities bit for bit (`array_equal`); through the server, which returns no logits,
  12 tokens sampled at temperature 1 with a fixed seed, against a control sampled alike.
  With block 0, the window or the codecs lost in every tier nothing is restorable: the answer
  is the cold run's, 0 tokens reported cached.
- a clean error: a tqstore error with its message (counted; none is expected).
- anything else is a wrong answer, and there must be none. (A flipped byte is always found, by
  the LMDB tier's digest or the bucket's sha256: no trial here can load the whole entry.)

A plain family (llama) and a hybrid one (qwen3_5: gated delta-net states checkpointed at block
ends, and attention) are both run, under turbo8v3.
"""

from __future__ import annotations

import random
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import lmdb
import mlx.core as mx
import pytest

from harness import open_store, s3_settings
from model_folder import write_model_folder
from server_process import ServerProcess, request
from tqstore.engine.engine import Engine
from tqstore.engine.generation import AskResult
from tqstore.errors import TqstoreError
from tqstore.format.blocks import BLOCK_SIZE

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # qwen3_5's uncompressed layers, noted once each

FAMILIES = ("llama", "qwen3_5")
# A narrower llama than tiny_models' (still 8 layers, so turbo8v3 compresses the middle ones): a
# cold prefill of the document takes about 2 s on 2 busy cores instead of 15.
SMALLER = {"llama": dict(hidden_size=128, intermediate_size=256, num_attention_heads=2, num_key_value_heads=1,
                         head_dim=64)}
SCHEME = "turbo8v3"
# 566 tokens framed: blocks of 256, 256 and 54.
DOCUMENT = "The contract says the seller pays for delays. Clause seven covers delivery and penalties. " * 33
QUESTION = "Who pays for delays?"
MAX_TOKENS = 12
SAMPLING = {"temp": 1.0, "seed": 27}  # the server trials' answers (see serve_trial)
NAME = "doc"


@dataclass(frozen=True)
class Answer:
    """What a trial or a control produced, and how many prompt tokens it says were restored."""

    tokens: tuple[int, ...]
    text: str
    logprobs: mx.array | None  # None through the server
    cached: int
    sampled: bool = False  # drawn at SAMPLING (the server's answers), else greedy

    @classmethod
    def of(cls, result: AskResult) -> "Answer":
        return cls(tuple(result.tokens), result.text, result.first_logprobs, result.cached_tokens)

    def same_as(self, control: "Answer") -> bool:
        """Whether this is the control's answer: its tokens and first-step log-probabilities
        (through the server, the text it sampled)."""
        if self.logprobs is None:
            return self.text == control.text
        return self.tokens == control.tokens and bool(mx.array_equal(self.logprobs, control.logprobs))


class Saved:
    """One family's saved entry (a closed home to copy), its model, prompt and controls."""

    def __init__(self, family: str, root: Path):
        self.family = family
        self.folder = write_model_folder(root / family, family, **SMALLER.get(family, {}))
        self.home = root / f"{family}-origin"
        engine = Engine(open_store(self.home))
        engine.save(NAME, DOCUMENT, model=str(self.folder), scheme=SCHEME)
        self.loaded = engine.model_for(NAME)
        self.manifest = engine.store.get(NAME)
        self.prompt = list(self.manifest.tokens) + self.loaded.prompt.question_tokens(self.loaded.tokenizer, QUESTION)
        self.full = len(self.manifest.tokens)
        self.keys = {f"block {i}": ref.key for i, ref in enumerate(self.manifest.blocks)}
        self.keys |= {"window": self.manifest.window.key, "shared": self.manifest.shared.key}
        engine.store.close()
        self._controls: dict[tuple[int, bool], Answer] = {}
        self._control_home = root / f"{family}-control"
        shutil.copytree(self.home, self._control_home)

    @property
    def lengths(self) -> list[int]:
        """Every length a restore of this entry can return: nothing, each block end, the whole."""
        return sorted({0, *range(BLOCK_SIZE, self.full, BLOCK_SIZE), self.full})

    def control(self, k: int, sampled: bool = False) -> Answer:
        """The answer after restoring exactly the first k tokens of the undamaged entry (greedy,
        or drawn at SAMPLING as the server trials ask)."""
        if (k, sampled) not in self._controls:
            engine = self.engine(self._control_home)
            started = engine.start(self.loaded, SCHEME, self.prompt[:k])
            assert started.matched == k
            result = engine.generate(self.loaded, SCHEME, self.prompt, max_tokens=MAX_TOKENS, started=started,
                                     **(SAMPLING if sampled else {}))
            self._controls[k, sampled] = Answer.of(result)
        return self._controls[k, sampled]

    def engine(self, home: Path, **settings) -> Engine:
        engine = Engine(open_store(home, **settings))
        engine.use_model(self.loaded)
        return engine

    def left(self, what: str) -> int:
        """The tokens a restore can still return once object `what` is lost in every tier: the
        blocks before a damaged block; nothing without the window or the codecs."""
        return int(what.split()[1]) * BLOCK_SIZE if what.startswith("block ") else 0

    def judge(self, got: Answer, damaged: str) -> str:
        """'clean miss', or the wrong answer described. The answer must be the control's of the
        length reported cached, and that length the one the damage leaves (the server's text
        alone may not tell a hole: random-weight models repeat themselves)."""
        if got.cached == self.left(damaged) and got.same_as(self.control(got.cached, got.sampled)):
            return "clean miss"
        same = [k for k in self.lengths if got.same_as(self.control(k, got.sampled))]
        return (f"WRONG: {got.cached} tokens reported cached where the damage leaves {self.left(damaged)}, the "
                f"answer is that of {same or 'no'} restored tokens")


@pytest.fixture(scope="module")
def saved_by_family(tmp_path_factory) -> Callable[[str], Saved]:
    """Each family's saved entry, made once for the module."""
    made: dict[str, Saved] = {}

    def get(family: str) -> Saved:
        if family not in made:
            made[family] = Saved(family, tmp_path_factory.mktemp("answers"))
        return made[family]

    return get


@pytest.fixture(params=FAMILIES)
def saved(request, saved_by_family) -> Saved:
    return saved_by_family(request.param)


# -- damage -------------------------------------------------------------------------------------

def object_size(home: Path, key: bytes) -> int:
    return sum(len(s) for s in _segments(home, key))


def _segments(home: Path, key: bytes) -> list[bytes]:
    env = lmdb.open(str(home / "lmdb"), max_dbs=10, readonly=True, lock=False)
    try:
        db = env.open_db(b"segments", create=False)
        with env.begin() as txn:
            out, i = [], 0
            while (seg := txn.get(key + i.to_bytes(4, "big"), db=db)) is not None:
                out.append(bytes(seg))
                i += 1
        return out
    finally:
        env.close()


def flip_lmdb_byte(home: Path, key: bytes, position: int) -> None:
    """Flip the byte at `position` of object `key`'s payload in a closed home (bit rot under the
    tier's digest)."""
    env = lmdb.open(str(home / "lmdb"), max_dbs=10)
    try:
        db = env.open_db(b"segments")
        with env.begin(write=True) as txn:
            i = 0
            while True:
                seg_key = key + i.to_bytes(4, "big")
                data = bytearray(txn.get(seg_key, db=db))
                if position < len(data):
                    data[position] ^= 0xFF
                    txn.put(seg_key, bytes(data), db=db)
                    return
                position -= len(data)
                i += 1
    finally:
        env.close()


# -- trials -------------------------------------------------------------------------------------

def ask_trial(saved: Saved, home: Path, damaged: str) -> str:
    """`Engine.ask` over `home` (what `tqstore ask` runs), judged."""
    engine = saved.engine(home)
    try:
        return saved.judge(Answer.of(engine.ask(NAME, QUESTION, max_tokens=MAX_TOKENS)), damaged)
    except TqstoreError as exc:
        assert str(exc), "a tqstore error without a message"
        return f"clean error ({type(exc).__name__})"
    finally:
        engine.store.close()


def serve_trial(saved: Saved, home: Path, damaged: str) -> str:
    """A real `tqstore serve` over `home`, the prompt as token ids, judged on the text it samples:
    it returns no logits, and greedy text from a random-weight model is often the same whatever
    the context (it was, for every restored length, here), while 12 tokens drawn at temperature 1
    with a fixed seed follow the whole distribution of every step."""
    server = ServerProcess(home, saved.folder, "--scheme", SCHEME)
    try:
        status, _, body = request(server, "POST", "/v1/completions",
                                  {"prompt": saved.prompt, "max_tokens": MAX_TOKENS, "temperature": SAMPLING["temp"],
                                   "seed": SAMPLING["seed"]})
    finally:
        server.stop()
    if status != 200:  # a tqstore error's type and message, never "internal error"
        assert body["error"]["message"] and body["error"]["code"] != "internal_error", body
        return f"clean error (HTTP {status} {body['error']['code']})"
    cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]
    return saved.judge(Answer((), body["choices"][0]["text"], None, cached, sampled=True), damaged)


def lmdb_trials(saved: Saved, tmp_path: Path, damages: list[tuple[str, int]], ledger, scenario: str,
                via: str = "ask") -> list[str]:
    """One trial per (object, payload position): a copy of the origin home with that byte
    flipped, answered through `via` ("ask" or "serve")."""
    outcomes = []
    for n, (what, position) in enumerate(damages):
        home = tmp_path / f"trial-{via}-{n}"
        shutil.copytree(saved.home, home)
        flip_lmdb_byte(home, saved.keys[what], position)
        outcome = ask_trial(saved, home, what) if via == "ask" else serve_trial(saved, home, what)
        ledger.count(scenario, outcome)
        outcomes.append(f"{what}@{position}: {outcome}")
        shutil.rmtree(home)
    return outcomes


def push(saved: Saved, s3, what: str) -> tuple[str, int, int]:
    """Push the entry (again: a no-op once it is there); where its object `what` lies in the
    bucket: (bucket key, start, end) of a pack's range (or a whole layout-1 object)."""
    origin = open_store(saved.home, **s3_settings(s3))
    try:
        origin.push(NAME)
        return s3.where(origin._tiers.s3, NAME, saved.keys[what])
    finally:
        origin.close()


@contextmanager
def damaged_in_bucket(saved: Saved, s3, what: str, position: int) -> Iterator[None]:
    """The entry in the bucket with one byte of object `what` flipped where it lies (the pack's
    metadata, and the manifest's sha256, kept: bit rot); the good pack put back afterwards."""
    key, start, end = push(saved, s3, what)
    head = s3.client.head_object(Bucket=s3.bucket, Key=key)
    original = s3.client.get_object(Bucket=s3.bucket, Key=key)["Body"].read()
    assert 0 <= position < end - start
    bad = bytearray(original)
    bad[start + position] ^= 0xFF
    s3.client.put_object(Bucket=s3.bucket, Key=key, Body=bytes(bad), Metadata=head["Metadata"])
    try:
        yield
    finally:
        s3.client.put_object(Bucket=s3.bucket, Key=key, Body=original, Metadata=head["Metadata"])


def s3_trials(saved: Saved, s3, tmp_path: Path, damages: list[tuple[str, int]], ledger, scenario: str,
              via: str = "ask") -> list[str]:
    """Per trial one byte of one bucket object flipped, and the prompt answered from an empty
    home through a remote lookup (`Engine.generate`, or a `tqstore serve` over that home)."""
    outcomes = []
    for n, (what, position) in enumerate(damages):
        home = tmp_path / f"s3-{via}-{n}"
        with damaged_in_bucket(saved, s3, what, position):
            outcome = _remote_generate(saved, home, s3, what) if via == "ask" else serve_trial(saved, home, what)
        ledger.count(scenario, outcome)
        outcomes.append(f"{what}@{position}: {outcome}")
    return outcomes


def _remote_generate(saved: Saved, home: Path, s3, damaged: str) -> str:
    engine = saved.engine(home, **s3_settings(s3))
    try:
        return saved.judge(Answer.of(engine.generate(saved.loaded, SCHEME, saved.prompt, max_tokens=MAX_TOKENS)),
                           damaged)
    except TqstoreError as exc:
        assert str(exc), "a tqstore error without a message"
        return f"clean error ({type(exc).__name__})"
    finally:
        engine.store.close()


def random_damages(saved: Saved, rng: random.Random, n: int) -> list[tuple[str, int]]:
    """n (object, position) pairs: objects drawn by their size (as random bit rot hits them)."""
    sizes = {what: object_size(saved.home, key) for what, key in saved.keys.items()}
    names = list(sizes)
    picks = rng.choices(names, weights=[sizes[w] for w in names], k=n)
    return [(what, rng.randrange(sizes[what])) for what in picks]


def middle_of(saved: Saved, what: str) -> tuple[str, int]:
    return what, object_size(saved.home, saved.keys[what]) // 2


def assert_no_wrong(outcomes: list[str]) -> None:
    wrong = [o for o in outcomes if "WRONG" in o]
    assert not wrong, "wrong answers after damage:\n" + "\n".join(wrong)


def test_an_entry_with_nothing_restorable_answers_from_a_cold_prefill(saved_by_family, tmp_path, ledger):
    """Block 0, the window or the codecs damaged in every tier: `ask` and `serve` answer as a
    cold run does, 0 tokens reported cached (they failed with CorruptBlock, through the server a
    500, though the prompt's tokens were all there to compute)."""
    saved = saved_by_family("llama")
    outcomes = lmdb_trials(saved, tmp_path, [middle_of(saved, w) for w in ("block 0", "shared")], ledger,
                           "answers after damage, LMDB, llama, nothing restorable")
    outcomes += lmdb_trials(saved, tmp_path, [middle_of(saved, "window")], ledger,
                            "answers after damage, LMDB, llama, nothing restorable", via="serve")
    assert all(o.endswith("clean miss") for o in outcomes), outcomes


# -- the headline (issue 27, finding 1) ------------------------------------------------------------

def test_damage_to_the_second_block_gives_the_answer_of_the_first_block_and_says_so(saved, tmp_path, ledger):
    """One flipped byte in block 1, found in every tier: `ask` answers exactly as a never-damaged
    run that restored block 0 and prefilled the rest, and reports 256 tokens cached (it used to
    answer over a hole and report every token cached)."""
    home = tmp_path / "home"
    shutil.copytree(saved.home, home)
    flip_lmdb_byte(home, saved.keys["block 1"], object_size(home, saved.keys["block 1"]) // 2)
    outcome = ask_trial(saved, home, "block 1")
    ledger.count(f"answers after damage, LMDB, {saved.family}, ask", outcome)
    assert outcome == "clean miss"


@pytest.mark.parametrize("family", [pytest.param("llama", marks=pytest.mark.reliability_long), "qwen3_5"])
def test_damage_to_the_second_block_in_every_tier_through_the_server(family, saved_by_family, s3, tmp_path, ledger,
                                                                     monkeypatch):
    """The same through a real `tqstore serve` whose home and bucket both hold a damaged block 1:
    usage.prompt_tokens_details.cached_tokens is what was restored (256), and the answer is
    that context's (it said every token, over a hole). The server's path does not depend on the
    family: the short run starts one server, for the hybrid family. (The hybrid's caches, which
    hold the answer too, cannot be trimmed to the prompt: the server does not autosave them.)"""
    saved = saved_by_family(family)
    serve_from_bucket(s3, monkeypatch)
    home = tmp_path / "home"
    shutil.copytree(saved.home, home)
    where = middle_of(saved, "block 1")
    with damaged_in_bucket(saved, s3, *where):
        flip_lmdb_byte(home, saved.keys["block 1"], where[1])
        outcome = serve_trial(saved, home, "block 1")
    ledger.count(f"answers after damage, LMDB+S3, {saved.family}, serve", outcome)
    assert outcome == "clean miss"
    if family == "llama":  # the save policy stores the prompt it did not cover (it thought it had)
        store = open_store(home)
        try:
            assert [len(store.get(e.name).tokens) for e in store.ls() if e.name.startswith("auto-")] == \
                [len(saved.prompt) - 1]
        finally:
            store.close()


# -- the corruption runs, ending in answers ---------------------------------------------------------

def test_lmdb_damage_ends_in_right_answers_short(saved, tmp_path, ledger):
    """The other objects of the entry damaged in the middle, through `ask`: block 0 and the window
    and shared codecs leave nothing to restore from (clean errors), the last block a clean miss."""
    damages = [middle_of(saved, what) for what in saved.keys if what != "block 1"]
    assert_no_wrong(lmdb_trials(saved, tmp_path, damages, ledger, f"answers after damage, LMDB, {saved.family}, ask"))


def test_s3_damage_ends_in_right_answers_short(saved, s3, tmp_path, ledger):
    """The bucket's last block damaged, answered from an empty home through a remote lookup: the
    prefix before it restored, and the rest prefilled."""
    damages = [middle_of(saved, f"block {len(saved.manifest.blocks) - 1}")]
    outcomes = s3_trials(saved, s3, tmp_path, damages, ledger, f"answers after damage, S3, {saved.family}, ask")
    assert outcomes == [f"{w}@{p}: clean miss" for w, p in damages], outcomes


def serve_from_bucket(s3, monkeypatch) -> None:
    """The server subprocess reads the test bucket's settings from its environment."""
    for field, value in s3_settings(s3).items():
        monkeypatch.setenv("TQSTORE_" + field.upper(), str(value))


@pytest.mark.reliability_long
def test_damage_ends_in_right_answers_long(saved, s3, tmp_path, ledger, trials, monkeypatch):
    """Random positions in random objects (weighted by size): `trials` LMDB trials through `ask`,
    trials/4 bucket trials, and trials/20 of each through `tqstore serve`."""
    n = trials or 40
    rng = random.Random(f"2027-{saved.family}")
    outcomes = lmdb_trials(saved, tmp_path, random_damages(saved, rng, n), ledger,
                           f"answers after damage, LMDB, {saved.family}, ask")
    outcomes += lmdb_trials(saved, tmp_path, random_damages(saved, rng, max(1, n // 20)), ledger,
                            f"answers after damage, LMDB, {saved.family}, serve", via="serve")
    outcomes += s3_trials(saved, s3, tmp_path, random_damages(saved, rng, max(1, n // 4)), ledger,
                          f"answers after damage, S3, {saved.family}, ask")
    serve_from_bucket(s3, monkeypatch)  # only now: the LMDB trials' servers must have no good copy to fall back on
    outcomes += s3_trials(saved, s3, tmp_path, random_damages(saved, rng, max(1, n // 20)), ledger,
                          f"answers after damage, S3, {saved.family}, serve", via="serve")
    assert_no_wrong(outcomes)


def test_saving_again_after_a_shorter_restore_prefills_from_where_it_stopped(saved, tmp_path, ledger):
    """`tqstore save` again, the remedy the damage messages give: it restores block 0, prefills
    the rest (a hybrid from the recurrent state at token 256) and stores the whole entry again.
    It used to take the lookup's 566 tokens as restored, prefill nothing, and fail: TokenMismatch
    ("566 tokens were given for a snapshot holding 256") for llama, a bare ValueError from
    split_snapshot for the hybrid (its recurrent layers took 566, the attention layers held 256)."""
    home = tmp_path / "home"
    shutil.copytree(saved.home, home)
    flip_lmdb_byte(home, saved.keys["block 1"], object_size(home, saved.keys["block 1"]) // 2)
    engine = saved.engine(home)
    try:
        result = engine.save(NAME, DOCUMENT, model=str(saved.folder), scheme=SCHEME)
        assert (result.tokens, result.reused_tokens, result.new_blocks) == (saved.full, BLOCK_SIZE, 1)
        assert engine.store.verify() == []
        snap, stats = engine.store.load(NAME)
        assert snap.offset == stats.tokens == saved.full
    finally:
        engine.store.close()
    ledger.count(f"answers after damage, LMDB, {saved.family}, save again", "saved whole")


def test_a_chat_turn_after_a_shorter_restore_answers_from_it_and_stores_the_turn(saved, tmp_path, ledger):
    """A chat turn (`tqstore chat`) on the damaged entry: the answer of block 0's control, 256
    reported cached, and the finished turn stored as the child entry, whole."""
    home = tmp_path / "home"
    shutil.copytree(saved.home, home)
    flip_lmdb_byte(home, saved.keys["block 1"], object_size(home, saved.keys["block 1"]) // 2)
    engine = saved.engine(home)
    try:
        result = engine.chat_turn(NAME, QUESTION, "doc.turn-1", max_tokens=MAX_TOKENS)
        outcome = saved.judge(Answer.of(result), "block 1")
        child = engine.store.get("doc.turn-1")
        assert list(child.tokens) == saved.prompt + result.tokens
        assert engine.store.load("doc.turn-1")[0].offset == len(child.tokens)
    finally:
        engine.store.close()
    ledger.count(f"answers after damage, LMDB, {saved.family}, chat", outcome)
    assert outcome == "clean miss"
