"""`tqstore chunk add` and `tqstore ask --doc ...` in-process (tiny model, temp home)."""

from __future__ import annotations

from test_cli import DOC, clean_env, cli, fails, model  # noqa: F401 (fixtures)

OTHER = "Clause seven covers delivery, payment and penalties. The seller pays for delays. " * 3


def test_chunk_add_then_ask_over_documents_in_any_order(cli, model, tmp_path):
    (tmp_path / "contract.txt").write_text(DOC)
    (tmp_path / "annex.txt").write_text(OTHER)
    run = cli("chunk", "add", str(tmp_path / "contract.txt"), str(tmp_path / "annex.txt"), "--model", model,
              "--json")
    assert run.code == 0, run.err
    added = run.json["chunks"]
    assert [c["name"] for c in added] == ["contract", "annex"] and all(c["stored"] for c in added)
    again = cli("chunk", "add", str(tmp_path / "contract.txt"), "--model", model, "--json")
    assert again.json["chunks"][0]["stored"] is False  # stored once
    listed = {e["name"] for e in cli("ls", "--json").json["entries"]}
    assert {"contract", "annex"} <= listed  # chunks are entries: listed, pinned, pushed like them
    for order in (["contract", "annex"], ["annex", "contract"]):
        docs = [a for name in order for a in ("--doc", name)]
        run = cli("ask", *docs, "Who pays for delays?", "--max-tokens", "3", "--recompute", "0.5", "--json")
        assert run.code == 0, run.err
        answer = run.json
        assert answer["documents"] == order and answer["stored_now"] == []
        assert answer["generation_tokens"] == 3
        total = answer["reused_tokens"] + answer["recomputed_tokens"]
        assert total == sum(c["tokens"] for c in added) and answer["recomputed_tokens"] > 0


def test_ask_with_a_document_file_stores_it_on_first_use(cli, model, tmp_path):
    (tmp_path / "new.txt").write_text(OTHER)
    assert cli("chunk", "add", str(tmp_path / "new.txt"), "--model", model, "--name", "base").code == 0
    (tmp_path / "more.txt").write_text(DOC)
    first = cli("ask", "--doc", "base", "--doc-file", str(tmp_path / "more.txt"), "Who pays?", "--max-tokens", "2",
                "--recompute", "0", "--json")
    assert first.code == 0, first.err
    assert len(first.json["stored_now"]) == 1 and first.json["recomputed_tokens"] == 0
    second = cli("ask", "--doc", "base", "--doc-file", str(tmp_path / "more.txt"), "Who pays?", "--max-tokens",
                 "2", "--recompute", "0", "--json")
    assert second.json["stored_now"] == [] and second.json["text"] == first.json["text"]


def test_bad_document_requests_say_what_is_wrong(cli, model, tmp_path):
    (tmp_path / "a.txt").write_text(DOC)
    cli("chunk", "add", str(tmp_path / "a.txt"), "--model", model)
    for value in ("1.5", "nan", "-0.1"):
        bad = cli("ask", "--doc", "a", "Q", "--recompute", value)
        assert bad.code == 2 and f"--recompute='{value}' is out of range" in bad.err
    extra = cli("ask", "--doc", "a", "Q", "extra")  # a usage error, exit 2 (was 1, as a BadInput)
    assert extra.code == 2 and "only the QUESTION" in extra.err
    fails(cli("ask", "--doc", "missing", "Q"), "missing")
    cli("save", "plain", "--model", model, "--prompt", DOC)
    fails(cli("ask", "--doc", "plain", "Q"), "not a document chunk")
    fails(cli("chunk", "add", str(tmp_path / "a.txt"), str(tmp_path / "a.txt"), "--name", "x", "--model", model),
          "one FILE")
    usage = cli("ask", "a")  # without --doc, QUESTION is required: a usage error
    assert usage.code == 2 and "QUESTION" in usage.err
    # Two different files with one stem were both reported stored while the second replaced the
    # first; they are refused before any prefill, and nothing is stored.
    for folder, text in (("x", DOC), ("y", OTHER)):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "doc.txt").write_text(text)
    fails(cli("chunk", "add", str(tmp_path / "x" / "doc.txt"), str(tmp_path / "y" / "doc.txt"), "--model", model),
          "would both be chunk doc")
    assert "doc" not in {e["name"] for e in cli("ls", "--json").json["entries"]}


