"""Requests to token ids. A chat request's whole conversation (system, user and assistant turns) goes
through the tokenizer's chat template, with the request's chat_template_kwargs (e.g. Qwen3's
enable_thinking); a text completion's prompt is encoded as it is (or taken as token ids)."""

from __future__ import annotations

from .errors import ApiError
from .schema import ChatRequest, CompletionRequest

# The template call's own arguments: a request may not override them through chat_template_kwargs.
RESERVED = {"conversation", "messages", "tokenize", "add_generation_prompt", "return_dict", "return_tensors",
            "continue_final_message", "tools", "documents"}


def chat_prompt(runtime, body: ChatRequest) -> list[int]:
    messages = [{"role": m.role, "content": m.text()} for m in body.messages]
    kwargs = body.chat_template_kwargs or {}
    clash = sorted(RESERVED & set(kwargs))
    if clash:
        raise ApiError(400, f"chat_template_kwargs may not set {', '.join(clash)}; remove them",
                       "chat_template_kwargs", "invalid_value")
    tokenizer = runtime.tokenizer
    if not tokenizer.chat_template:
        if kwargs:
            raise ApiError(400, "this model's tokenizer has no chat template, so chat_template_kwargs cannot "
                                "apply; remove them", "chat_template_kwargs", "invalid_value")
        return runtime.encode(messages)[0]  # the runtime's plain-text fallback (announced in its notes)
    try:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **kwargs)
    except Exception as e:  # the template rejected the conversation (e.g. roles out of order)
        raise ApiError(400, f"the chat template refused the messages: {e}", "messages", "invalid_value") from None
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    return runtime.encode(ids)[0]  # the runtime's checks: ids in the vocabulary, not empty


def completion_prompt(runtime, body: CompletionRequest) -> list[int]:
    prompt = body.prompt
    if isinstance(prompt, list) and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise ApiError(400, "prompt is empty; send the text to continue", "prompt", "invalid_value")
        return runtime.encode(prompt, chat=False)[0]
    return runtime.encode(prompt)[0]
