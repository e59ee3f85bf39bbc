"""Tool calls and structured output for chat requests (OpenAI's `tools`, `tool_choice`, `parallel_tool_calls`,
`response_format`; the Anthropic endpoint maps its own fields onto the same plan).

- The conversation, its tools and its `role: tool` turns are rendered by the target's own chat template (its
  `tools` argument); an assistant turn's calls are given to the template with their arguments as objects, as
  Hugging Face templates expect them.
- Calls are parsed out of the reply in the format the template teaches the model: Hermes-style
  `<tool_call>{"name": ..., "arguments": ...}</tool_call>` (Qwen-family templates), or Llama 3.x's bare JSON
  `{"name": ..., "parameters": ...}`. The format is chosen from the template's text; a template that renders
  no tools is refused with a 400 instead of a prompt that silently leaves them out.
- `tool_choice`: "auto" (the model decides; calls are parsed), "none" (the tools are left out of the prompt:
  a plain text answer), "required" or a named function: the call is forced by a grammar (the template's
  call markup around a JSON object that follows the function's parameter schema), enforced losslessly with
  the draft (hetero_sd/decoding/constrained.py). `parallel_tool_calls` false: one call at most (forced: exactly
  one; auto: the first is kept).
- `response_format` json_object / json_schema: the reply follows the schema (the same grammar machinery)."""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from hetero_sd.decoding.constrained import COMPACT, grammar_tokenizer
from hetero_sd.errors import InvalidArgumentError

from .errors import ApiError
from .prompt import chat_prompt
from .schema import ChatRequest

HERMES, LLAMA3 = "hermes", "llama3_json"
OPEN, CLOSE = "<tool_call>", "</tool_call>"
NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}


def tool_format(template: str | None) -> str | None:
    """The call format a chat template teaches, from its text (None: it renders no tools we can parse)."""
    if not template or "tools" not in template:
        return None
    if OPEN in template:
        return HERMES
    if "<|python_tag|>" in template or '"parameters"' in template or "ipython" in template:
        return LLAMA3
    return None


def call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


@dataclass
class Call:
    name: str
    arguments: str  # JSON text
    id: str = field(default_factory=call_id)

    def openai(self, index: int | None = None) -> dict:
        d = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return d if index is None else {"index": index, **d}


# the start of a Hermes call's JSON up to its arguments' value (its first character seen, so that the space
# before it is never taken for a part of it): what streaming needs to send the call's header
HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*(?=\S)')


def raw_arguments(body: str) -> str:
    """The arguments' text of a call body that follows HEADER: up to the object's closing brace."""
    body = body.rstrip()
    return body[:-1].rstrip() if body.endswith("}") else body


