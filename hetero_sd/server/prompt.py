"""Requests to token ids. A chat request's whole conversation (system, user and assistant turns) goes
through the runtime's chat template (hetero_sd/loading/templates.py): the server's --system-prompt when
the conversation has none, and the request's chat_template_kwargs over the server's
--chat-template-kwargs. A text completion's prompt is encoded as it is (or taken as token ids)."""

from __future__ import annotations

from hetero_sd.errors import InvalidArgumentError

from .errors import ApiError
from .schema import ChatRequest, CompletionRequest


def chat_prompt(runtime, body: ChatRequest) -> list[int]:
    messages = [{"role": m.role, "content": m.text()} for m in body.messages]
    try:
        options = runtime.chat_options.override(None, body.chat_template_kwargs)
        return runtime.encode(messages, True, options)[0]
    except InvalidArgumentError as e:  # the template's refusals, the kwargs' checks, ids outside the vocabulary
        param = "chat_template_kwargs" if "chat_template_kwargs" in e.problem else "messages"
        raise ApiError(400, f"{e.problem}; {e.fix}", param, "invalid_value") from None


def completion_prompt(runtime, body: CompletionRequest) -> list[int]:
    prompt = body.prompt
    if isinstance(prompt, list) and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str) and not prompt:
        raise ApiError(400, "prompt is empty; send the text to continue", "prompt", "invalid_value")
    try:
        return runtime.encode(prompt, chat=False)[0]
    except InvalidArgumentError as e:
        raise ApiError(400, f"{e.problem}; {e.fix}", "prompt", "invalid_value") from None
