"""Chat-template controls: a system prompt and the template's own keyword arguments (Qwen3's
`enable_thinking`: z-lab's Qwen3 drafts were trained on non-thinking answers, and thinking mode more
than halves their acceptance). Set per runtime (the CLI's --system-prompt / --chat-template-kwargs,
which the chat app and bench inherit) or per call (`generate(..., system_prompt=, chat_template_kwargs=)`)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from hetero_sd.errors import InvalidArgumentError

# The template call's own arguments: chat_template_kwargs may not override them.
RESERVED = {"conversation", "messages", "tokenize", "add_generation_prompt", "return_dict", "return_tensors",
            "continue_final_message", "tools", "documents", "chat_template"}


@dataclass(frozen=True)
class ChatOptions:
    system_prompt: str | None = None
    template_kwargs: dict = field(default_factory=dict)

    def override(self, system_prompt=None, chat_template_kwargs=None) -> "ChatOptions":
        """These options with a call's own (checked); None keeps the runtime's."""
        return chat_options(self.system_prompt if system_prompt is None else system_prompt,
                            self.template_kwargs if chat_template_kwargs is None else chat_template_kwargs)


def chat_options(system_prompt=None, chat_template_kwargs=None) -> ChatOptions:
    if system_prompt is not None and not isinstance(system_prompt, str):
        raise InvalidArgumentError(f"system_prompt must be a string, not {type(system_prompt).__name__}",
                                   "pass the system message as text")
    kwargs = {} if chat_template_kwargs is None else chat_template_kwargs
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        raise InvalidArgumentError(f"chat_template_kwargs must be a dict with string keys, not {kwargs!r}",
                                   'pass e.g. {"enable_thinking": false}')
    clash = sorted(RESERVED & set(kwargs))
    if clash:
        raise InvalidArgumentError(f"chat_template_kwargs may not set {', '.join(clash)} (the template call's own)",
                                   "remove them")
    return ChatOptions(system_prompt or None, dict(kwargs))


def parse_kwargs(text: str, flag: str = "--chat-template-kwargs") -> dict:
    """A JSON object typed on the command line."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise InvalidArgumentError(f"{flag} {text!r} is not valid JSON ({e.msg} at character {e.pos})",
                                   f"""pass a JSON object, e.g. {flag} '{{"enable_thinking": false}}'""") from None
    if not isinstance(value, dict):
        raise InvalidArgumentError(f"{flag} {text!r} is not a JSON object",
                                   f"""pass a JSON object, e.g. {flag} '{{"enable_thinking": false}}'""")
    return value


def chat_ids(tokenizer, messages: list[dict], options: ChatOptions) -> tuple[list[int], list[str]]:
    """Token ids of a conversation through the tokenizer's chat template; notes say what did not apply."""
    notes = []
    if options.system_prompt and not (messages and messages[0].get("role") == "system"):
        messages = [{"role": "system", "content": options.system_prompt}] + list(messages)
    template = tokenizer.chat_template
    if not template:
        if options.template_kwargs:
            raise InvalidArgumentError("this model's tokenizer has no chat template, so chat_template_kwargs "
                                       f"{sorted(options.template_kwargs)} cannot apply", "remove them")
        text = "\n".join(m["content"] for m in messages)
        return tokenizer.encode(text), ["the tokenizer has no chat template: prompt used as plain text"]
    unused = [k for k in options.template_kwargs if k not in str(template)]
    if unused:
        notes.append(f"chat_template_kwargs {unused} are not read by this model's chat template: no effect")
    try:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                            **options.template_kwargs)
    except Exception as e:  # jinja2's TemplateError and friends: the template refused these messages
        raise InvalidArgumentError(f"the chat template refused the conversation ({type(e).__name__}: {e})",
                                   "check the roles' order, the system prompt and chat_template_kwargs") from None
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids), notes
