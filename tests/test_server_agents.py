"""The server for agents, over HTTP on 127.0.0.1 with the official clients: `response_format` (json_object,
json_schema) whose replies validate and equal the runtime's constrained output; tools rendered by a Qwen-style
template, forced calls (named, required) that follow their function's schema, plain and streamed; `role: tool`
turns; the Anthropic Messages API (text, streaming events, tool_use / tool_result, stop_sequences, errors);
and /metrics split by constrained / free output."""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import openai
import pytest

import hetero_sd
from hetero_sd.server.tools import HERMES, LLAMA3, CallParser, render, tool_format
from hetero_sd.server.schema import ChatRequest

from .structured import QWEN_TEMPLATE, make_json_draft, make_json_target
from .test_server import Live

MODEL = "tiny"
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                                    "unit": {"enum": ["c", "f"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}},
                                       "required": ["zone"], "additionalProperties": False}}}
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def runtime(tmp_path_factory):
    target = make_json_target(tmp_path_factory.mktemp("agent-target"))
    draft = make_json_draft(tmp_path_factory.mktemp("agent-draft"), target)
    rt = hetero_sd.load(str(target), str(draft), block_size="fixed", cpu_threads=1)
    yield rt
    rt.close()


@pytest.fixture(scope="module")
def live(runtime):
    server = Live(runtime, api_key="sekret")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(live):
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key="sekret", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def claude(live):
    return anthropic.Anthropic(base_url=live.url, api_key="sekret", max_retries=0, timeout=60)


def test_json_schema_response_validates_and_equals_the_runtime(runtime, client):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=64, temperature=0, response_format=fmt)
    text = r.choices[0].message.content
    jsonschema.validate(json.loads(text), PERSON)
    want = runtime.generate(runtime.encode(ASK)[0], max_new_tokens=64, stop_at_eos=True, json_schema=PERSON)
    assert text == want.text and r.choices[0].finish_reason == "stop"
    spec = r.model_extra["speculative"]
    assert spec["constrained"]["kind"] == "json_schema" and spec["num_drafts"] > 0
    streamed = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=64, temperature=0,
                                              response_format=fmt, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == text


def test_json_object_response_is_an_object(runtime, client):
    """json_object: the reply is the runtime's output under {"type": "object"} (the random target may run past
    max_tokens inside a string; when it ends, it is a JSON object)."""
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=96, temperature=0,
                                       response_format={"type": "json_object"})
    want = runtime.generate(runtime.encode(ASK)[0], max_new_tokens=96, stop_at_eos=True, json_schema={"type": "object"})
    text = r.choices[0].message.content
    assert text == want.text and text.startswith("{")
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)


def test_a_named_tool_choice_forces_a_call_that_follows_the_schema(client):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=96, temperature=0, tools=[WEATHER, TIME],
                                       tool_choice=choice)
    msg = r.choices[0]
    assert msg.finish_reason == "tool_calls" and len(msg.message.tool_calls) >= 1
    call = msg.message.tool_calls[0]
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    streamed = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=96, temperature=0,
                                              tools=[WEATHER, TIME], tool_choice=choice, stream=True)
    calls, finish = {}, None
    for chunk in streamed:
        if not chunk.choices:
            continue
        for d in chunk.choices[0].delta.tool_calls or []:
            calls.setdefault(d.index, {"name": "", "arguments": ""})
            calls[d.index]["name"] += d.function.name or ""
            calls[d.index]["arguments"] += d.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert calls[0] == {"name": "get_weather", "arguments": call.function.arguments}


def test_required_tool_choice_without_parallel_calls_makes_exactly_one(client):
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=96, temperature=0, tools=[WEATHER, TIME],
                                       tool_choice="required", parallel_tool_calls=False)
    calls = r.choices[0].message.tool_calls
    assert len(calls) == 1 and calls[0].function.name in ("get_weather", "get_time")
    params = {"get_weather": WEATHER, "get_time": TIME}[calls[0].function.name]["function"]["parameters"]
    jsonschema.validate(json.loads(calls[0].function.arguments), params)


