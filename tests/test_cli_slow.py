"""Real-model smoke tests of the command (on demand: pytest -m slow). They use the installed
qwen2.5-coder-0.5b (`tqstore model install qwen2.5-coder-0.5b`) and never download it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tqstore_cli import main as cli_main

pytestmark = pytest.mark.slow

MODEL = Path("~/.cache/tqstore/models/qwen2.5-coder-0.5b").expanduser()
CONTEXT = ("Project Falcon's deployment notes. The staging database is called heron-db and lives in "
           "eu-west-3. Deployments happen on Tuesdays after the 10:00 stand-up; Maria approves them. "
           "Rollbacks use the blue-green switch in the load balancer, never a database restore.")


@pytest.fixture
def tq(tmp_path, capsys):
    if not (MODEL / "config.json").exists():
        pytest.skip(f"needs the real model at {MODEL} (tqstore model install qwen2.5-coder-0.5b)")

    def run(*argv: str):
        capsys.readouterr()
        code = cli_main.main(["--home", str(tmp_path / "home"), *argv, "--json"])
        out, _ = capsys.readouterr()
        return code, json.loads(out)

    return run


def test_save_and_ask_with_the_real_model(tq):
    code, saved = tq("save", "falcon", "--model", str(MODEL), "--prompt", CONTEXT)
    assert code == 0 and saved["tokens"] > 50
    code, answer = tq("ask", "falcon", "Which day are deployments?", "--max-tokens", "24")
    assert code == 0 and answer["text"].strip() and answer["cached_tokens"] == saved["tokens"]
    assert answer["tier"] in ("memory", "lmdb") and answer["recorded_prefill_seconds"] > 0


def test_demo_with_the_real_model(tq):
    code, doc = tq("demo", "--model", str(MODEL), "--max-tokens", "24")
    assert code == 0 and doc["tokens"] > 400
    assert all(a["text"].strip() and a["cached_tokens"] == doc["tokens"] for a in doc["answers"])
