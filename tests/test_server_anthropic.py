"""The Anthropic Messages API of `tqstore serve` (issue 30), end to end: one real server
subprocess for the module (tiny random-weight model whose chat template renders tools in
Qwen's <tool_call> format, an API key), talked to with the real `anthropic` SDK and raw HTTP."""

from __future__ import annotations

import asyncio
import concurrent.futures
import http.client
import json

import anthropic
import pytest

from model_folder import write_model_folder
from server_process import ServerProcess, parse_prometheus, request
from tqstore.engine.engine import Engine
from tqstore.serve import anthropic_schema
from tqstore.serve.anthropic_schema import ToolFormat
from tqstore.serve.http import _message_stream
from tqstore.serve.jobs import Accepted, Finished
from tqstore.serve.openai_schema import Generation
from tqstore.serve.streams import JobEvents

KEY = "test-key-anthropic"
SYSTEM = ("You answer questions about contracts. The contract says the seller pays for delays. Clause seven covers "
          "delivery, payment and penalties. ") * 3
# Qwen2.5's way of rendering tools and tool calls, cut down: mlx-lm infers its json_tools parser
# from "<tool_call>" and "tool_call.name".
TOOL_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n{% if messages[0].role == 'system' %}{{ messages[0].content }}\n{% endif %}"
    "# Tools\n<tools>{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools>\n"
    "Return each call as JSON within <tool_call></tool_call> tags.<|im_end|>\n{% endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and tools %}"
    "{%- elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n</tool_response>"
    "<|im_end|>\n"
    "{%- elif message.role == 'assistant' %}<|im_start|>assistant\n{{ message.content }}"
    "{%- for tool_call in message.tool_calls or [] %}{%- if tool_call.function is defined %}"
    "{%- set tool_call = tool_call.function %}{% endif %}\n<tool_call>\n"
    "{\"name\": \"{{ tool_call.name }}\", \"arguments\": {{ tool_call.arguments | tojson }}}\n</tool_call>"
    "{%- endfor %}<|im_end|>\n"
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endif %}"
    "{%- endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CALL_HISTORY = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": [{"type": "text", "text": "Let me look."},
                                                  {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                                   "input": {"city": "Paris"}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                              "content": [{"type": "text", "text": "Sunny, 21 C"}]}]}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # Two layers, not eight: what is checked is the server's, and every decode step costs a quarter.
    folder = write_model_folder(tmp_path_factory.mktemp("anthropic") / "tiny-qwen2", kind="qwen2", num_hidden_layers=2)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TOOL_TEMPLATE}))
    return folder


@pytest.fixture(scope="module")
def server(tmp_path_factory, model_dir):
    srv = ServerProcess(tmp_path_factory.mktemp("anthropic-home") / "home", model_dir, "--save-min-tokens", "32",
                        "--max-body-bytes", "65536", api_key=KEY)
    yield srv
    assert srv.stop() == 0, srv.log()


@pytest.fixture
def client(server):
    return anthropic.Anthropic(base_url=server.base, api_key=KEY, max_retries=0, timeout=60)


def ask(client, content="Who pays for delays?", **options):
    options.setdefault("max_tokens", 8)
    return client.messages.create(model="claude-any-name", messages=[{"role": "user", "content": content}],
                                  extra_body={"temperature": 0}, **options)


def test_a_message_answers_with_anthropic_fields(client):
    m = ask(client)
    assert m.id.startswith("msg_") and m.type == "message" and m.role == "assistant"
    assert [b.type for b in m.content] == ["text"] and m.stop_reason in ("end_turn", "max_tokens")
    assert m.usage.output_tokens <= 8 and m.usage.input_tokens > 0 and m.usage.cache_read_input_tokens == 0


