"""Chat messages as requests carry them: ``system``, ``user``, ``assistant`` (text,
or ``tool_calls`` with null content) and ``tool`` turns, and how each reaches
the chat template.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import field_validator, model_validator

from engine.entrypoints.openai.protocol_base import OpenAIBaseModel


class TextContentPart(OpenAIBaseModel):
    type: Literal["text"]
    text: str


class AssistantFunctionCall(OpenAIBaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it back


class AssistantToolCall(OpenAIBaseModel):
    """A tool call an earlier assistant turn made (``message.tool_calls`` of a previous response)."""

    id: str
    type: Literal["function"] = "function"
    function: AssistantFunctionCall


class ChatMessage(OpenAIBaseModel):
    """One turn: ``system`` / ``user`` / ``assistant`` (content, or ``tool_calls`` and null content) / ``tool``."""

    role: Literal["system", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_calls: list[AssistantToolCall] | None = None
    tool_call_id: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _check_content_shape(cls, content: Any) -> Any:
        # One clear message instead of pydantic's error per union member.
        if content is None or isinstance(content, str):
            return content
        if isinstance(content, list):
            for part in content:
                part_type = part.get("type") if isinstance(part, dict) else None
                if part_type != "text":
                    raise ValueError(
                        f"content parts of type {part_type!r} are not supported; only "
                        "{'type': 'text', 'text': ...} parts are."
                    )
            return content
        raise ValueError("content must be a string or a list of {'type': 'text', 'text': ...} parts.")

    @model_validator(mode="after")
    def _check_role_fields(self):
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs content (only an assistant's with tool_calls may omit it).")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls.")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the tool_call_id it answers.")
        return self

    def template_dict(self) -> dict[str, Any]:
        """This turn as the chat template reads it; a tool call's arguments as an object (as HF templates expect)."""
        turn: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            turn["tool_calls"] = [
                {"id": call.id, "type": call.type, "function": _template_function(call.function)}
                for call in self.tool_calls
            ]
        if self.tool_call_id is not None:
            turn["tool_call_id"] = self.tool_call_id
        return turn

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)  # vLLM joins text parts with newlines


def _template_function(function: AssistantFunctionCall) -> dict[str, Any]:
    try:
        arguments = json.loads(function.arguments)
    except ValueError:
        arguments = function.arguments  # not JSON: the template renders it as the text it is
    return {"name": function.name, "arguments": arguments}
