"""The OpenAI-compatible HTTP API over one shared Runtime (FastAPI): chat and text completions, plain
and streamed (SSE, ending with `data: [DONE]`), the model list, health and Prometheus metrics."""

from __future__ import annotations

import asyncio
import json
import secrets
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import anyio
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from . import anthropic, errors, limits, tools
from .engine import SSE, Engine, Job, Outcome, collected, failure
from .errors import ApiError
from .metrics import Metrics
from .prompt import completion_prompt
from .schema import ChatRequest, CompletionRequest, Sampling


@dataclass
class Settings:
    """What the server was started with; `defaults` fill the sampling fields a request leaves out."""

    model_name: str
    api_key: str | None = None
    workers: int = 4
    queue: int = 16
    max_tokens: int = 256  # when a request names none (and it fits the context)
    defaults: dict | None = None  # temperature, top_p, top_k, seed, rule (the generate flags)
    prefix_cache: bool = True  # a new turn reuses the caches of the conversation so far (Runtime.prefix_cache)
    max_body_bytes: int = limits.MAX_BODY_BYTES  # a larger request body is answered 413, unread (limits.py)
    body_timeout: float = limits.BODY_TIMEOUT_S  # seconds a request body may pause before a 408
    tool_format: str = "auto"  # how the model writes tool calls: "auto" (from its chat template), "hermes", "llama3_json"


def model_name(runtime) -> str:
    target = runtime.info.get("target") or "hetero-sd"
    return Path(str(target)).name or str(target)


def create_app(runtime, settings: Settings | None = None, close_runtime: bool = False) -> FastAPI:
    settings = settings or Settings(model_name(runtime))
    metrics = Metrics(settings.model_name)
    engine = Engine(runtime, metrics, settings.workers, settings.queue)
    runtime.prefix_cache = settings.prefix_cache

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        # uvicorn has stopped taking requests and waited for those in flight (or its graceful timeout
        # cancelled them, which cancels their generations); stop the workers, then the device lanes.
        await anyio.to_thread.run_sync(engine.close, True)
        if close_runtime:
            runtime.close()

    app = FastAPI(title="hetero-sd", lifespan=lifespan)
    app.add_middleware(limits.BodyLimit, max_bytes=settings.max_body_bytes, idle_s=settings.body_timeout)
    app.state.engine, app.state.metrics, app.state.settings = engine, metrics, settings
    errors.install(app)

    def authorized(request: Request) -> None:
        if settings.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip(), settings.api_key):
            metrics.error(401)
            raise ApiError(401, "missing or wrong API key: send the header 'Authorization: Bearer KEY'",
                           None, "invalid_api_key")

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": settings.model_name, "in_flight": len(engine.jobs)}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.text(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models", dependencies=[Depends(authorized)])
    async def models():
        return {"object": "list", "data": [{"id": settings.model_name, "object": "model", "created": 0,
                                            "owned_by": "hetero-sd", "max_model_len": runtime.target.max_context}]}

    @app.post("/v1/chat/completions", dependencies=[Depends(authorized)])
    async def chat(body: ChatRequest, request: Request):
        max_tokens = body.max_completion_tokens or body.max_tokens
        plan = tools.ChatPlan(runtime, body, settings.tool_format)  # tools, tool_choice, response_format (tools.py)
        return await complete(request, body, "chat", plan.prompt, max_tokens, plan)

    @app.post("/v1/completions", dependencies=[Depends(authorized)])
    async def completions(body: CompletionRequest, request: Request):
        return await complete(request, body, "text", lambda: completion_prompt(runtime, body), body.max_tokens)

    async def complete(request: Request, body: Sampling, kind: str, prompt, max_tokens: int | None, plan=None):
        if body.model not in (None, settings.model_name, "default"):
            raise ApiError(404, f"model {body.model!r} is not served here; this server serves "
                                f"{settings.model_name!r}", "model", "model_not_found")
        loop = asyncio.get_running_loop()

        def start() -> tuple[Job, list[int]]:  # tokenizing and the runtime's checks, off the event loop
            ids = prompt()
            options = sampling_options(runtime, body, settings, len(ids), max_tokens)
            options.update(plan.options if plan is not None else {})  # a grammar the reply must follow
            return engine.admit(ids, options, body.stops(), loop, not body.ignore_eos), ids

        try:
            job, ids = await anyio.to_thread.run_sync(start)
        except ApiError as e:
            metrics.error(e.status)
            raise
        except errors.HeteroSDError as e:
            api = errors.from_hetero(e)
            metrics.error(api.status)
            raise api from None
        reply = Reply(kind, settings.model_name, len(ids), runtime, plan.calls if plan is not None else None)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return SSE(reply.sse(job, include_usage), job)
        return JSONResponse(await reply.whole(job, request))

    anthropic.install(app, runtime, settings, engine, metrics, sampling_options)  # /v1/messages
    return app


