"""OpenAI response models (what ``/v1/completions``, ``/v1/chat/completions``,
``/v1/models``, ``/tokenize`` and ``/detokenize`` return), with vLLM's extras
(``stop_reason``, ``max_model_len``).

Plain pydantic models: they pickle across the Ray ingress / LLM-server
boundary and serialize with ``model_dump_json()``.
"""

from __future__ import annotations

import time
from typing import Literal

from pydantic import BaseModel, Field, model_serializer


def unix_time() -> int:
    return int(time.time())


class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    completion_tokens_details: CompletionTokensDetails | None = None  # set when a reasoning parser runs

    @model_serializer(mode="wrap")
    def _details_when_set(self, handler) -> dict:
        """No ``completion_tokens_details`` key without a reasoning parser: the usage answered as before it."""
        usage = handler(self)
        if self.completion_tokens_details is None:
            usage.pop("completion_tokens_details", None)
        return usage

    @classmethod
    def of(
        cls, num_prompt_tokens: int, num_completion_tokens: int, num_reasoning_tokens: int | None = None
    ) -> UsageInfo:
        """``num_reasoning_tokens``: of the completion tokens, the reasoning's (None: no reasoning parser)."""
        details = (
            None if num_reasoning_tokens is None else CompletionTokensDetails(reasoning_tokens=num_reasoning_tokens)
        )
        return cls(
            prompt_tokens=num_prompt_tokens,
            completion_tokens=num_completion_tokens,
            total_tokens=num_prompt_tokens + num_completion_tokens,
            completion_tokens_details=details,
        )


# Completions


class CompletionLogProbs(BaseModel):
    """The legacy completions logprobs: parallel lists, one entry per token."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionResponseChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=unix_time)
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo


class CompletionStreamResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo | None = None


# Chat completions


class ChatLogProb(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogProbsContent(ChatLogProb):
    top_logprobs: list[ChatLogProb] = Field(default_factory=list)


class ChatCompletionLogProbs(BaseModel):
    content: list[ChatLogProbsContent] | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # the call's arguments as JSON text


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatResponseMessage(BaseModel):
    """The assistant's message: its text, or (``content`` null) the tool calls it made; ``reasoning_content``
    (vLLM's): what a reasoning parser split out of it."""

    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatCompletionResponseChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=unix_time)
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    """A piece of one tool call: the first of a call has ``id``, ``type`` and ``function.name`` (and
    ``arguments: ""``), later ones only argument fragments; ``index`` says which call (OpenAI's deltas)."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall

    @model_serializer
    def _without_nones(self) -> dict:
        head = {key: value for key, value in (("id", self.id), ("type", self.type)) if value is not None}
        function = {key: value for key, value in self.function if value is not None}
        return {"index": self.index, **head, "function": function}


class DeltaMessage(BaseModel):
    """A streamed piece of the assistant's message; unset parts are left out (``{}`` on the last chunk)."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer
    def _without_nones(self) -> dict:
        parts = (("role", self.role), ("content", self.content), ("reasoning_content", self.reasoning_content))
        delta: dict = {key: value for key, value in parts if value is not None}
        if self.tool_calls:
            delta["tool_calls"] = [call.model_dump() for call in self.tool_calls]
        return delta


class ChatCompletionStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None


# Models, tokenizer


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=unix_time)
    owned_by: str = "serval"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str
