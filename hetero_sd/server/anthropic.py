"""The Anthropic Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`) on the server's engine and
queue: system prompt, text / tool_use / tool_result blocks, tools and tool_choice (auto, any, tool, none),
stop_sequences, streaming events (message_start ... message_stop), usage, and Anthropic's error shape
({"type": "error", "error": {"type": ..., "message": ...}}).

A request becomes the OpenAI chat request it means (tool_use blocks -> an assistant turn's tool_calls,
tool_result blocks -> `role: tool` turns, tools' input_schema -> parameters) and goes through the same plan
(tools.py: the template renders the tools, a forced call is constrained by its schema, calls are parsed out
of the reply). Any model name is accepted (agents send their own) and the served model's name is returned.
The key comes as `x-api-key` (Anthropic's clients) or `Authorization: Bearer`."""

from __future__ import annotations

import asyncio
import json
import secrets
import uuid
from typing import Annotated, Literal, Union

import anyio
from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from . import errors
from .engine import SSE, collected, failure
from .errors import ApiError
from .schema import ChatRequest
from .tools import ChatPlan

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
               503: "overloaded_error"}


class Block(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    cache_control: dict | None = None  # accepted: the prefix cache reuses a conversation's caches anyway


class TextBlock(Block):
    type: Literal["text"]
    text: str
    citations: list | None = None


class ToolUseBlock(Block):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict


class ToolResultBlock(Block):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] | None = None
    is_error: bool | None = None

    def text(self) -> str:
        body = self.content if isinstance(self.content, str) else "".join(b.text for b in self.content or [])
        return f"Error: {body}" if self.is_error else body


Content = Annotated[Union[TextBlock, ToolUseBlock, ToolResultBlock], Field(discriminator="type")]


class Message(Block):
    role: Literal["user", "assistant"]
    content: str | list[Content]


class ToolDef(Block):
    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    description: str | None = None
    input_schema: dict
    type: Literal["custom"] | None = None


class ToolChoice(Block):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class JsonFormat(Block):
    type: Literal["json_schema"]
    schema_: dict = Field(alias="schema")


class OutputConfig(Block):
    format: JsonFormat | None = None  # structured output: enforced by a grammar (decoding/constrained.py)
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None  # accepted; no effect on this model


class Thinking(Block):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None
    display: str | None = None


class MessagesRequest(Block):
    model: str
    max_tokens: Annotated[int, Field(ge=1)]
    messages: Annotated[list[Message], Field(min_length=1)]
    system: str | list[TextBlock] | None = None
    stop_sequences: Annotated[list[Annotated[str, Field(min_length=1)]], Field(max_length=16)] | None = None
    stream: bool = False
    temperature: Annotated[float, Field(ge=0, allow_inf_nan=False)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)] | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None
    tools: Annotated[list[ToolDef], Field(max_length=128)] | None = None
    tool_choice: ToolChoice | None = None
    metadata: dict | None = None  # accepted (user_id): not used
    service_tier: str | None = None  # accepted: one tier here
    output_config: OutputConfig | None = None
    thinking: Thinking | None = None  # only "disabled": the served model's answers have no thinking blocks


class CountRequest(Block):
    model: str
    messages: Annotated[list[Message], Field(min_length=1)]
    system: str | list[TextBlock] | None = None
    tools: Annotated[list[ToolDef], Field(max_length=128)] | None = None
    tool_choice: ToolChoice | None = None


