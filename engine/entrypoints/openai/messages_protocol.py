"""Anthropic's Messages API request (``POST /v1/messages``), checked and mapped onto a chat completion.

``MessagesRequest`` holds Anthropic's fields with its names and bounds; ``chat_request()`` turns it into
the ``ChatCompletionRequest`` the engine side serves (the chat template, tools, sampling, limits and
migration are the chat completion's), so the Messages API differs from chat completions only in its
shapes. The mapping:

* ``system`` (a string or text blocks) -> a system turn; ``messages`` -> the turns, each ``tool_result``
  block a ``tool`` turn (before the user's text), each ``tool_use`` block an assistant ``tool_calls`` entry;
  ``thinking`` blocks of earlier turns are accepted and left out of the prompt (as Anthropic's API does);
  an assistant turn last is a prefill the answer continues.
* ``max_tokens`` -> ``max_completion_tokens``; ``stop_sequences`` -> ``stop``; ``temperature``, ``top_p``,
  ``top_k`` as they are; ``tools`` -> functions (``input_schema`` their parameters); ``tool_choice`` auto /
  any / tool / none -> auto / required / named / none, ``disable_parallel_tool_use`` -> no parallel calls.
* ``thinking`` (enabled, adaptive, disabled) -> the template's ``enable_thinking`` (Qwen3's switch);
  ``budget_tokens`` is checked as Anthropic checks it, but only ``max_tokens`` bounds the reasoning;
  ``display: omitted`` leaves the thinking blocks out. ``output_config.format`` (a JSON schema) ->
  ``response_format``: the schema constrains the answer after the reasoning.

``temperature``, ``top_p`` and ``top_k`` (which Anthropic's current SDK sends only as ``extra_body``) are
honoured. A field Anthropic has and Serval does not serve (images, documents, server tools, ``service_tier``,
``output_config.effort``, ``between_tools`` thinking, ...) is a 400 naming it, never ignored; so is any
unknown field. ``cache_control`` is accepted: the prefix cache reuses
every prompt's KV without being asked.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from engine.entrypoints.openai.protocol import ChatCompletionRequest

# Anthropic's least thinking budget.
MIN_THINKING_BUDGET = 1024


class _Strict(BaseModel):
    """Unknown fields are refused (a 400 naming them): a Messages request never runs without a field it set."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())


class TextBlock(_Strict):
    type: Literal["text"]
    text: str
    cache_control: dict[str, Any] | None = None
    citations: list[Any] | None = None

    @field_validator("citations")
    @classmethod
    def _no_citations(cls, citations: list[Any] | None) -> list[Any] | None:
        if citations:
            raise ValueError("text blocks with citations are not supported.")
        return citations


class ThinkingBlock(_Strict):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(_Strict):
    type: Literal["redacted_thinking"]
    data: str


class ToolUseBlock(_Strict):
    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    input: dict[str, Any]
    cache_control: dict[str, Any] | None = None


class ToolResultBlock(_Strict):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: str | list[TextBlock] = ""
    is_error: bool | None = None
    cache_control: dict[str, Any] | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "\n".join(block.text for block in self.content)


ContentBlock = Annotated[
    TextBlock | ThinkingBlock | RedactedThinkingBlock | ToolUseBlock | ToolResultBlock, Field(discriminator="type")
]
_BLOCK_TYPES = ("text", "thinking", "redacted_thinking", "tool_use", "tool_result")


class MessageParam(_Strict):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]

    @field_validator("content", mode="before")
    @classmethod
    def _check_block_types(cls, content: Any) -> Any:
        # One clear message instead of pydantic's error per union member.
        for block in content if isinstance(content, list) else ():
            block_type = block.get("type") if isinstance(block, dict) else None
            if block_type not in _BLOCK_TYPES:
                raise ValueError(
                    f"content blocks of type {block_type!r} are not supported; these are: {', '.join(_BLOCK_TYPES)}."
                )
        return content

    def blocks(self) -> list[Any]:
        return [TextBlock(type="text", text=self.content)] if isinstance(self.content, str) else list(self.content)


class ToolParam(_Strict):
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: dict[str, Any] | None = None