def test_tool_turns_are_rendered_by_the_template(runtime, client):
    turns = ASK + [{"role": "assistant", "content": None, "tool_calls": [{
        "id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees"}]
    ids = render(runtime, ChatRequest.model_validate({"messages": turns}), [WEATHER])
    text = runtime.tokenizer.decode(ids)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>' in text
    assert "<tool_response>\n21 degrees\n</tool_response>" in text and '"name": "get_weather"' in text.split("\n</tools>")[0]
    r = client.chat.completions.create(model=MODEL, messages=turns, max_tokens=8, temperature=0, tools=[WEATHER])
    assert r.usage.prompt_tokens == len(ids)


def test_tool_requests_that_cannot_be_honoured_are_refused(client):
    with pytest.raises(openai.BadRequestError, match="not in tools"):
        client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER],
                                       tool_choice={"type": "function", "function": {"name": "nope"}})
    with pytest.raises(openai.BadRequestError, match="needs tools"):
        client.chat.completions.create(model=MODEL, messages=ASK, tool_choice="required")
    with pytest.raises(openai.BadRequestError, match="cannot both"):
        client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], response_format={"type": "json_object"})
    with pytest.raises(openai.BadRequestError, match="not JSON"):
        client.chat.completions.create(model=MODEL, tools=[WEATHER], messages=ASK + [{"role": "assistant", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": "{oops"}}]}])


def test_a_template_without_tools_refuses_them(tiny_llama, tiny_draft):
    rt = hetero_sd.load(str(tiny_llama), str(tiny_draft), block_size="fixed", cpu_threads=1)
    server = Live(rt)
    try:
        r = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": ASK, "tools": [WEATHER]}, timeout=30)
        assert r.status_code == 400 and "does not render tools" in r.json()["error"]["message"]
    finally:
        server.stop()
        rt.close()


def accumulate(deltas: list[dict]) -> list[dict]:
    """A streaming client's view: each call's name and arguments joined by index."""
    calls: dict[int, dict] = {}
    for d in deltas:
        for c in d.get("tool_calls", []):
            call = calls.setdefault(c["index"], {"name": "", "arguments": ""})
            call["name"] += c["function"].get("name", "")
            call["arguments"] += c["function"].get("arguments", "")
    return [calls[i] for i in sorted(calls)]


def test_call_parsers_whole_and_streamed():
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}\n</tool_call>' \
           '\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "utc"}}\n</tool_call>'
    content, calls = CallParser(HERMES).split(text)
    assert content == "Let me check." and [c.name for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0].arguments) == {"city": "Oslo", "unit": "c"}
    for size in (1, 3, 7, len(text)):
        parser, deltas = CallParser(HERMES), []
        for i in range(0, len(text), size):
            deltas += parser.feed(text[i:i + size])
        deltas += parser.finish()
        assert "".join(d.get("content", "") for d in deltas).strip() == "Let me check."
        streamed = accumulate(deltas)
        assert streamed == [{"name": c.name, "arguments": c.arguments} for c in calls]
        if size == 1:  # the arguments came in pieces, as the model wrote them
            assert sum(1 for d in deltas if "tool_calls" in d) > 4
    cut = CallParser(HERMES)  # a reply that ends inside a call: what it wrote of the arguments
    deltas = cut.feed(text[:text.index('"unit"')]) + cut.finish()
    assert accumulate(deltas)[0] == {"name": "get_weather", "arguments": '{"city": "Oslo",'}
    assert CallParser(HERMES, parallel=False).split(text)[1][0].name == "get_weather"
    assert len(CallParser(HERMES, parallel=False).split(text)[1]) == 1
    assert CallParser(HERMES).split("no <tool_call> here") == ("no <tool_call> here", [])
    llama = '{"name": "get_time", "parameters": {"zone": "cet"}}'
    assert CallParser(LLAMA3).split(llama)[1][0].name == "get_time"
    parser = CallParser(LLAMA3)
    assert parser.feed(llama[:10]) == [] and parser.feed(llama[10:]) == []  # held: the reply may be a call
    assert parser.finish()[0]["tool_calls"][0]["function"]["name"] == "get_time"
    assert CallParser(LLAMA3).feed("Hello {x}") == [{"content": "Hello {x}"}]
    assert tool_format(QWEN_TEMPLATE) == HERMES and tool_format("{{ messages }}") is None
    assert tool_format('{%- if tools %}<|python_tag|>{"name": ..., "parameters": ...}{% endif %}') == LLAMA3