def chat_request(body: MessagesRequest | CountRequest) -> ChatRequest:
    """The OpenAI chat request this Messages request means."""
    messages = []
    if body.system:
        system = body.system if isinstance(body.system, str) else "".join(b.text for b in body.system)
        messages.append({"role": "system", "content": system})
    for i, m in enumerate(body.messages):
        blocks = [TextBlock(type="text", text=m.content)] if isinstance(m.content, str) else m.content
        text = "".join(b.text for b in blocks if isinstance(b, TextBlock))
        if m.role == "assistant":
            calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input)}}
                     for b in blocks if isinstance(b, ToolUseBlock)]
            if i == len(body.messages) - 1:
                raise ApiError(400, "the last message is the assistant's (a prefill to continue); this server "
                                    "answers after a user turn: end with a user message", "messages", None)
            messages.append({"role": "assistant", "content": text or None, **({"tool_calls": calls} if calls else {})})
            continue
        if any(isinstance(b, ToolUseBlock) for b in blocks):
            raise ApiError(400, f"messages[{i}]: tool_use blocks belong to assistant turns", "messages", None)
        for b in blocks:
            if isinstance(b, ToolResultBlock):
                messages.append({"role": "tool", "content": b.text(), "tool_call_id": b.tool_use_id})
        if text or not any(isinstance(b, ToolResultBlock) for b in blocks):
            messages.append({"role": "user", "content": text})
    fields = {"messages": messages}
    if body.tools:
        fields["tools"] = [{"type": "function", "function": {"name": t.name, "parameters": t.input_schema,
                                                             **({"description": t.description} if t.description else {})}}
                           for t in body.tools]
    choice = body.tool_choice
    if choice is not None:
        if choice.type == "tool" and not choice.name:
            raise ApiError(400, "tool_choice type 'tool' needs the tool's name", "tool_choice", None)
        fields["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(choice.type) or \
            {"type": "function", "function": {"name": choice.name}}
        if choice.disable_parallel_tool_use:
            fields["parallel_tool_calls"] = False
    if isinstance(body, MessagesRequest):
        if body.thinking is not None and body.thinking.type != "disabled":
            raise ApiError(400, f"thinking {body.thinking.type!r} is not served here: the model's answers have no "
                                "thinking blocks; send thinking {\"type\": \"disabled\"} or leave it out", "thinking", None)
        if body.output_config is not None and body.output_config.format is not None:
            fields["response_format"] = {"type": "json_schema", "json_schema": {
                "name": "output", "schema": body.output_config.format.schema_}}
        fields.update(max_tokens=body.max_tokens, stream=body.stream)
        for name in ("temperature", "top_p", "top_k"):
            if getattr(body, name) is not None:
                fields[name] = getattr(body, name)
        if body.stop_sequences:
            fields["stop"] = list(body.stop_sequences)
    try:
        return ChatRequest.model_validate(fields)
    except ValidationError as e:
        first = e.errors()[0]
        raise ApiError(400, f"{'.'.join(str(p) for p in first['loc'])}: {first['msg']}", None, None) from None


def error_response(e: ApiError) -> JSONResponse:
    kind = ERROR_TYPES.get(e.status, "api_error" if e.status >= 500 else "invalid_request_error")
    return JSONResponse({"type": "error", "error": {"type": kind, "message": e.message}}, status_code=e.status,
                        headers={"WWW-Authenticate": "Bearer"} if e.status == 401 else None)


def validation_error(e: ValidationError) -> ApiError:
    first = e.errors()[0]
    where = ".".join(str(p) for p in first.get("loc", ()) if not str(p).startswith(("function-", "literal[")))
    if first.get("type") == "extra_forbidden":
        return ApiError(400, f"{where}: unknown or unsupported field; remove it", None, None)
    return ApiError(400, f"{where or 'body'}: {first.get('msg')}", None, None)


def install(app, runtime, settings, engine, metrics, sampling_options) -> None:
    """Add the Messages API's routes to the app (sampling_options: app.py's, the length checks included)."""

    def check_key(request: Request) -> None:
        if settings.api_key is None:
            return
        key = request.headers.get("x-api-key")
        if key is None:
            scheme, _, token = request.headers.get("authorization", "").partition(" ")
            key = token.strip() if scheme.lower() == "bearer" else None
        if key is None or not secrets.compare_digest(key, settings.api_key):
            raise ApiError(401, "missing or wrong API key: send the header 'x-api-key: KEY'", None, None)

    async def parsed(request: Request, model):
        check_key(request)
        try:
            raw = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ApiError(400, f"the body is not valid JSON ({e})", None, None) from None
        try:
            return model.model_validate(raw)
        except ValidationError as e:
            raise validation_error(e) from None

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request):
        try:
            body = await parsed(request, CountRequest)
            plan = ChatPlan(runtime, chat_request(body), settings.tool_format)
            ids = await anyio.to_thread.run_sync(plan.prompt)
        except ApiError as e:
            metrics.error(e.status)
            return error_response(e)
        return {"input_tokens": len(ids)}

    @app.post("/v1/messages")
    async def messages(request: Request):
        loop = asyncio.get_running_loop()
        try:
            body = await parsed(request, MessagesRequest)
            chat = chat_request(body)
            plan = ChatPlan(runtime, chat, settings.tool_format)

            def start():
                ids = plan.prompt()
                options = sampling_options(runtime, chat, settings, len(ids), body.max_tokens)
                options.update(plan.options)
                return engine.admit(ids, options, chat.stops(), loop), ids

            job, ids = await anyio.to_thread.run_sync(start)
        except ApiError as e:
            metrics.error(e.status)
            return error_response(e)
        except errors.HeteroSDError as e:
            api = errors.from_hetero(e)
            metrics.error(api.status)
            return error_response(api)
        reply = Reply(settings.model_name, len(ids), plan)
        if body.stream:
            return SSE(reply.events(job), job)
        return await reply.whole(job, request)