def parse_call(text: str, fmt: str) -> Call | None:
    """One call's JSON (None: not a call of this format). The arguments keep the model's own text where it is
    the arguments' JSON (as streaming sends it), else they are serialised."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        return None
    key = "arguments" if fmt == HERMES else "parameters"
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(key, obj.get("arguments", {}))
    if isinstance(args, str):  # some models write the arguments as JSON text
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    header = HEADER.match(text) if fmt == HERMES else None
    if header is not None:
        raw = raw_arguments(text[header.end():])
        try:
            if json.loads(raw) == args:
                return Call(obj["name"], raw)
        except json.JSONDecodeError:
            pass
    return Call(obj["name"], json.dumps(args, ensure_ascii=False))


class CallParser:
    """Splits a reply into text and calls, whole or as it streams. Streaming: text that could begin a call's
    markup is held until the next piece shows whether it does. A Hermes call whose JSON starts with its name
    is streamed as OpenAI does: a delta with its id and name once the name is complete, then its arguments'
    text as it comes (the tail that may be the call's closing brace held back); any other call is one delta
    once complete. Llama 3 calls (the whole reply) come at the end."""

    def __init__(self, fmt: str, parallel: bool = True):
        self.fmt, self.parallel = fmt, parallel
        self.held = ""  # text not yet released
        self.calls: list[Call] = []
        self.started = False  # any text released (Llama 3: a reply that starts as text is text)
        self.open: dict | None = None  # the call being streamed: its Call fields, where its arguments start, sent

    # -- whole replies
    def split(self, text: str) -> tuple[str, list[Call]]:
        if self.fmt == HERMES:
            calls, content, pos = [], [], 0
            for m in re.finditer(re.escape(OPEN) + r"(.*?)(?:" + re.escape(CLOSE) + r"|$)", text, re.S):
                call = parse_call(m.group(1).strip(), HERMES)
                if call is None:
                    continue  # markup that is no call stays text
                content.append(text[pos:m.start()])
                calls.append(call)
                pos = m.end()
            content.append(text[pos:])
            calls = calls if self.parallel else calls[:1]
            return "".join(content).strip() if calls else text, calls
        stripped = text.strip()
        calls = []
        if stripped.startswith("{"):
            for part in split_json(stripped):
                call = parse_call(part, LLAMA3)
                if call is None:
                    return text, []
                calls.append(call)
        calls = calls if self.parallel else calls[:1]
        return ("" if calls else text), calls

    # -- streams
    def feed(self, piece: str) -> list[dict]:
        """OpenAI deltas for a new piece of text: {"content": ...} and {"tool_calls": [...]}."""
        self.held += piece
        if self.fmt == LLAMA3:
            if not self.started and self.held.strip() and not self.held.lstrip().startswith("{"):
                self.started = True
            if self.started:
                out, self.held = self.held, ""
                return [{"content": out}] if out else []
            return []  # a reply that starts with "{" may be a call: held to the end
        deltas = []
        while True:
            start = self.held.find(OPEN)
            if start < 0:
                keep = partial_prefix(self.held, OPEN)
                text, self.held = self.held[:len(self.held) - keep], self.held[len(self.held) - keep:]
                if text:
                    deltas.append({"content": text})
                return deltas
            if start:
                deltas.append({"content": self.held[:start]})
                self.held = self.held[start:]
            end = self.held.find(CLOSE)
            if self.open is None and (self.parallel or not self.calls):
                header = HEADER.match(self.held, len(OPEN))
                if header is not None:  # the name is known: the call's header goes now
                    self.open = {"call": Call(json.loads(f'"{header.group(1)}"'), ""), "args": header.end(), "sent": 0}
                    self.calls.append(self.open["call"])
                    deltas.append({"tool_calls": [self.open["call"].openai(len(self.calls) - 1)]})
            if self.open is not None:
                deltas += self.arguments(end)
                if end < 0:
                    return deltas
                self.open = None
                self.held = self.held[end + len(CLOSE):]
                continue
            if end < 0:
                return deltas
            call = parse_call(self.held[len(OPEN):end].strip(), HERMES)  # held starts with the tag here
            if call is None:
                deltas.append({"content": self.held[:end + len(CLOSE)]})
            elif self.parallel or not self.calls:
                self.calls.append(call)
                deltas.append({"tool_calls": [call.openai(len(self.calls) - 1)]})
            self.held = self.held[end + len(CLOSE):]

    def arguments(self, end: int) -> list[dict]:
        """The streamed call's arguments not sent yet: all of them once its closing tag is in (end >= 0), else up
        to the last "}" (which may be the call's own closing brace)."""
        o = self.open
        avail = self.held[o["args"]:end] if end >= 0 else self.held[o["args"]:]
        upto = len(raw_arguments(avail)) if end >= 0 else max(avail.rfind("}"), 0)
        piece = avail[o["sent"]:upto]
        if not piece:
            return []
        o["sent"] = upto
        o["call"].arguments += piece
        return [{"tool_calls": [{"index": self.calls.index(o["call"]), "function": {"arguments": piece}}]}]

    def finish(self) -> list[dict]:
        """The deltas of what was held at the end of the reply."""
        if self.open is not None:  # the reply ended inside a streamed call (its length): what it wrote of it
            deltas = self.arguments(len(self.held))
            self.open, self.held = None, ""
            return deltas
        held, self.held = self.held, ""
        if not held:
            return []
        content, calls = self.split(held)
        if not self.parallel:
            calls = calls[:max(0, 1 - len(self.calls))]
        deltas = []
        for call in calls:
            self.calls.append(call)
            deltas.append({"tool_calls": [call.openai(len(self.calls) - 1)]})
        if content and not (calls and not content.strip()):
            deltas.insert(0, {"content": content})
        return deltas


def split_json(text: str) -> list[str]:
    """Consecutive JSON values (Llama 3 separates parallel calls with ';' or newlines)."""
    decoder, parts, i = json.JSONDecoder(), [], 0
    while i < len(text):
        while i < len(text) and text[i] in " \t\r\n;":
            i += 1
        if i >= len(text):
            break
        try:
            _, end = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return [text]
        parts.append(text[i:end])
        i = end
    return parts


def partial_prefix(text: str, tag: str) -> int:
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


@dataclass
class ChatPlan:
    """What a chat request becomes: its prompt ids (`prompt`, run off the event loop), the runtime's grammar
    options, and the parser of the reply's calls (None: plain text)."""

    runtime: object
    body: ChatRequest
    tool_format: str = "auto"  # the server's --tool-call-format: "auto" reads the template
    options: dict = field(default_factory=dict)  # json_schema= / grammar= for Runtime.stream
    calls: CallParser | None = None
    constrained: bool = False

    def prompt(self) -> list[int]:
        body, rt = self.body, self.runtime
        choice = body.tool_choice if body.tool_choice is not None else ("auto" if body.tools else "none")
        fmt_wanted = body.response_format is not None and body.response_format.type != "text"
        if body.tools and choice != "none" and fmt_wanted:
            raise ApiError(400, "response_format and tools with a tool_choice other than 'none' cannot both shape "
                                "the reply; send one of them", "response_format", "invalid_value")
        if choice != "none" and not body.tools:
            raise ApiError(400, f"tool_choice {describe(choice)} needs tools; send tools or drop tool_choice",
                           "tool_choice", "invalid_value")
        if fmt_wanted:
            self.options["json_schema"] = schema_of(body.response_format)
        tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools and choice != "none" else None
        if tools is None:
            if not any(m.tool_calls or m.role == "tool" for m in body.messages):
                ids = chat_prompt(rt, body)
                self.constrained = bool(self.options)
                return ids
        template = rt.tokenizer.chat_template
        fmt = tool_format(template if isinstance(template, str) else None)
        if self.tool_format != "auto" and template and "tools" in template:
            fmt = self.tool_format  # the server was told how this model writes its calls
        if fmt is None:
            raise ApiError(400, "this model's chat template does not render tools (no tool-call format found in it); "
                                "serve a model whose template has tools, or send no tools", "tools" if body.tools
                           else "messages", "invalid_value")
        ids = render(rt, body, tools)
        if tools is not None:
            parallel = body.parallel_tool_calls is not False
            if choice == "auto":
                self.calls = CallParser(fmt, parallel)
            else:
                names = [t["function"]["name"] for t in tools]
                wanted = names if choice == "required" else [choice.function.name]
                if wanted[0] not in names:
                    raise ApiError(400, f"tool_choice names function {wanted[0]!r}, which is not in tools "
                                        f"({', '.join(names)})", "tool_choice", "invalid_value")
                functions = [t["function"] for t in tools if t["function"]["name"] in wanted]
                self.options["grammar"] = forced_grammar(rt, fmt, functions, parallel)
                self.calls = CallParser(fmt, parallel)
        self.constrained = bool(self.options)
        return ids


def describe(choice) -> str:
    return repr(choice) if isinstance(choice, str) else f"function {choice.function.name!r}"


def schema_of(fmt) -> dict:
    if fmt.type == "json_object":
        return {"type": "object"}
    if fmt.json_schema is None:
        raise ApiError(400, "response_format type 'json_schema' needs its json_schema object (name, schema)",
                       "response_format", "invalid_value")
    return fmt.json_schema.schema_


def template_messages(body: ChatRequest) -> list[dict]:
    """OpenAI messages as chat templates read them: a call's arguments as an object, a tool turn's call id."""
    out = []
    for i, m in enumerate(body.messages):
        d = {"role": m.role, "content": m.text()}
        if m.tool_calls:
            calls = []
            for c in m.tool_calls:
                try:
                    args = json.loads(c.function.arguments)
                except json.JSONDecodeError as e:
                    raise ApiError(400, f"messages[{i}].tool_calls: the arguments of {c.function.name!r} are not JSON "
                                        f"({e.msg}); send them as a JSON object's text", "messages",
                                   "invalid_value") from None
                calls.append({"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": args}})
            d["tool_calls"] = calls
        if m.role == "tool":
            d["tool_call_id"] = m.tool_call_id
        out.append(d)
    return out


def render(rt, body: ChatRequest, tools: list[dict] | None, messages: list[dict] | None = None) -> list[int]:
    """The conversation through the template with its tools (the server's system prompt and template kwargs
    apply as for plain chat: prompt.py)."""
    messages = template_messages(body) if messages is None else messages
    try:
        options = rt.chat_options.override(None, getattr(body, "chat_template_kwargs", None))
    except InvalidArgumentError as e:
        raise ApiError(400, f"{e.problem}; {e.fix}", "chat_template_kwargs", "invalid_value") from None
    if options.system_prompt and not (messages and messages[0]["role"] == "system"):
        messages = [{"role": "system", "content": options.system_prompt}] + messages
    try:
        ids = rt.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True,
                                               **options.template_kwargs)
    except Exception as e:  # jinja2's errors: the template refused this conversation
        raise ApiError(400, f"the chat template refused the conversation ({type(e).__name__}: {e}); check the "
                            "roles' order and the tool turns", "messages", "invalid_value") from None
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    try:
        return rt.encode(ids, chat=False)[0]
    except InvalidArgumentError as e:
        raise ApiError(400, f"{e.problem}; {e.fix}", "messages", "invalid_value") from None


