"""``POST /v1/responses``: the request (OpenAI's fields, with vLLM's extra sampling fields), checked when it is
parsed, and the chat completion it is served as (``chat_request()``).

That chat request holds ``instructions`` as a first system turn (never carried over by
``previous_response_id``, as in OpenAI's API), then the conversation so far (``history``: what
``previous_response_id`` names, which the HTTP layer resolves from its response store, ``responses_routes``),
then ``input``'s items (``response_items.chat_turns``); function ``tools`` and ``tool_choice`` in chat's shape;
``text.format`` as ``response_format``; ``max_output_tokens`` as ``max_completion_tokens``; ``reasoning.effort``
as the chat template's ``reasoning_effort`` (vLLM's mapping); the sampling fields as they are.

A field this server cannot honour is a ValueError (-> 400) naming it, never ignored: ``background``,
``include``, ``top_logprobs``, ``truncation: "auto"``, ``max_tool_calls``, prompt templates, conversations,
hosted tools, reasoning summaries, and any field OpenAI's API does not have (unlike chat, whose unknown fields
vLLM ignores: a client sending a newer Responses field expects its effect). ``user``, ``safety_identifier`` and
``prompt_cache_key`` are identifiers with no effect on the output: accepted and echoed.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, PrivateAttr, ValidationError, field_validator, model_validator

from engine.entrypoints.openai.protocol import INT64_MAX, INT64_MIN, ChatCompletionRequest
from engine.entrypoints.openai.protocol_base import OpenAIBaseModel
from engine.entrypoints.openai.response_items import Item, MessageItem, chat_turns, check_items
from engine.entrypoints.openai.tool_calls import FunctionDefinition, ToolFields


class FunctionTool(FunctionDefinition):
    """A function tool in the Responses API's flat shape: ``{"type": "function", "name", "parameters", ...}``."""

    type: Literal["function"]

    def chat_tool(self) -> dict[str, Any]:
        return {"type": "function", "function": self.model_dump(exclude={"type"}, exclude_none=True)}


class FunctionToolChoice(OpenAIBaseModel):
    type: Literal["function"]
    name: str = Field(min_length=1)


