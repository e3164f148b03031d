"""`tqstore save/ask/push/pull` on tiny-model folders of families beyond plain attention (issue
18): gpt_oss (attention sinks, compressed in memory), deepseek_v3 (MLA latents, compressed at
rest) and qwen3_5 (a hybrid: recurrent states native, attention compressed), through a real S3
server (moto). Before: gpt_oss stored an entry `ask` rejected ("attention
sinks are not supported over compressed storage"); deepseek_v3 failed at compress; qwen3_5 could not be saved at all ("cannot snapshot a ArraysCache")."""

from __future__ import annotations

import pytest

from model_folder import write_model_folder
from test_cli_s3 import DOC, bucket, tq  # noqa: F401 (fixtures)


@pytest.mark.parametrize("kind", ["gpt_oss", "deepseek_v3", "qwen3_5"])
def test_save_push_pull_ask_on_another_home(bucket, tq, tmp_path, kind):
    model = str(write_model_folder(tmp_path / f"tiny-{kind}", kind=kind))
    code, saved = tq("a", "save", "doc", "--model", model, "--prompt", DOC)
    assert code == 0 and saved["scheme"] == "turbo5v4"
    code, on_a = tq("a", "ask", "doc", "Who pays for delays?", "--max-tokens", "6")
    assert code == 0 and on_a["cached_tokens"] == saved["tokens"]
    code, pushed = tq("a", "push", "doc")
    assert code == 0 and pushed["entries"] == ["doc"]
    code, pulled = tq("b", "pull", "doc")
    assert code == 0 and pulled["entries"] == ["doc"]
    code, on_b = tq("b", "ask", "doc", "Who pays for delays?", "--max-tokens", "6")
    assert code == 0 and on_b["text"] == on_a["text"] and on_b["cached_tokens"] == saved["tokens"]
    code, raw = tq("a", "save", "raw", "--model", model, "--prompt", DOC, "--scheme", "raw")
    assert code == 0 and saved["bytes_written"] < raw["bytes_written"]