def test_a_stream_sends_anthropics_events_and_the_same_text(server, client):
    whole = ask(client, "Stream me", max_tokens=12)
    with client.messages.stream(model="x", max_tokens=12,
                                messages=[{"role": "user", "content": "Stream me"}]) as stream:
        final = stream.get_final_message()
    assert final.content[0].text == whole.content[0].text and final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request("POST", "/v1/messages", json.dumps({"max_tokens": 4, "stream": True, "messages": [
        {"role": "user", "content": "Stream me"}]}), {"x-api-key": KEY, "Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200 and response.getheader("Content-Type") == "text/event-stream"
    kinds = [line.split(b": ", 1)[1].strip().decode() for line in response.read().splitlines()
             if line.startswith(b"event: ")]
    assert kinds[:3] == ["message_start", "content_block_start", "ping"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[3:-3]) <= {"content_block_delta"}


def test_a_repeated_system_prompt_is_read_from_the_store(client):
    first = ask(client, "First question", system=SYSTEM)
    second = ask(client, "First question", system=SYSTEM)
    assert first.usage.cache_read_input_tokens == 0
    total = first.usage.input_tokens
    assert second.usage.cache_read_input_tokens == total - 1 and second.usage.input_tokens == 1
    assert second.content[0].text == first.content[0].text
    assert client.messages.count_tokens(model="x", system=SYSTEM, messages=[
        {"role": "user", "content": "First question"}]).input_tokens == total


def test_stop_sequences_end_with_stop_sequence(client):
    free = ask(client, "Say something long", max_tokens=16).content[0].text
    stop = free[len(free) // 2:len(free) // 2 + 2]
    m = ask(client, "Say something long", max_tokens=16, stop_sequences=[stop])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert m.content[0].text == free[:free.index(stop)]


def test_tools_and_tool_blocks_reach_the_chat_template(client):
    plain = client.messages.count_tokens(model="x", messages=CALL_HISTORY[:1]).input_tokens
    with_tools = client.messages.count_tokens(model="x", messages=CALL_HISTORY[:1], tools=[WEATHER]).input_tokens
    history = client.messages.count_tokens(model="x", messages=CALL_HISTORY, tools=[WEATHER]).input_tokens
    assert plain < with_tools < history
    m = client.messages.create(model="x", max_tokens=4, messages=CALL_HISTORY, tools=[WEATHER])
    assert m.content and m.usage.input_tokens + m.usage.cache_read_input_tokens == history


def test_a_tool_call_history_is_one_prompt_through_both_routes(server, client):
    """OpenAI clients send a call's arguments as a JSON string; the template must see the object,
    as the Anthropic route gives it (a string would be rendered encoded twice)."""
    openai_history = [CALL_HISTORY[0],
                      {"role": "assistant", "content": "Let me look.", "tool_calls": [
                          {"id": "toolu_1", "type": "function",
                           "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}]},
                      {"role": "tool", "tool_call_id": "toolu_1", "content": "Sunny, 21 C"}]
    tools = [{"type": "function", "function": {"name": WEATHER["name"], "description": WEATHER["description"],
                                               "parameters": WEATHER["input_schema"]}}]
    status, _, answer = request(server, "POST", "/v1/chat/completions",
                                {"messages": openai_history, "tools": tools, "max_tokens": 1})
    assert status == 200
    anthropic_count = client.messages.count_tokens(model="x", messages=CALL_HISTORY, tools=[WEATHER]).input_tokens
    assert answer["usage"]["prompt_tokens"] == anthropic_count
    broken = [*openai_history[:1], {**openai_history[1], "tool_calls": [
        {"id": "toolu_1", "type": "function", "function": {"name": "get_weather", "arguments": "{city: Paris"}}]}]
    status, _, answer = request(server, "POST", "/v1/chat/completions", {"messages": broken, "max_tokens": 1})
    assert status == 400 and "arguments is not JSON" in answer["error"]["message"]


def test_tool_calls_are_parsed_out_of_the_answer(tmp_path, model_dir):
    tokenizer = Engine.open(tmp_path / "home").model(str(model_dir)).tokenizer
    fmt = ToolFormat.of(tokenizer)
    assert fmt is not None and fmt.start == "<tool_call>"
    text, calls = fmt.split('Checking.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
                            '</tool_call><tool_call>not json</tool_call>', ({"type": "function", "function": WEATHER},))
    assert text == "Checking." and len(calls) == 1
    assert calls[0]["type"] == "tool_use" and calls[0]["name"] == "get_weather"
    assert calls[0]["input"] == {"city": "Oslo"}
    assert calls[0]["id"].startswith("toolu_")


def test_a_call_whose_json_is_no_call_is_dropped(tmp_path, model_dir):
    fmt = ToolFormat.of(Engine.open(tmp_path / "home").model(str(model_dir)).tokenizer)
    tools = ({"type": "function", "function": WEATHER},)
    for bad in ('42', '"get_weather"', 'null', '["get_weather", {"city": "Oslo"}]', '{"name": 5}', '{"arguments": {}}'):
        assert fmt.split(f"I will call it. <tool_call>\n{bad}\n</tool_call>", tools) == ("I will call it. ", []), bad


def _generation(text: str, stop_sequence: str | None = None) -> Generation:
    return Generation(text=text, finish_reason="stop", prompt_tokens=9, completion_tokens=5, cached_tokens=0,
                      tier="none", restore_seconds=0.0, prefill_seconds=0.0, generation_seconds=0.0,
                      stop_sequence=stop_sequence)


def _streamed(gen: Generation, fmt: ToolFormat) -> list[dict]:
    """The real stream function's events for a job that finishes with `gen` at once."""
    async def run():
        async def receive():  # a client that stays
            await asyncio.Event().wait()
        events = JobEvents(receive, texts=True)
        events.sink(Finished(gen))
        stream = _message_stream(events, "msg_1", "m", Accepted(prompt_tokens=9), fmt, ({"type": "function",
                                                                                        "function": WEATHER},))
        return [json.loads(chunk.decode().split("data: ", 1)[1]) async for chunk in stream]
    return asyncio.run(run())


def test_a_stream_whose_call_is_no_call_ends_with_message_stop(tmp_path, model_dir):
    fmt = ToolFormat.of(Engine.open(tmp_path / "home").model(str(model_dir)).tokenizer)
    events = _streamed(_generation("I will call it. <tool_call>\n42\n</tool_call>"), fmt)
    assert [e["type"] for e in events][-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert "".join(e["delta"].get("text", "") for e in events if e["type"] == "content_block_delta") == "I will call it. "
    assert events[-2]["delta"]["stop_reason"] == "end_turn"


def test_a_tool_use_stop_names_no_stop_sequence(tmp_path, model_dir):
    fmt = ToolFormat.of(Engine.open(tmp_path / "home").model(str(model_dir)).tokenizer)
    gen = _generation('a<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call> ', "STOP")
    tools = ({"type": "function", "function": WEATHER},)
    whole = anthropic_schema.message_response("msg_1", "m", gen, fmt, tools)
    assert whole["stop_reason"] == "tool_use" and whole["stop_sequence"] is None
    delta = _streamed(gen, fmt)[-2]["delta"]
    assert delta == {"stop_reason": "tool_use", "stop_sequence": None}
    plain = anthropic_schema.message_response("msg_1", "m", _generation("a ", "STOP"), fmt, tools)
    assert plain["stop_reason"] == "stop_sequence" and plain["stop_sequence"] == "STOP"


def test_errors_come_in_anthropics_shape_and_both_key_headers_work(server, client):
    with pytest.raises(anthropic.BadRequestError) as bad:
        client.messages.create(model="x", max_tokens=0, messages=[{"role": "user", "content": "hi"}])
    assert bad.value.status_code == 400 and bad.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=server.base, api_key="wrong", max_retries=0).messages.create(
            model="x", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
    body = {"max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    status, _, answer = request(server, "POST", "/v1/messages", body)
    assert status == 200 and answer["type"] == "message"
    status, _, answer = request(server, "POST", "/v1/messages", body, key=None,
                                headers={"x-api-key": KEY, "Host": "evil.example"})
    assert status == 403 and answer == {"type": "error", "error": {"type": "permission_error",
                                                                   "message": answer["error"]["message"]}}
    status, _, answer = request(server, "POST", "/v1/messages", {**body, "messages": [
        {"role": "user", "content": [{"type": "image", "source": {}}]}]}, key=None, headers={"x-api-key": KEY})
    assert status == 400 and answer["type"] == "error" and "messages" in answer["error"]["message"]
    status, _, answer = request(server, "POST", "/v1/messages", {**body, "system": "x" * 70000}, key=None,
                                headers={"x-api-key": KEY})
    assert status == 413 and answer["error"]["type"] == "request_too_large"


def test_concurrent_streams_get_what_they_get_alone(server, client):
    prompts = [f"Question number {i}?" for i in range(4)]
    alone = [ask(client, p, max_tokens=10).content[0].text for p in prompts]

    def stream(p):
        with client.messages.stream(model="x", max_tokens=10,
                                    messages=[{"role": "user", "content": p}]) as s:
            return "".join(s.text_stream)

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        assert list(pool.map(stream, prompts)) == alone
    status, _, text = request(server, "GET", "/metrics", key=None, headers={"x-api-key": KEY})
    samples = parse_prometheus(text)
    assert sum(v for k, v in samples.items() if k.startswith('tqstore_prefix_hits_total{api="anthropic"')) >= 8
