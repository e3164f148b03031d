"""The `tqstore` command against a real S3 HTTP server (moto): save on home A, push, pull into an
empty home B, ask on B; the bucket's listing and removal; selftest's bucket check."""

from __future__ import annotations

import base64
import json

import pytest

from model_folder import write_model_folder
from tqstore_cli import main as cli_main

DOC = ("The contract says the seller pays for delays. Clause seven covers delivery, payment and penalties. "
       "To abscond is to move in a mysterious way, commonly with the property of another.")


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return str(write_model_folder(tmp_path_factory.mktemp("model") / "tiny-qwen2"))


@pytest.fixture
def bucket(s3, monkeypatch):
    """The moto bucket configured for tqstore through the environment, as a user would."""
    monkeypatch.setenv("TQSTORE_S3_URL", f"s3://{s3.bucket}/kv")
    monkeypatch.setenv("TQSTORE_S3_ENDPOINT", s3.endpoint)
    monkeypatch.setenv("TQSTORE_S3_REGION", "us-east-1")
    monkeypatch.setenv("TQSTORE_S3_MAX_ATTEMPTS", "2")
    monkeypatch.delenv("TQSTORE_HOME", raising=False)
    return s3


@pytest.fixture
def tq(tmp_path, capsys):
    """tq(home, *argv) -> (exit code, parsed --json stdout)."""
    def run(home: str, *argv: str):
        capsys.readouterr()
        code = cli_main.main(["--home", str(tmp_path / home), *argv, "--json"])
        out, err = capsys.readouterr()
        assert err == "" and "Traceback" not in out
        return code, json.loads(out)

    return run


def test_push_to_the_bucket_pull_into_an_empty_home_same_answer(bucket, tq, model):
    code, saved = tq("a", "save", "doc", "--model", model, "--prompt", DOC)
    assert code == 0
    _, on_a = tq("a", "ask", "doc", "Who pays for delays?", "--max-tokens", "6")
    code, pushed = tq("a", "push", "doc")
    assert code == 0 and pushed["entries"] == ["doc"] and pushed["transferred"] == pushed["objects"] == 3
    assert pushed["bytes"] > 0 and pushed["up_to_date"] == []
    _, again = tq("a", "push", "--all")
    assert again["transferred"] == 0 and again["skipped"] == 3 and again["up_to_date"] == ["doc"]

    code, missing = tq("b", "ask", "doc", "Who pays for delays?")
    assert code == 1 and "tqstore pull doc" in missing["error"]["message"]
    code, pulled = tq("b", "pull", "doc")
    assert code == 0 and pulled["entries"] == ["doc"] and pulled["transferred"] == 3 and pulled["evicted"] == []
    code, on_b = tq("b", "ask", "doc", "Who pays for delays?", "--max-tokens", "6")
    assert code == 0 and on_b["text"] == on_a["text"]  # greedy: the same answer on the other machine
    assert on_b["cached_tokens"] == saved["tokens"] and on_b["tier"] == "lmdb"
    assert on_b["recorded_prefill_seconds"] == pytest.approx(saved["recorded_prefill_seconds"])


def test_remote_listing_info_and_removal(bucket, tq, model):
    tq("a", "save", "doc", "--model", model, "--prompt", DOC)
    tq("a", "push", "doc")
    _, listed = tq("b", "ls", "--remote")
    assert [(e["name"], e["location"], e["tokens"] > 0) for e in listed["entries"]] == [("doc", "s3", True)]
    _, info = tq("b", "info", "doc", "--remote")
    assert info["name"] == "doc" and info["location"] == "s3" and info["scheme"] == "turbo5v4"
    code, removed = tq("b", "rm", "doc", "--remote")
    assert code == 0 and removed == {"removed": "doc", "location": "s3"}
    assert tq("b", "ls", "--remote")[1] == {"entries": [], "unreadable": []}
    code, gone = tq("b", "pull", "doc")
    assert code == 1 and "tqstore ls --remote" in gone["error"]["message"]
    code, gc = tq("b", "gc", "--remote")
    assert code == 0 and gc["remote_orphans"] == 0  # younger than the grace period: left to pushes in flight
    assert tq("a", "stats")[1]["tiers"]["s3"]["entries"] is not None