class ToolChoiceParam(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None

    @model_validator(mode="after")
    def _name_for_a_tool(self):
        if (self.type == "tool") != (self.name is not None):
            raise ValueError("tool_choice needs a name exactly when its type is 'tool'.")
        return self


class ThinkingParam(_Strict):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(None, ge=MIN_THINKING_BUDGET)
    display: Literal["summarized", "omitted"] | None = None


class JsonOutputFormat(_Strict):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfigParam(_Strict):
    format: JsonOutputFormat | None = None
    effort: None = None  # Claude's effort levels have no meaning here: any value is refused


class MessagesRequest(_Strict):
    """``POST /v1/messages`` (see the module docstring)."""

    model: str | None = None
    messages: list[MessageParam] = Field(min_length=1)
    max_tokens: int = Field(ge=1)
    system: str | list[TextBlock] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    stream: bool = False
    tools: list[ToolParam] | None = None
    tool_choice: ToolChoiceParam | None = None
    thinking: ThinkingParam | None = None
    output_config: OutputConfigParam | None = None
    metadata: dict[str, Any] | None = None  # Anthropic's user_id: for its abuse checks, nothing here

    @model_validator(mode="after")
    def _check_thinking(self):
        thinking = self.thinking
        if thinking is not None and thinking.type == "enabled":
            if thinking.budget_tokens is None:
                raise ValueError("thinking.budget_tokens is required when thinking is enabled.")
            if thinking.budget_tokens >= self.max_tokens:
                raise ValueError("thinking.budget_tokens must be less than max_tokens.")
        return self

    def chat_request(self) -> ChatCompletionRequest:
        """The chat completion this request is; ValueError (-> 400) where the two cannot agree."""
        prefill = self.messages[-1].role == "assistant"
        chat: dict[str, Any] = {
            "model": self.model,
            "messages": self._turns(),
            "max_completion_tokens": self.max_tokens,
            "stop": self.stop_sequences,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "stream": self.stream,
            "add_generation_prompt": not prefill,
            "continue_final_message": prefill,
        }
        if self.thinking is not None:
            chat["chat_template_kwargs"] = {"enable_thinking": self.thinking.type != "disabled"}
            chat["include_reasoning"] = self.thinking.display != "omitted"
        if self.output_config is not None and self.output_config.format is not None:
            schema = {"name": "output", "schema": self.output_config.format.schema_}
            chat["response_format"] = {"type": "json_schema", "json_schema": schema}
        if self.tools:
            chat["tools"] = [_function_tool(tool) for tool in self.tools]
            chat.update(_tool_choice(self.tool_choice))
        elif self.tool_choice is not None and self.tool_choice.type != "none":
            raise ValueError(f"tool_choice {self.tool_choice.type!r} needs tools.")
        return ChatCompletionRequest.model_validate(chat)

    def _turns(self) -> list[dict[str, Any]]:
        system = self.system if isinstance(self.system, str) else "\n".join(b.text for b in self.system or [])
        turns = [{"role": "system", "content": system}] if self.system else []
        for message in self.messages:
            turns.extend(_user_turns(message) if message.role == "user" else _assistant_turns(message))
        return turns


def _user_turns(message: MessageParam) -> list[dict[str, Any]]:
    """Its tool results, each a ``tool`` turn, then its text as one user turn."""
    turns: list[dict[str, Any]] = []
    texts = []
    for block in message.blocks():
        match block.type:
            case "tool_result":
                turns.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": block.text()})
            case "text":
                texts.append({"type": "text", "text": block.text})
            case "tool_use":
                raise ValueError("tool_use blocks belong to assistant messages.")
    if texts or not turns:
        turns.append({"role": "user", "content": texts})
    return turns


def _assistant_turns(message: MessageParam) -> list[dict[str, Any]]:
    """Its text and tool calls as one assistant turn (its thinking left out)."""
    texts, calls = [], []
    for block in message.blocks():
        match block.type:
            case "text":
                texts.append(block.text)
            case "tool_use":
                calls.append({"id": block.id, "function": {"name": block.name, "arguments": json.dumps(block.input)}})
            case "tool_result":
                raise ValueError("tool_result blocks belong to user messages.")
    turn: dict[str, Any] = {"role": "assistant", "content": "".join(texts) if texts or not calls else None}
    if calls:
        turn["tool_calls"] = calls
    return [turn]


def _function_tool(tool: ToolParam) -> dict[str, Any]:
    function = {"name": tool.name, "parameters": tool.input_schema}
    if tool.description is not None:
        function["description"] = tool.description
    return {"type": "function", "function": function}


def _tool_choice(choice: ToolChoiceParam | None) -> dict[str, Any]:
    if choice is None:
        return {"tool_choice": "auto"}
    mapped = {"auto": "auto", "any": "required", "none": "none"}.get(choice.type)
    if mapped is None:
        mapped = {"type": "function", "function": {"name": choice.name}}
    return {"tool_choice": mapped, "parallel_tool_calls": not choice.disable_parallel_tool_use}