class TextFormat(OpenAIBaseModel):
    """``text.format``: plain ``text``, any ``json_object``, or a ``json_schema`` (its ``name`` as OpenAI's)."""

    model_config = OpenAIBaseModel.model_config | {"serialize_by_alias": True}  # echoed as "schema"
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = Field(None, min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None

    @model_validator(mode="after")
    def _check_schema(self):
        if self.type == "json_schema" and (self.name is None or self.schema_ is None):
            raise ValueError("text.format of type 'json_schema' needs a name and a schema.")
        return self

    def response_format(self) -> dict[str, Any] | None:
        """The chat ``response_format`` this format is (None for plain text)."""
        if self.type == "json_schema":
            return {"type": "json_schema", "json_schema": {"name": self.name, "schema": self.schema_}}
        return None if self.type == "text" else {"type": self.type}


def only_unset(value: Any, message: str) -> Any:
    """``value`` when it is unset (None or False); else the ValueError ``message`` (-> 400). Checked before the
    field's type (which admits the unset value only, so /openapi.json documents what is taken)."""
    if value is not None and value is not False:
        raise ValueError(message)
    return value


class TextConfig(OpenAIBaseModel):
    format: TextFormat = Field(default_factory=TextFormat)
    verbosity: None = None

    @field_validator("verbosity", mode="before")
    @classmethod
    def _refuse_verbosity(cls, value: Any) -> None:
        return only_unset(value, "not supported: the model's verbosity cannot be set here.")


class ReasoningConfig(OpenAIBaseModel):
    """``reasoning.effort`` reaches the chat template as ``reasoning_effort``; summaries are not made here."""

    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: None = None
    generate_summary: None = None  # the deprecated name of summary

    @field_validator("summary", "generate_summary", mode="before")
    @classmethod
    def _refuse_summary(cls, value: Any) -> None:
        return only_unset(value, "not supported: no summary is made; reasoning items carry the reasoning itself.")


class ResponsesStreamOptions(OpenAIBaseModel):
    include_obfuscation: Literal[False] = False

    @field_validator("include_obfuscation", mode="before")
    @classmethod
    def _refuse_obfuscation(cls, value: Any) -> Any:
        return only_unset(value, "not supported: streams are never obfuscated.")


ToolChoice = Literal["none", "auto", "required"] | FunctionToolChoice

# Fields of OpenAI's API this server takes only at these values (their types admit no other), and why.
_ONLY_AT: dict[str, tuple[tuple, str]] = {
    "background": ((None, False), "this server makes no background responses; read the response (or its stream)"),
    "include": ((None, []), "no extra output data (encrypted reasoning, logprobs, hosted tools' results) is made"),
    "top_logprobs": ((None, 0), "output logprobs are not made in responses; /v1/chat/completions has them"),
    "truncation": ((None, "disabled"), "a conversation longer than the context is refused (400), never truncated"),
    "max_tool_calls": ((None,), "it limits hosted tools' calls, and this server has none"),
    "service_tier": ((None, "auto", "default"), "this server has one service tier"),
    "prompt": ((None,), "prompt templates are not supported; send the input itself"),
    "conversation": ((None,), "conversation objects are not supported; continue with previous_response_id"),
}


class ResponsesRequest(OpenAIBaseModel):
    """``POST /v1/responses`` (see the module docstring)."""

    model_config = OpenAIBaseModel.model_config | {"extra": "forbid"}  # /openapi.json: no other field

    model: str | None = None
    input: str | list[Item]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    tools: list[FunctionTool] = Field(default_factory=list)
    tool_choice: ToolChoice = "auto"
    parallel_tool_calls: bool = True
    text: TextConfig = Field(default_factory=TextConfig)
    reasoning: ReasoningConfig | None = None
    stream: bool = False
    stream_options: ResponsesStreamOptions | None = None
    store: bool = True
    previous_response_id: str | None = Field(None, min_length=1)
    metadata: dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]] | None = Field(
        None, max_length=16
    )
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    background: Literal[False] = False
    include: Annotated[list[str], Field(max_length=0)] | None = None
    top_logprobs: Literal[0] | None = None
    truncation: Literal["disabled"] | None = None
    max_tool_calls: None = None
    service_tier: Literal["auto", "default"] | None = None
    prompt: None = None
    conversation: None = None
    # vLLM's extras
    top_k: int | None = None
    repetition_penalty: float | None = None
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stop: str | list[str] | None = None
    ignore_eos: bool = False
    logit_bias: dict[str, float] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: int = 0
    cache_salt: str | None = Field(None, min_length=1)
    structured_outputs: dict[str, Any] | None = None

    _history: list[Item] | None = PrivateAttr(None)  # set by with_history(): it crosses Ray with the request

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported_fields(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        unknown = sorted(set(data) - set(cls.model_fields))
        if unknown:
            raise ValueError(f"{', '.join(unknown)}: not a field of the Responses API this server supports.")
        for name, (accepted, why) in _ONLY_AT.items():
            if name in data and not any(type(data[name]) is type(value) and data[name] == value for value in accepted):
                raise ValueError(f"{name}={data[name]!r} is not supported: {why}.")
        return data

    @field_validator("input", mode="before")
    @classmethod
    def _check_input(cls, value: Any) -> Any:
        return check_items(value)

    @field_validator("tools", mode="before")
    @classmethod
    def _check_tool_types(cls, tools: Any) -> Any:
        for tool in tools if isinstance(tools, list) else []:
            tool_type = tool.get("type", "function") if isinstance(tool, dict) else "function"  # else: pydantic's
            if tool_type != "function":
                raise ValueError(f"tools of type {tool_type!r} are not supported; only function tools are.")
        return tools

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _check_tool_choice_shape(cls, value: Any) -> Any:
        if value in ("none", "auto", "required") or (isinstance(value, dict) and value.get("type") == "function"):
            return value
        raise ValueError("tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'name': ...}.")

    @model_validator(mode="after")
    def _check_fields(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options can only be set when stream is true.")
        if self.input in ("", []) and self.previous_response_id is None and self.instructions is None:
            raise ValueError("input must not be empty.")
        if set(self.structured_outputs or {}) - {"disable_any_whitespace"} and self.text.format.type != "text":
            raise ValueError("text.format and structured_outputs cannot both constrain the output.")
        self._check_tools()
        return self

    def _check_tools(self) -> None:
        """Chat's rules for the tools and the choice (unique names, a choice that names a tool given, ...)."""
        try:
            ToolFields.model_validate(self._chat_tool_fields())
        except ValidationError as exc:
            raise ValueError("; ".join(error["msg"].removeprefix("Value error, ") for error in exc.errors())) from None

    def _chat_tool_fields(self) -> dict[str, Any]:
        """``tools``, ``tool_choice`` and ``parallel_tool_calls`` in chat's shape."""
        tool_choice = self.tool_choice
        if isinstance(tool_choice, FunctionToolChoice):
            tool_choice = {"type": "function", "function": {"name": tool_choice.name}}
        tools = [tool.chat_tool() for tool in self.tools] or None
        return {"tools": tools, "tool_choice": tool_choice, "parallel_tool_calls": self.parallel_tool_calls}

    @property
    def input_items(self) -> list[Item]:
        """``input`` as items (a string is one user message)."""
        if isinstance(self.input, str):
            return [MessageItem(role="user", content=self.input)] if self.input else []
        return list(self.input)

    @property
    def history(self) -> list[Item] | None:
        """The conversation ``previous_response_id`` names ([] without one); None until resolved."""
        return [] if self.previous_response_id is None else self._history

    def with_history(self, items: list[Item]) -> ResponsesRequest:
        """This request with ``previous_response_id``'s conversation resolved to ``items``."""
        resolved = self.model_copy()
        resolved._history = list(items)
        return resolved

    def chat_request(self) -> ChatCompletionRequest:
        """The chat completion this request is served as (see the module docstring). RuntimeError when
        ``previous_response_id`` was not resolved: the conversation would be served without its start."""
        if self.history is None:
            raise RuntimeError("previous_response_id reached the serving unresolved (no with_history()).")
        turns = [] if self.instructions is None else [{"role": "system", "content": self.instructions}]
        turns += chat_turns([*self.history, *self.input_items])
        if not turns:
            raise ValueError("The conversation is empty: give input.")
        effort = None if self.reasoning is None else self.reasoning.effort
        fields = {name: getattr(self, name) for name in _SAMPLING_FIELDS} | self._chat_tool_fields()
        return ChatCompletionRequest.model_validate(
            fields
            | {
                "messages": turns,
                "max_completion_tokens": self.max_output_tokens,
                "response_format": self.text.format.response_format(),
                "chat_template_kwargs": None if effort is None else {"reasoning_effort": effort},
            }
        )


# Fields the chat request takes as they are.
_SAMPLING_FIELDS = (
    *("model", "stream", "temperature", "top_p", "user", "top_k", "repetition_penalty"),
    *("seed", "stop", "ignore_eos", "logit_bias", "skip_special_tokens", "include_stop_str_in_output"),
    *("priority", "cache_salt", "structured_outputs"),
)