def test_the_bucket_is_counted_and_listed_as_it_is(bucket, tq, model):
    """A fresh process's stats counted the bucket as empty (what it had not listed yet), and an
    unreadable bucket manifest was left out of ls --remote without a word, and info --remote
    called it absent."""
    for name in ("doc", "other"):
        tq("a", "save", name, "--model", model, "--prompt", DOC + name)
        tq("a", "push", name)
    _, stats = tq("b", "stats")
    assert stats["tiers"]["s3"]["entries"] == 2 and stats["tiers"]["s3"]["bytes"] > 0
    bucket.client.put_object(Bucket=bucket.bucket, Key="kv/manifests/other.json", Body=b"{damaged")
    _, listed = tq("b", "ls", "--remote")
    assert [e["name"] for e in listed["entries"]] == ["doc"] and listed["unreadable"] == ["other"]
    code, info = tq("b", "info", "other", "--remote")
    assert code == 1 and "cannot be read" in info["error"]["message"] and "verify other --remote" in \
        info["error"]["message"]


def test_selftest_checks_the_bucket(bucket, tq, monkeypatch):
    code, report = tq("a", "selftest")
    s3 = next(c for c in report["checks"] if c["name"] == "s3")
    assert code == 0 and s3["status"] == "ok" and "credentials accepted" in s3["detail"]
    monkeypatch.setenv("TQSTORE_S3_URL", "s3://no-such-bucket/kv")
    code, report = tq("a", "selftest")
    s3 = next(c for c in report["checks"] if c["name"] == "s3")
    assert code == 1 and report["ok"] is False and s3["status"] == "fail" and "no-such-bucket" in s3["detail"]


def test_selftest_fails_on_a_key_the_bucket_cannot_use(bucket, tq, model, monkeypatch, tmp_path):
    """Before: selftest said the bucket was fine (exit 0) with an unreadable key file, a
    malformed key, another key than the prefix's, or none for an encrypted prefix."""
    key, other = base64.b64encode(bytes(range(32))).decode(), base64.b64encode(bytes(range(1, 33))).decode()
    monkeypatch.setenv("TQSTORE_S3_KEY", key)
    tq("a", "save", "doc", "--model", model, "--prompt", DOC)
    assert tq("a", "push", "doc")[0] == 0

    def s3_check():
        code, report = tq("b", "selftest")
        return code, next(c for c in report["checks"] if c["name"] == "s3")

    code, check = s3_check()
    assert code == 0 and check["status"] == "ok" and check["encryption"] == "TQSTORE_S3_KEY"
    for value, says in ((other, "another key"), ("not-base64!", "TQSTORE_S3_KEY")):
        monkeypatch.setenv("TQSTORE_S3_KEY", value)
        code, check = s3_check()
        assert code == 1 and check["status"] == "fail" and says in check["detail"], value
    monkeypatch.delenv("TQSTORE_S3_KEY")
    code, check = s3_check()
    assert code == 1 and check["status"] == "fail" and "is encrypted" in check["detail"]
    monkeypatch.setenv("TQSTORE_S3_KEY_FILE", str(tmp_path / "missing.key"))
    code, check = s3_check()
    assert code == 1 and check["status"] == "fail" and "missing.key" in check["detail"]


def test_verify_remote_of_a_name_the_bucket_lacks_is_not_found(bucket, tq):
    """Before: `verify nosuch --remote` said ok (exit 0) with `entries: ["nosuch"]`."""
    code, out = tq("a", "verify", "nosuch", "--remote")
    assert code == 1 and out["error"]["type"] == "NotFound" and "tqstore ls --remote" in out["error"]["message"]


def test_push_all_goes_on_past_an_entry_another_machine_pushed(bucket, tq, model):
    """Before: push --all stopped at the first conflicting entry (exit 1, only the error), so the
    entries after it in name order stayed local and those before it went up unreported."""
    tq("a", "save", "cf-b", "--model", model, "--prompt", DOC)
    assert tq("a", "push", "cf-b")[0] == 0
    for name, text in (("cf-a", DOC + " One."), ("cf-b", DOC + " Two."), ("cf-c", DOC + " Three.")):
        tq("b", "save", name, "--model", model, "--prompt", text)
    code, pushed = tq("b", "push", "--all")
    assert code == 1 and pushed["entries"] == ["cf-a", "cf-c"] and pushed["conflicts"] == ["cf-b"]
    assert any("cf-b" in warning for warning in pushed["warnings"])
    assert sorted(e["name"] for e in tq("b", "ls", "--remote")[1]["entries"]) == ["cf-a", "cf-b", "cf-c"]
