"""The request bodies, as OpenAI's API has them (plus the common extensions top_k, min_p, the three
penalties and chat_template_kwargs). Strict: a wrong type is refused, never coerced ("0.5" is not a
number), and unknown top-level fields are refused with a 400 naming them (OpenAI ignores them; a field
we would silently ignore, e.g. `tools` or `logprobs`, would return something the client did not ask for)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

Finite = Annotated[float, Field(allow_inf_nan=False)]
StopText = Annotated[str, Field(min_length=1)]  # an empty stop string would end every reply before it began


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class TextPart(Strict):
    type: Literal["text"]
    text: str


class Message(Strict):
    role: Literal["system", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


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


class CompletionRequest(Sampling):
    prompt: str | Annotated[list[int], Field(min_length=1)] | Annotated[list[str], Field(min_length=1, max_length=1)]
    max_tokens: Annotated[int, Field(ge=1)] | None = None