def test_anthropic_messages_plain_and_streamed(runtime, claude):
    want = runtime.generate(runtime.encode(ASK)[0], max_new_tokens=24, stop_at_eos=True)
    r = claude.messages.create(model="claude-any", max_tokens=24, messages=ASK, extra_body={"temperature": 0})
    assert r.content[0].type == "text" and r.content[0].text == want.text
    assert r.model == MODEL and r.usage.input_tokens == len(want.prompt_ids)
    assert r.usage.output_tokens == len(want.token_ids)
    assert r.stop_reason == ("max_tokens" if want.stats.finish_reason == "length" else "end_turn")
    with claude.messages.stream(model="claude-any", max_tokens=24, messages=ASK) as stream:
        assert "".join(stream.text_stream) == want.text
        final = stream.get_final_message()
    assert final.content[0].text == want.text and final.stop_reason == r.stop_reason


def test_anthropic_system_stop_sequences_and_errors(runtime, claude, live):
    full = claude.messages.create(model="m", max_tokens=24, system="Be brief.", messages=ASK)
    text = full.content[0].text
    stop = text[5:8]
    cut = claude.messages.create(model="m", max_tokens=24, system="Be brief.", messages=ASK,
                                 stop_sequences=[stop])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == text[:text.find(stop)]
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model="m", max_tokens=0, messages=ASK)
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=live.url, api_key="wrong", max_retries=0).messages.create(
            model="m", max_tokens=4, messages=ASK)
    with pytest.raises(anthropic.BadRequestError, match="thinking"):
        claude.messages.create(model="m", max_tokens=64, messages=ASK, thinking={"type": "enabled", "budget_tokens": 32})
    structured = claude.messages.create(model="m", max_tokens=64, messages=ASK,
                                        extra_body={"output_config": {"format": {"type": "json_schema", "schema": PERSON}}})
    jsonschema.validate(json.loads(structured.content[0].text), PERSON)
    assert structured.model_extra["speculative"]["constrained"]["kind"] == "json_schema"
    count = claude.messages.count_tokens(model="m", messages=ASK, system="Be brief.")
    assert count.input_tokens == full.usage.input_tokens


def test_anthropic_tool_use_and_tool_result(claude):
    tools = [{"name": "get_weather", "description": "The weather in a city",
              "input_schema": WEATHER["function"]["parameters"]}]
    r = claude.messages.create(model="m", max_tokens=96, messages=ASK, tools=tools,
                               tool_choice={"type": "tool", "name": "get_weather"})
    use = [b for b in r.content if b.type == "tool_use"]
    assert r.stop_reason == "tool_use" and len(use) >= 1 and use[0].name == "get_weather"
    jsonschema.validate(use[0].input, WEATHER["function"]["parameters"])
    with claude.messages.stream(model="m", max_tokens=96, messages=ASK, tools=tools,
                                tool_choice={"type": "tool", "name": "get_weather"}) as stream:
        final = stream.get_final_message()
    assert [b.input for b in final.content if b.type == "tool_use"][0] == use[0].input
    turns = ASK + [{"role": "assistant", "content": [{"type": "tool_use", "id": use[0].id, "name": "get_weather",
                                                       "input": use[0].input}]},
                   {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use[0].id,
                                                 "content": "21 degrees"}]}]
    after = claude.messages.create(model="m", max_tokens=8, messages=turns, tools=tools)
    assert after.usage.input_tokens > r.usage.input_tokens and after.content


def test_metrics_split_constrained_and_free(client, live):
    client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=8, temperature=0)
    client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=64, temperature=0,
                                   response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}})
    text = httpx.get(f"{live.url}/metrics").text
    for output in ("constrained", "free"):
        line = [l for l in text.splitlines() if l.startswith("hetero_sd:output_requests_total") and output in l]
        assert line and float(line[0].split()[-1]) >= 1
    masks = [l for l in text.splitlines() if l.startswith("hetero_sd:grammar_masks_total")]
    assert masks and float(masks[0].split()[-1]) > 0


def test_the_server_can_be_told_the_tool_call_format(runtime):
    """--tool-call-format llama3_json: a forced call is a bare JSON object with "parameters", parsed as such."""
    server = Live(runtime, tool_format="llama3_json")
    try:
        c = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
        r = c.chat.completions.create(model=MODEL, messages=ASK, max_tokens=96, tools=[WEATHER],
                                      tool_choice={"type": "function", "function": {"name": "get_weather"}})
        call = r.choices[0].message.tool_calls[0]
        assert call.function.name == "get_weather" and r.choices[0].message.content is None
        jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    finally:
        server.stop()
