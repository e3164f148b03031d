"""`tqstore save/ask/push/pull` on tiny-model folders of families beyond plain attention (issue
18): gpt_oss (attention sinks, compressed in memory) and deepseek_v3 (MLA latents, compressed at
rest), through a real S3 server (moto). Before: gpt_oss stored an entry `ask` rejected ("attention
sinks are not supported over compressed storage"); deepseek_v3 failed at compress."""

from __future__ import annotations

import json

import pytest

from model_folder import write_model_folder
from tqstore_cli import main as cli_main

DOC = ("The contract says the seller pays for delays. Clause seven covers delivery, payment and penalties. "
       "To abscond is to move in a mysterious way, commonly with the property of another.")


@pytest.fixture
def bucket(s3, monkeypatch):
    monkeypatch.setenv("TQSTORE_S3_URL", f"s3://{s3.bucket}/kv")
    monkeypatch.setenv("TQSTORE_S3_ENDPOINT", s3.endpoint)
    monkeypatch.setenv("TQSTORE_S3_REGION", "us-east-1")
    monkeypatch.setenv("TQSTORE_S3_MAX_ATTEMPTS", "2")
    for name in ("TQSTORE_HOME", "TQSTORE_BLAS"):
        monkeypatch.delenv(name, raising=False)
    return s3


@pytest.fixture
def tq(tmp_path, capsys):
    """tq(home, *argv) -> (exit code, parsed --json stdout, stderr)."""
    def run(home: str, *argv: str):
        capsys.readouterr()
        code = cli_main.main(["--home", str(tmp_path / home), *argv, "--json"])
        out, err = capsys.readouterr()
        assert "Traceback" not in out + err and "internal error" not in out + err, out + err
        return code, json.loads(out), err

    return run


@pytest.mark.parametrize("kind", ["gpt_oss", "deepseek_v3"])
def test_save_push_pull_ask_on_another_home(bucket, tq, tmp_path, kind):
    model = str(write_model_folder(tmp_path / f"tiny-{kind}", kind=kind))
    code, saved, err = tq("a", "save", "doc", "--model", model, "--prompt", DOC)
    assert code == 0 and saved["scheme"] == "turbo4"
    code, on_a, _ = tq("a", "ask", "doc", "Who pays for delays?", "--max-tokens", "6")
    assert code == 0 and on_a["cached_tokens"] == saved["tokens"]
    code, pushed, _ = tq("a", "push", "doc")
    assert code == 0 and pushed["entries"] == ["doc"]
    code, pulled, _ = tq("b", "pull", "doc")
    assert code == 0 and pulled["entries"] == ["doc"]
    code, on_b, _ = tq("b", "ask", "doc", "Who pays for delays?", "--max-tokens", "6")
    assert code == 0 and on_b["text"] == on_a["text"] and on_b["cached_tokens"] == saved["tokens"]
    code, raw, _ = tq("a", "save", "raw", "--model", model, "--prompt", DOC, "--scheme", "raw")
    assert code == 0 and saved["bytes_written"] < raw["bytes_written"]
