"""The request bodies, as OpenAI's API has them (plus the common extensions top_k, min_p, the three
penalties and chat_template_kwargs). Strict: a wrong type is refused, never coerced ("0.5" is not a
number), and unknown top-level fields are refused with a 400 naming them (OpenAI ignores them; a field
we would silently ignore, e.g. `logprobs`, would return something the client did not ask for). Tools,
tool choice and response formats: tools.py."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

Finite = Annotated[float, Field(allow_inf_nan=False)]
StopText = Annotated[str, Field(min_length=1)]  # an empty stop string would end every reply before it began


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class TextPart(Strict):
    type: Literal["text"]
    text: str


FunctionName = Annotated[str, Field(pattern=r"^[a-zA-Z0-9_.-]{1,64}$")]  # OpenAI's rule for function names


class CalledFunction(Strict):
    name: FunctionName
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(Strict):
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class Message(Strict):
    role: Literal["system", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None  # None: an assistant turn of tool calls only
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant turn's calls (tools.py renders them)
    tool_call_id: str | None = None  # a tool turn: the call it answers

    @model_validator(mode="after")
    def complete(self):
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs its content (only an assistant turn of tool_calls has none)")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("tool_calls belong to assistant messages")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the tool_call_id of the call it answers")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionDef(Strict):
    name: FunctionName
    description: str | None = None
    parameters: dict | None = None  # a JSON schema of the arguments (None: no arguments)
    strict: bool | None = None  # accepted: a forced call always follows the schema (tools.py)


class Tool(Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(Strict):
    name: FunctionName


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(Strict):
    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    description: str | None = None
    schema_: dict = Field(default_factory=lambda: {"type": "object"}, alias="schema")
    strict: bool | None = None  # accepted: the schema is always enforced (decoding/constrained.py)


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StreamOptions(Strict):
    include_usage: bool = False


class Sampling(Strict):
    """Fields shared by both endpoints."""

    model: str | None = None
    temperature: Annotated[Finite, Field(ge=0, le=2)] | None = None  # OpenAI's range
    top_p: Annotated[Finite, Field(gt=0, le=1)] | None = None
    # 0 or -1 (vLLM's spelling): no top-k filter
    top_k: Annotated[int, Field(ge=-1)] | None = None
    min_p: Annotated[Finite, Field(ge=0, le=1)] | None = None
    repetition_penalty: Annotated[Finite, Field(gt=0)] | None = None
    presence_penalty: Annotated[Finite, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[Finite, Field(ge=-2, le=2)] | None = None
    seed: Annotated[int, Field(ge=0)] | None = None
    stop: StopText | Annotated[list[StopText], Field(max_length=16)] | None = None
    n: Annotated[int, Field(ge=1, le=1)] = 1  # one choice per request (the runtime decodes at batch 1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted for compatibility; not used
    ignore_eos: bool = False  # vLLM's extension: generate max_tokens tokens whatever the model says (benchmarks)

    @field_validator("stream_options")
    @classmethod
    def only_streamed(cls, value, info: ValidationInfo):
        if value is not None and not info.data.get("stream"):  # OpenAI's rule and words
            raise ValueError("The 'stream_options' parameter is only allowed when 'stream' is enabled")
        return value

    def stops(self) -> list[str]:
        return [] if self.stop is None else [self.stop] if isinstance(self.stop, str) else list(self.stop)


class ChatRequest(Sampling):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    chat_template_kwargs: dict | None = None
    tools: Annotated[list[Tool], Field(max_length=128)] | None = None  # rendered by the chat template (tools.py)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None  # json_object / json_schema: enforced by a grammar


class CompletionRequest(Sampling):
    prompt: str | Annotated[list[int], Field(min_length=1)] | Annotated[list[str], Field(min_length=1, max_length=1)]
    max_tokens: Annotated[int, Field(ge=1)] | None = None