def forced_grammar(rt, fmt: str, functions: list[dict], parallel: bool) -> str:
    """A Lark grammar (llguidance's dialect) for one call (or several, when parallel) of these functions, in
    the template's markup, each call's JSON following its function's parameters."""
    key = "arguments" if fmt == HERMES else "parameters"
    schemas = [{"type": "object", "properties": {"name": {"const": f["name"]},
                                                 key: f.get("parameters") or NO_ARGUMENTS},
                "required": ["name", key], "additionalProperties": False} for f in functions]
    schema = dict(schemas[0] if len(schemas) == 1 else {"anyOf": schemas}, **{"x-guidance": COMPACT})
    body = f"%json {json.dumps(schema)}"
    if fmt == LLAMA3:
        return f"start: call\ncall: {body}\n"
    call = f"{tag(rt, OPEN)} \"\\n\" json \"\\n\" {tag(rt, CLOSE)}"
    start = 'call ("\\n" call)*' if parallel else "call"
    return f"start: {start}\ncall: {call}\njson: {body}\n"


def tag(rt, text: str) -> str:
    """A markup tag in the grammar: the special token itself where the tokenizer has one (llguidance matches
    special tokens only by id), else its text."""
    tok = rt.tokenizer
    ids = tok.convert_tokens_to_ids([text])
    token = ids[0] if ids else None
    if token is not None and token != tok.unk_token_id:
        lltok = grammar_tokenizer(tok, rt.target.config.vocab_size, rt.stop_ids)
        if lltok.is_special_token(token):
            return f"<[{token}]>"
    return json.dumps(text)
