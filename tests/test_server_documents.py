"""The `documents` extension of the OpenAI-compatible API: parsing without a server, then one
real server subprocess composing stored chunks."""

from __future__ import annotations

import pytest

from model_folder import write_model_folder
from server_process import ServerProcess, request
from tqstore.errors import BadInput
from tqstore.serve.openai_schema import ApiError, Generation, Sampling, completion_response, parse_generation
from tqstore.serve.prompts import documents_question

DEFAULTS = Sampling(max_tokens=16, temperature=0.0, top_p=1.0, seed=None, stop=())
A = "The contract says the seller pays for delays. Clause seven covers delivery and payment. " * 2
B = "The Devil's Dictionary defines words with wit. To abscond is to move in a mysterious way. " * 2


def test_documents_are_texts_or_stored_names_in_prompt_order():
    r = parse_generation({"messages": [{"role": "user", "content": "Who pays?"}],
                          "documents": ["text one", {"name": "contract"}, {"text": "two"}], "recompute": 0.3},
                         chat=True, defaults=DEFAULTS)
    assert r.documents == (("text", "text one"), ("name", "contract"), ("text", "two")) and r.recompute == 0.3
    assert parse_generation({"prompt": "q"}, chat=False, defaults=DEFAULTS).documents is None
    for body in ({"prompt": "q", "documents": []}, {"prompt": "q", "documents": [{"url": "x"}]},
                 {"prompt": "q", "documents": [{"name": "a", "text": "b"}]}, {"prompt": "q", "documents": "a"},
                 {"prompt": "q", "documents": ["a"], "recompute": 2}):
        with pytest.raises(ApiError) as caught:
            parse_generation(body, chat=False, defaults=DEFAULTS)
        assert caught.value.status == 400 and caught.value.param in ("documents", "recompute"), body


def test_the_question_is_the_prompt_or_the_last_user_message():
    chat = parse_generation({"messages": [{"role": "system", "content": "Be brief."},
                                          {"role": "user", "content": "Who pays?"}], "documents": ["d"]},
                            chat=True, defaults=DEFAULTS)
    assert documents_question(chat) == ("Be brief.", "Who pays?")
    assert documents_question(parse_generation({"prompt": "Q", "documents": ["d"]}, chat=False,
                                               defaults=DEFAULTS)) == (None, "Q")
    turns = parse_generation({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                                           {"role": "user", "content": "c"}], "documents": ["d"]},
                             chat=True, defaults=DEFAULTS)
    with pytest.raises(BadInput, match="one user message"):
        documents_question(turns)


def test_usage_reports_reused_and_recomputed_tokens_only_for_documents():
    from tqstore.serve.openai_schema import ResponseIds
    ids = ResponseIds("x", 0, "m", chat=False)
    plain = completion_response(ids, Generation("t", "stop", 10, 2, 5, "lmdb", 0.1, 0.2, 0.3))
    assert set(plain["usage"]["prompt_tokens_details"]) == {"cached_tokens"}
    composed = completion_response(ids, Generation("t", "stop", 10, 2, 5, "composed", 0.1, 0.2, 0.3, 5, 3))
    assert composed["usage"]["prompt_tokens_details"] == {"cached_tokens": 5, "reused_tokens": 5,
                                                          "recomputed_tokens": 3}


@pytest.mark.slow
def test_a_server_composes_stored_chunks_and_reports_what_it_reused(tmp_path):
    model = write_model_folder(tmp_path / "tiny-qwen2", kind="qwen2")
    server = ServerProcess(tmp_path / "home", model, "--max-tokens", "4")
    try:
        body = {"messages": [{"role": "user", "content": "Who pays?"}], "documents": [A, B], "recompute": 0.5,
                "max_tokens": 3}
        status, _, first = request(server, "POST", "/v1/chat/completions", body)
        assert status == 200, first
        details = first["usage"]["prompt_tokens_details"]
        # Both documents were prefilled by this request: nothing came from the store (was: the
        # reused count, then a lower bound where recomputed tokens fell in them).
        assert details["recomputed_tokens"] > 0 and details["reused_tokens"] == details["cached_tokens"] == 0
        status, _, caches = request(server, "GET", "/v1/caches")
        names = [c["name"] for c in caches["data"] if c["name"].startswith("chunk-")]
        assert len(names) == 2  # stored once each, by content
        again = {**body, "documents": [{"name": names[0]}, {"name": names[1]}][::-1], "recompute": 0}
        status, _, second = request(server, "POST", "/v1/chat/completions", again)
        assert status == 200, second
        details = second["usage"]["prompt_tokens_details"]
        recomputed_before = first["usage"]["prompt_tokens_details"]["recomputed_tokens"]
        assert details["recomputed_tokens"] == 0 and details["reused_tokens"] > recomputed_before
        assert details["cached_tokens"] == details["reused_tokens"]  # all restored from the store now
        status, _, missing = request(server, "POST", "/v1/completions", {"prompt": "Q", "documents": [{"name": "nope"}]})
        assert status == 404 and "nope" in missing["error"]["message"]
    finally:
        assert server.stop() == 0, server.log()
