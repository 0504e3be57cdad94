"""``ResponsesResponse``: what ``POST /v1/responses`` returns and ``GET /v1/responses/{id}`` reads back (vLLM's
name for OpenAI's Response object), its usage, and ``DeletedResponse``.

A plain pydantic model: it pickles across the Ray ingress / LLM-server boundary and into the response store,
and serializes with ``model_dump_json()``. The request's settings are echoed as OpenAI echoes them, with the
sampling values the engine actually used (the model's defaults where the request left them unset).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from engine.entrypoints.openai.response_items import Item
from engine.entrypoints.openai.responses import unix_time
from engine.entrypoints.openai.responses_request import (
    FunctionTool,
    FunctionToolChoice,
    ReasoningConfig,
    ResponsesRequest,
    TextConfig,
)
from engine.sampling_params import SamplingParams

ResponseStatus = Literal["completed", "incomplete", "in_progress", "failed", "cancelled", "queued"]


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int

    @classmethod
    def of(cls, num_input: int, num_cached: int, num_output: int, num_reasoning: int) -> ResponseUsage:
        return cls(
            input_tokens=num_input,
            input_tokens_details=InputTokensDetails(cached_tokens=num_cached),
            output_tokens=num_output,
            output_tokens_details=OutputTokensDetails(reasoning_tokens=num_reasoning),
            total_tokens=num_input + num_output,
        )


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseError(BaseModel):
    code: str
    message: str


class ResponsesResponse(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=unix_time)
    status: ResponseStatus
    completed_at: int | None = None
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    model: str
    output: list[Item] = Field(default_factory=list)
    usage: ResponseUsage | None = None
    # The request's settings, echoed.
    instructions: str | None = None
    max_output_tokens: int | None = None
    metadata: dict[str, str] = Field(default_factory=dict)
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    reasoning: ReasoningConfig = Field(default_factory=ReasoningConfig)
    store: bool = True
    temperature: float = 1.0
    top_p: float = 1.0
    text: TextConfig = Field(default_factory=TextConfig)
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice = "auto"
    tools: list[FunctionTool] = Field(default_factory=list)
    truncation: Literal["disabled"] = "disabled"
    background: bool = False
    service_tier: Literal["default"] = "default"
    top_logprobs: int = 0
    max_tool_calls: None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None

    @classmethod
    def started(cls, request: ResponsesRequest, response_id: str, model: str, params: SamplingParams) -> Any:
        """The response ``request`` starts, ``in_progress`` with no output yet."""
        return cls(
            id=response_id,
            status="in_progress",
            model=model,
            temperature=params.temperature,
            top_p=params.top_p,
            reasoning=request.reasoning or ReasoningConfig(),
            metadata=request.metadata or {},
            **{name: getattr(request, name) for name in _ECHOED},
        )

    def ended(self, status: ResponseStatus, output: list[Item], usage: ResponseUsage) -> ResponsesResponse:
        """This response with its output, its usage and how it ended."""
        is_cut = status == "incomplete"
        return self.model_copy(
            update={
                "status": status,
                "output": output,
                "usage": usage,
                "completed_at": unix_time() if status == "completed" else None,
                "incomplete_details": IncompleteDetails(reason="max_output_tokens") if is_cut else None,
            }
        )


_ECHOED = (
    *("instructions", "max_output_tokens", "parallel_tool_calls", "previous_response_id", "store", "text"),
    *("tool_choice", "tools", "user", "safety_identifier", "prompt_cache_key"),
)


class DeletedResponse(BaseModel):
    """``DELETE /v1/responses/{id}``'s answer."""

    id: str
    object: Literal["response"] = "response"
    deleted: bool = True