def sampling_options(runtime, body: Sampling, settings: Settings, prompt_len: int, max_tokens: int | None) -> dict:
    """The runtime's keywords for a request: its fields, else the server's defaults; the length checked
    against the context here, so that the error names the field at fault."""
    block = runtime.block_size if runtime.draft is not None else 1
    room = runtime.target.max_context - prompt_len - block
    if room < 1:
        raise ApiError(400, f"the prompt has {prompt_len} tokens; with a block of {block} the context of "
                            f"{runtime.target.max_context} leaves no room to generate; shorten the prompt",
                       "messages" if hasattr(body, "messages") else "prompt", "context_length_exceeded")
    if max_tokens is not None and max_tokens > room:
        raise ApiError(400, f"max_tokens {max_tokens} does not fit: the prompt has {prompt_len} tokens and the "
                            f"context {runtime.target.max_context} (block {block}) leaves {room}; ask for at most {room}",
                       "max_tokens", "context_length_exceeded")
    defaults = settings.defaults or {}
    options = dict(max_new_tokens=max_tokens or min(settings.max_tokens, room))
    for name in ("temperature", "top_p", "seed"):
        value = getattr(body, name)
        options[name] = defaults.get(name) if value is None else value
    options["top_k"] = defaults.get("top_k") if body.top_k is None else max(body.top_k, 0)  # -1: off
    if defaults.get("rule"):
        options["rule"] = defaults["rule"]
    extras = {name: getattr(body, name) for name in ("min_p", "repetition_penalty", "presence_penalty",
                                                     "frequency_penalty") if getattr(body, name) is not None}
    options.update(extras)  # the runtime's sampler applies them to the target's distribution (lossless)
    return {k: v for k, v in options.items() if v is not None}


class Reply:
    """OpenAI's response objects for one request: a whole completion, or its stream of chunks."""

    def __init__(self, kind: str, model: str, prompt_tokens: int, runtime, calls=None):
        self.kind, self.model, self.prompt_tokens, self.runtime = kind, model, prompt_tokens, runtime
        self.calls = calls  # tools.CallParser: the reply's tool calls parsed out of its text (None: text only)
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.object = "chat.completion" if kind == "chat" else "text_completion"

    def usage(self, outcome: Outcome) -> dict:
        cached = outcome.stats.num_cached_tokens if outcome.stats is not None else 0
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": outcome.tokens,
                "total_tokens": self.prompt_tokens + outcome.tokens,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def speculative(self, outcome: Outcome) -> dict | None:
        s = outcome.stats
        if s is None:
            return None
        info = self.runtime.info
        return {"mode": s.mode, "tau": s.tau, "acceptance_rate_per_position": s.acceptance_rate_per_position,
                "num_drafts": s.num_drafts, "num_draft_tokens": s.num_draft_tokens,
                "num_accepted_tokens": s.num_accepted_tokens, "draft_device": info.get("draft_device"),
                "target_device": info.get("target_device"), "block_size": s.block_size,
                "block_size_histogram": {str(k): v for k, v in s.block_size_histogram.items()},
                "drift": s.drift.to_dict() if s.drift else None, "fallback": s.fallback,
                "tokens_per_s": s.tokens_per_s, "ttft_s": s.ttft_s, "constrained": s.constrained}

    def finish(self, reason: str) -> str:
        return "tool_calls" if self.calls is not None and self.calls.calls and reason == "stop" else reason

    def choice(self, text: str, finish: str | None, stream: bool) -> dict:
        if self.kind == "text":
            return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        content = {"role": "assistant", "content": text} if not stream else ({"content": text} if text else {})
        return {"index": 0, ("delta" if stream else "message"): content, "logprobs": None, "finish_reason": finish}

    def envelope(self, choices: list, stream: bool, **extra) -> dict:
        obj = self.object + (".chunk" if stream and self.kind == "chat" else "")
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices,
                **extra}

    async def whole(self, job: Job, request: Request) -> dict:
        text, outcome = await collected(job, request)
        fail(outcome)
        choice = self.choice(text, outcome.reason, False)
        if self.calls is not None:
            content, self.calls.calls = self.calls.split(text)
            choice["message"] = {"role": "assistant", "content": content or None,
                                 "tool_calls": [c.openai() for c in self.calls.calls] or None}
            choice["finish_reason"] = self.finish(outcome.reason)
        return self.envelope([choice], False, usage=self.usage(outcome), speculative=self.speculative(outcome))

    async def sse(self, job: Job, include_usage: bool):
        if self.kind == "chat":  # the role first, as OpenAI does
            first = self.choice("", None, True)
            first["delta"] = {"role": "assistant", "content": ""}
            yield data(self.envelope([first], True))
        async for kind, value in job.items():
            if kind == "text":
                for delta in (self.calls.feed(value) if self.calls is not None else [None]):
                    chunk = self.choice(value, None, True)
                    if delta is not None:
                        chunk["delta"] = delta
                    yield data(self.envelope([chunk], True))
                continue
            outcome: Outcome = value
            for delta in (self.calls.finish() if self.calls is not None else []):  # what the parser held
                yield data(self.envelope([{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}], True))
            if outcome.reason in ("error", "cancelled"):
                error = failure(outcome)
                yield data(errors.body(error.status, error.message, error.param, error.code))
            else:
                yield data(self.envelope([self.choice("", self.finish(outcome.reason), True)], True, usage=self.usage(outcome),
                                         speculative=self.speculative(outcome)))
                if include_usage:
                    yield data(self.envelope([], True, usage=self.usage(outcome)))
        yield "data: [DONE]\n\n"


def data(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def fail(outcome: Outcome) -> None:
    if outcome.reason in ("error", "cancelled"):
        raise failure(outcome)
