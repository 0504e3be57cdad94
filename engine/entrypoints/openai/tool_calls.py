"""Chat tools: the request's ``tools`` / ``tool_choice`` / ``parallel_tool_calls``
and the output constraint they imply.

* ``none``: the model is not asked to call anything (the tools are still rendered in the prompt, as vLLM does).
* ``auto`` (the default when ``tools`` is given): free generation, Hermes-style
  ``<tool_call>`` blocks parsed out of the text (``tool_parsers.HermesToolParser``).
* ``required``: a JSON-schema constraint on an array of ``{"name", "parameters"}``
  objects, one ``anyOf`` branch per tool (``maxItems`` 1 without parallel calls).
* named (``{"type": "function", "function": {"name"}}``): the tool's own
  ``parameters`` schema; the whole output is that call's arguments.

Everything a request gets wrong here is a ValueError (-> 400) before anything is queued.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from engine.entrypoints.openai.protocol_base import OpenAIBaseModel
from engine.sampling_params import StructuredOutputsParams

# A function whose ``parameters`` are left out takes no arguments (OpenAI's reading).
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


class FunctionDefinition(OpenAIBaseModel):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @property
    def parameters_schema(self) -> dict[str, Any]:
        return NO_PARAMETERS if self.parameters is None else self.parameters


class ChatTool(OpenAIBaseModel):
    """One OpenAI function tool: ``{"type": "function", "function": {"name", "description", "parameters"}}``."""

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(OpenAIBaseModel):
    name: str = Field(min_length=1)


class NamedToolChoice(OpenAIBaseModel):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ToolList(OpenAIBaseModel):
    """The tools a conversation may call (chat completions, and chat tokenize, which renders them too)."""

    tools: list[ChatTool] | None = None

    @model_validator(mode="after")
    def _check_unique_names(self):
        names = [tool.function.name for tool in self.tools or []]
        duplicates = sorted({name for name in names if names.count(name) > 1})
        if duplicates:
            raise ValueError(f"tools has more than one function named {', '.join(map(repr, duplicates))}.")
        return self

    def tool_dicts(self) -> list[dict[str, Any]] | None:
        """The tools as the chat template reads them (None when there are none)."""
        if not self.tools:
            return None
        return [tool.model_dump(exclude_none=True) for tool in self.tools]


class ToolFields(ToolList):
    """The chat request's tool fields, checked against each other when the request is parsed."""

    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _check_tool_choice_shape(cls, value: Any) -> Any:
        # One clear message instead of pydantic's error per union member.
        if value is None or value in ("none", "auto", "required") or isinstance(value, dict):
            return value
        raise ValueError(
            "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}."
        )

    @model_validator(mode="after")
    def _check_tool_choice(self):
        choice = self.tool_choice
        if (choice == "required" or isinstance(choice, NamedToolChoice)) and not self.tools:
            raise ValueError(f"tool_choice {_choice_name(choice)} needs tools.")
        names = [tool.function.name for tool in self.tools or []]
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(f"tool_choice names the function {choice.function.name!r}, which is not in tools.")
        return self

    @property
    def tool_mode(self) -> str:
        """``none``, ``auto``, ``required`` or ``named`` (OpenAI's default: auto with tools, none without)."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        if self.tool_choice is None:
            return "auto" if self.tools else "none"
        return self.tool_choice if self.tools else "none"

    @property
    def named_tool(self) -> FunctionDefinition | None:
        if not isinstance(self.tool_choice, NamedToolChoice):
            return None
        return next(tool.function for tool in self.tools if tool.function.name == self.tool_choice.function.name)

    def tool_constraint(self) -> StructuredOutputsParams | None:
        """The constraint ``required`` and named tool choices impose; None for ``none`` / ``auto``."""
        if self.tool_mode == "named":
            schema = self.named_tool.parameters_schema
        elif self.tool_mode == "required":
            schema = required_tools_schema([tool.function for tool in self.tools], self.parallel_tool_calls)
        else:
            return None
        return StructuredOutputsParams(json=schema)


def required_tools_schema(functions: list[FunctionDefinition], parallel_tool_calls: bool) -> dict[str, Any]:
    """A JSON array of at least one ``{"name": <one tool's name>, "parameters": <its schema>}`` (vLLM's shape)."""
    branches = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [function.name]},
                "parameters": function.parameters_schema,
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for function in functions
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": branches}}
    if not parallel_tool_calls:
        schema["maxItems"] = 1
    return schema


def _choice_name(choice: Any) -> str:
    return repr(choice) if isinstance(choice, str) else f"{{'function': {{'name': {choice.function.name!r}}}}}"