def test_chunk_add_pin_pins_a_chunk_stored_already(cli, model, tmp_path):
    """Before: a chunk found stored was returned as it was, --pin ignored, and the LMDB budget
    then evicted the chunk the user had pinned."""
    (tmp_path / "a.txt").write_text(DOC)
    assert cli("chunk", "add", str(tmp_path / "a.txt"), "--model", model, "-q").code == 0
    assert cli("info", "a", "--json").json["pinned"] is False
    again = cli("chunk", "add", str(tmp_path / "a.txt"), "--model", model, "--pin", "--json")
    assert again.code == 0, again.err
    assert cli("info", "a", "--json").json["pinned"] is True
    assert again.json["chunks"][0]["stored"] is False and again.json["chunks"][0]["pinned"] is True
    cli("config", "set", "store.lmdb_budget", "16KiB")
    (tmp_path / "b.txt").write_text(OTHER)
    assert cli("chunk", "add", str(tmp_path / "b.txt"), "--model", model, "-q").code == 0
    assert "a" in {e["name"] for e in cli("ls", "--json").json["entries"]}  # b's put evicted nothing pinned


def test_new_documents_over_the_lmdb_budget_together_are_still_answered(cli, model, tmp_path):
    """Before: storing b evicted a, stored just before without its K/V kept, and reading a back
    failed with NotFound, every time."""
    (tmp_path / "a.txt").write_text("The Devil's Dictionary defines words with wit. To abscond is to move in a "
                                    "mysterious way, commonly with the property of another.\n")
    (tmp_path / "b.txt").write_text("The contract says the seller pays. Clause seven covers delivery, payment and "
                                    "penalties.\n")
    cli("config", "set", "store.lmdb_budget", "16KiB")
    run = cli("ask", "--doc-file", str(tmp_path / "a.txt"), "--doc-file", str(tmp_path / "b.txt"), "Who pays?",
              "--max-tokens", "2", "--model", model, "--json")
    assert run.code == 0, run.err
    assert len(run.json["stored_now"]) == 2 and run.json["generation_tokens"] == 2
    stored = {e["name"] for e in cli("ls", "--json").json["entries"]}
    assert run.json["stored_now"][1] in stored and run.json["stored_now"][0] not in stored  # a was evicted


def test_ask_says_which_documents_it_stored_and_counts_them_as_prefilled(cli, model, tmp_path):
    """Before: "39 tokens reused" for two documents this very command prefilled and stored, and at
    --recompute 1 every document token was counted both recomputed and prefilled."""
    (tmp_path / "a.txt").write_text(DOC)
    (tmp_path / "b.txt").write_text(OTHER)
    docs = ("--doc-file", str(tmp_path / "a.txt"), "--doc-file", str(tmp_path / "b.txt"))
    first = cli("ask", *docs, "Who pays?", "--max-tokens", "1", "--model", model)
    assert first.code == 0, first.err
    assert " 0 tokens reused" in first.err and "; stored now: chunk-" in first.err
    again = cli("ask", *docs, "Who pays?", "--max-tokens", "1", "--model", model, "--recompute", "1", "--json")
    assert again.json["stored_now"] == [] and again.json["reused_tokens"] == again.json["recomputed_tokens"] == 0
    assert again.json["prefilled_tokens"] == again.json["prompt_tokens"]


def test_an_empty_document_file_is_refused_and_nothing_is_stored(cli, model, tmp_path):
    """Before: `ask --doc-file empty.txt` stored a chunk of the separator tokens alone, while
    `chunk add empty.txt` refused the file."""
    (tmp_path / "empty.txt").write_text(" \n")
    (tmp_path / "a.txt").write_text(DOC)
    fails(cli("ask", "--doc-file", str(tmp_path / "a.txt"), "--doc-file", str(tmp_path / "empty.txt"), "Who pays?",
              "--max-tokens", "1", "--model", model), "empty")
    assert cli("ls", "--json").json["entries"] == []


def test_chunk_add_checks_every_name_before_storing_any(cli, model, tmp_path):
    """Before: `chunk add a.txt b.txt` stored a, then failed on b, an ordinary entry's name."""
    for stem in ("a", "b"):
        (tmp_path / f"{stem}.txt").write_text(DOC)
    assert cli("save", "b", "--model", model, "--prompt", DOC).code == 0
    fails(cli("chunk", "add", str(tmp_path / "a.txt"), str(tmp_path / "b.txt"), "--model", model),
          "entry 'b' exists and is not a document chunk")
    assert [e["name"] for e in cli("ls", "--json").json["entries"]] == ["b"]
