"""`tqstore chat`'s turn names: a turn belongs to one conversation base (a long NAME's shortened
turn names never land in another entry's turns), and concurrent chats on one entry never store
into the same turn name. The chats run in-process (`main(argv)`, as in test_cli.py); the
concurrent one is a real `tqstore chat` process started while this one holds its turn."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from model_folder import write_model_folder
from test_cli import clean_env, cli  # noqa: F401 (fixtures)

PINNED_BLAS = {"TQSTORE_BLAS": os.environ["TQSTORE_BLAS"]}  # set by conftest.py


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return str(write_model_folder(tmp_path_factory.mktemp("model") / "tiny-qwen2", num_hidden_layers=2))


def turns(out: str) -> list[tuple[str, str]]:
    """(name, parent) of each turn a `chat --json` printed."""
    return [(d["name"], d["parent"]) for d in map(json.loads, out.splitlines())]


def info(cli, name: str) -> dict:
    code, out, _ = cli("info", name, "--json")
    assert code == 0
    return json.loads(out)


def test_a_long_name_never_continues_or_writes_the_turns_of_its_shortened_prefix(cli, model):
    short = "s" * 121  # short.turn-1 is exactly 128 characters: a long name shortened to it used its turns
    long = short + "LONGNAM"
    cli("save", short, "--model", model, "--prompt", "SHORT entry: apples.", "-q")
    cli("save", long, "--model", model, "--prompt", "LONG entry: zebras.", "-q")
    code, out, _ = cli("chat", short, "--max-tokens", "2", "--json", stdin="q1\n")
    assert code == 0 and turns(out) == [(f"{short}.turn-1", short)]  # short names keep their turn names

    # --resume on the long name: it has no turns yet, so it continues the entry itself.
    code, out, _ = cli("chat", long, "--resume", "--max-tokens", "2", "--json", stdin="q2\n")
    [(name, parent)] = turns(out)
    assert code == 0 and parent == long
    assert name != f"{short}.turn-2" and len(name) <= 128 and name.endswith(".turn-1")
    assert info(cli, name)["metadata"]["chat.parent"] == long
    # A new conversation on the long name does not number after (or into) the short one's turns.
    code, out, _ = cli("chat", long, "--max-tokens", "2", "--json", stdin="q3\n")
    [(second, parent)] = turns(out)
    assert code == 0 and parent == long and second == name[:-len("1")] + "2"
    # Each --resume continues its own conversation; chatting a long name's turn keeps its numbering.
    code, out, _ = cli("chat", long, "--resume", "--max-tokens", "2", "--json", stdin="q4\n")
    assert code == 0 and turns(out) == [(name[:-len("1")] + "3", second)]
    code, out, _ = cli("chat", short, "--resume", "--max-tokens", "2", "--json", stdin="q5\n")
    assert code == 0 and turns(out) == [(f"{short}.turn-2", f"{short}.turn-1")]
    code, out, _ = cli("chat", name, "--max-tokens", "2", "--json", stdin="q6\n")
    assert code == 0 and turns(out) == [(name[:-len("1")] + "4", name)]
    code, out, _ = cli("ls", "--json")
    names = sorted(e["name"] for e in json.loads(out)["entries"])
    assert names == sorted([short, long, f"{short}.turn-1", f"{short}.turn-2"]
                           + [name[:-len("1")] + str(n) for n in range(1, 5)])


def _script() -> list[str]:
    script = Path(sys.executable).with_name("tqstore")
    return [str(script)] if script.exists() else [sys.executable, "-m", "tqstore_cli"]


def test_a_concurrent_chat_on_the_same_entry_never_stores_into_the_same_turn(cli, model, monkeypatch):
    """While this chat's first turn is being answered (its turn name not stored yet), another
    `tqstore chat` process on the same entry answers and stores a turn; then this chat goes on.
    Neither may store into a turn name the other stored (or is about to store)."""
    from tqstore.engine.engine import Engine

    cli("save", "c", "--model", model, "--prompt", "chat base", "-q")
    real_turn = Engine.chat_turn
    other: list[subprocess.CompletedProcess] = []

    def chat_turn(self, name, question, child, **kw):
        if not other:  # the other session runs, start to end, in the middle of our first turn
            env = {k: v for k, v in os.environ.items() if not k.startswith("TQSTORE_")} | PINNED_BLAS
            other.append(subprocess.run([*_script(), "--home", cli.home, "--json", "chat", "c", "--max-tokens", "1"],
                                        input="beta\n", capture_output=True, text=True, env=env, timeout=120))
        return real_turn(self, name, question, child, **kw)

    monkeypatch.setattr(Engine, "chat_turn", chat_turn)
    code, out, _ = cli("chat", "c", "--max-tokens", "1", "--json", stdin="alpha\nalpha2\n")
    [beta] = other
    assert code == 0 and beta.returncode == 0, beta.stderr
    ours, theirs = turns(out), turns(beta.stdout)
    assert theirs == [("c.turn-2", "c")]  # c.turn-1 was being answered here
    assert ours == [("c.turn-1", "c"), ("c.turn-3", "c.turn-1")]
    code, out, _ = cli("ls", "--json")
    assert [e["name"] for e in json.loads(out)["entries"]] == ["c", "c.turn-1", "c.turn-2", "c.turn-3"]
    # Each stored turn is the one its session said it stored.
    assert info(cli, "c.turn-2")["metadata"]["chat.parent"] == "c"
    assert info(cli, "c.turn-3")["metadata"]["chat.parent"] == "c.turn-1"
    assert info(cli, "c.turn-1")["tokens"] < info(cli, "c.turn-3")["tokens"]


def test_a_question_to_a_turn_asks_it_as_the_next_turn_does_and_turns_have_no_receipt(cli, model, tmp_path):
    """`ask NAME.turn-1` put the question inside the turn's answer (no user turn opened), so its
    tokens were not the next chat turn's; turns also copied their parent's quality receipt."""
    from tqstore.engine.engine import Engine

    cli("save", "doc", "--model", model, "--prompt", "A document about apples and pears. " * 12, "-q")
    assert info(cli, "doc")["quality"]["measured"]
    cli("chat", "doc", "--max-tokens", "3", "--json", stdin="first question\n")
    assert info(cli, "doc.turn-1")["quality"] == {"measured": False}
    engine = Engine.open(cli.home)
    asked = engine.ask("doc.turn-1", "second question", max_tokens=4)
    turned = engine.answerer.chat_turn("doc.turn-1", "second question", "doc.turn-2", max_tokens=4)
    assert asked.prompt_tokens == turned.prompt_tokens and asked.tokens == turned.tokens


def test_chat_with_stdin_closed_says_so(cli, model, monkeypatch):
    """`tqstore chat doc <&-` (a cron job) was an internal error: AttributeError on sys.stdin."""
    cli("save", "doc", "--model", model, "--prompt", "A document about apples.", "-q")
    monkeypatch.setattr(sys, "stdin", None)
    code, out, err = cli("chat", "doc")
    assert code == 1 and "stdin, which is closed" in err and "internal error" not in err


def test_an_expired_entry_whose_blocks_a_turn_keeps_is_not_called_unused(cli, model):
    """The note after asking an expired entry said its context was not used when a live chat
    turn of it had just restored most of it."""
    cli("save", "doc", "--model", model, "--prompt", "A document about apples and pears. " * 40, "--ttl", "1s", "-q")
    cli("chat", "doc", "--max-tokens", "2", "--json", stdin="first question\n")
    time.sleep(1.1)
    code, out, err = cli("ask", "doc", "Who pays?", "--max-tokens", "1")
    assert code == 0 and "came only from other entries sharing it" in err and "was not used" not in err