def event(kind: str, obj: dict) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **obj}, separators=(',', ':'))}\n\n"


class Reply:
    def __init__(self, model: str, prompt_tokens: int, plan: ChatPlan):
        self.model, self.prompt_tokens, self.plan = model, prompt_tokens, plan
        self.id = "msg_" + uuid.uuid4().hex[:24]

    def stop_reason(self, outcome, called: bool) -> tuple[str, str | None]:
        if outcome.stop_sequence is not None:
            return "stop_sequence", outcome.stop_sequence
        if called:
            return "tool_use", None
        return ("max_tokens" if outcome.reason == "length" else "end_turn"), None

    def usage(self, outcome) -> dict:
        return {"input_tokens": self.prompt_tokens, "output_tokens": outcome.tokens}

    def speculative(self, outcome) -> dict | None:
        s = outcome.stats
        if s is None:
            return None
        return {"mode": s.mode, "tau": s.tau, "num_drafts": s.num_drafts, "num_draft_tokens": s.num_draft_tokens,
                "num_accepted_tokens": s.num_accepted_tokens, "tokens_per_s": s.tokens_per_s, "ttft_s": s.ttft_s,
                "constrained": s.constrained}

    async def whole(self, job, request: Request) -> JSONResponse:
        text, outcome = await collected(job, request)
        if outcome.reason in ("error", "cancelled"):
            return error_response(failure(outcome))
        calls = []
        if self.plan.calls is not None:
            text, calls = self.plan.calls.split(text)
        content = ([{"type": "text", "text": text}] if text else []) + [tool_use(c) for c in calls]
        reason, sequence = self.stop_reason(outcome, bool(calls))
        return JSONResponse({"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                             "content": content, "stop_reason": reason, "stop_sequence": sequence,
                             "usage": self.usage(outcome), "speculative": self.speculative(outcome)})

    async def events(self, job):
        yield event("message_start", {"message": {
            "id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": [],
            "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": self.prompt_tokens, "output_tokens": 0}}})
        yield event("ping", {})
        # one content block open at a time: "text", or the index of the tool call being streamed
        index, block, called = 0, None, False
        parser = self.plan.calls
        async for kind, value in job.items():
            if kind == "text":
                deltas = parser.feed(value) if parser is not None else [{"content": value}]
            else:
                outcome = value
                deltas = parser.finish() if parser is not None else []
            for delta in deltas:
                if "content" in delta and not delta["content"]:
                    continue
                for call in ([None] if "content" in delta else delta["tool_calls"]):
                    wanted = "text" if call is None else call["index"]
                    if block != wanted:
                        if block is not None:
                            yield event("content_block_stop", {"index": index})
                            index += 1
                        start = {"type": "text", "text": ""} if call is None else {
                            "type": "tool_use", "id": "toolu_" + call["id"].removeprefix("call_"),
                            "name": call["function"]["name"], "input": {}}
                        yield event("content_block_start", {"index": index, "content_block": start})
                        block, called = wanted, called or call is not None
                    if call is None:
                        yield event("content_block_delta", {"index": index, "delta": {"type": "text_delta",
                                                                                       "text": delta["content"]}})
                    elif call["function"].get("arguments"):
                        yield event("content_block_delta", {"index": index, "delta": {
                            "type": "input_json_delta", "partial_json": call["function"]["arguments"]}})
            if kind == "text":
                continue
            if block is not None:
                yield event("content_block_stop", {"index": index})
            if outcome.reason in ("error", "cancelled"):
                e = failure(outcome)
                yield event("error", {"error": {"type": ERROR_TYPES.get(e.status, "api_error"), "message": e.message}})
                return
            reason, sequence = self.stop_reason(outcome, called)
            yield event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": sequence},
                                          "usage": {"output_tokens": outcome.tokens},
                                          "speculative": self.speculative(outcome)})
            yield event("message_stop", {})


def tool_use(call) -> dict:
    return {"type": "tool_use", "id": "toolu_" + call.id.removeprefix("call_"), "name": call.name,
            "input": json.loads(call.arguments)}
