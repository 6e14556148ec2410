"""The request bodies the server reads, as pydantic models: OpenAI's fields, and vLLM's extras for
the engine's own sampling settings. Unknown fields are ignored (as OpenAI-compatible servers do);
fields the engine cannot honour are refused by sampling.py, by name."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingFields(BaseModel):
    """Fields both endpoints share."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False

    @field_validator(
        "n", "stream", "ignore_eos", "logprobs", "echo", mode="before", check_fields=False
    )
    @classmethod
    def _null_is_default(cls, value: Any, info: ValidationInfo) -> Any:
        """Some clients send null for a field they leave at its default."""
        return cls.model_fields[info.field_name].default if value is None else value


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[TextPart] | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's calls, as it was answered
    tool_call_id: str | None = None  # a tool message: the call it answers


class ChatRequest(SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None


class CompletionRequest(SamplingFields):
    """POST /v1/completions."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions (chat: all the room left)
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class DetokenizeRequest(BaseModel):
    """POST /detokenize, as vLLM has it: token ids back to text."""

    model: str | None = None
    tokens: list[int]
