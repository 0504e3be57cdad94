"""The Responses API's items: what a request's ``input`` holds and what a response's ``output`` returns.

One model per item type, the same for input and output, so an output item can be passed back as input as it
came (OpenAI's way of carrying a conversation without ``previous_response_id``):

* ``MessageItem``: a turn (``user``, ``system``, ``developer`` or ``assistant``), its ``content`` a string or
  ``input_text`` / ``output_text`` parts; its ``type`` may be left out (OpenAI's ``EasyInputMessage``), no
  other item's may. Output: the assistant's text, one ``output_text`` part.
* ``FunctionCallItem``: a call the model made (``call_id``, ``name``, ``arguments`` as JSON text).
* ``FunctionCallOutputItem``: a tool's result for a ``call_id``.
* ``ReasoningItem``: the model's reasoning (``content``: ``reasoning_text`` parts).

``chat_turns(items)`` renders items as the chat turns the chat template reads (``chat_messages.ChatMessage``
dicts): ``developer`` as ``system``, consecutive function calls as one assistant turn's ``tool_calls`` (joined
to the assistant text before them), results as ``tool`` turns, a reasoning item as nothing (the reasoning of
earlier turns is not part of the prompt, as chat templates drop it). Anything else
(images, files, hosted tools' items, ``item_reference``) is refused with a ValueError naming it (-> 400).
"""

from __future__ import annotations

import uuid
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator

from engine.entrypoints.openai.protocol_base import OpenAIBaseModel

ItemStatus = Literal["in_progress", "completed", "incomplete"]
TEXT_PART_TYPES = ("input_text", "output_text")
ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")


def item_id(prefix: str) -> str:
    """A fresh id in OpenAI's shape: ``resp_...``, ``msg_...``, ``fc_...``, ``rs_...``."""
    return f"{prefix}_{uuid.uuid4().hex}"


class InputText(OpenAIBaseModel):
    type: Literal["input_text"] = "input_text"
    text: str


class OutputText(OpenAIBaseModel):
    """The assistant's text (``annotations`` always empty here: no hosted tool cites anything)."""

    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)


TextPart = Annotated[InputText | OutputText, Field(discriminator="type")]


def check_text_parts(value: Any, what: str) -> Any:
    """``value`` unchanged when it is a string or a list of text parts; a ValueError naming what is not."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise ValueError(f"{what} must be a string or a list of input_text / output_text parts.")
    for part in value:
        part_type = part.get("type") if isinstance(part, dict) else getattr(part, "type", None)
        if part_type not in TEXT_PART_TYPES:
            raise ValueError(
                f"{what} parts of type {part_type!r} are not supported; only input_text and output_text parts are."
            )
    return value


def parts_text(content: str | list[InputText | OutputText]) -> str:
    if isinstance(content, str):
        return content
    return "\n".join(part.text for part in content)  # as chat joins text parts


class MessageItem(OpenAIBaseModel):
    type: Literal["message"] = "message"
    id: str | None = None
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[TextPart]
    status: ItemStatus | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _check_content(cls, content: Any) -> Any:
        return check_text_parts(content, "content")

    def add_to(self, turns: list[dict[str, Any]]) -> None:
        role = "system" if self.role == "developer" else self.role  # chat templates know no developer role
        turns.append({"role": role, "content": parts_text(self.content)})


class FunctionCallItem(OpenAIBaseModel):
    type: Literal["function_call"]
    id: str | None = None
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str
    status: ItemStatus | None = None

    def add_to(self, turns: list[dict[str, Any]]) -> None:
        call = {"id": self.call_id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        if not turns or turns[-1]["role"] != "assistant":
            turns.append({"role": "assistant", "content": None})
        turns[-1].setdefault("tool_calls", []).append(call)


class FunctionCallOutputItem(OpenAIBaseModel):
    type: Literal["function_call_output"]
    id: str | None = None
    call_id: str = Field(min_length=1)
    output: str | list[TextPart]
    status: ItemStatus | None = None

    @field_validator("output", mode="before")
    @classmethod
    def _check_output(cls, output: Any) -> Any:
        return check_text_parts(output, "function_call_output output")

    def add_to(self, turns: list[dict[str, Any]]) -> None:
        turns.append({"role": "tool", "tool_call_id": self.call_id, "content": parts_text(self.output)})


class SummaryText(OpenAIBaseModel):
    type: Literal["summary_text"] = "summary_text"
    text: str


class ReasoningText(OpenAIBaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ReasoningItem(OpenAIBaseModel):
    """The model's reasoning: its text as ``content`` (``summary`` stays empty: nothing here summarizes)."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[SummaryText] = Field(default_factory=list)
    content: list[ReasoningText] | None = None
    encrypted_content: str | None = None
    status: ItemStatus | None = None

    @field_validator("encrypted_content")
    @classmethod
    def _refuse_encrypted(cls, value: str | None) -> str | None:
        if value is not None:
            raise ValueError("encrypted_content is not supported: this server never encrypts reasoning.")
        return value

    def add_to(self, turns: list[dict[str, Any]]) -> None:
        """Nothing: earlier turns' reasoning is no part of the prompt (chat templates drop it too)."""


Item = Annotated[MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem, Field(discriminator="type")]


def check_items(items: Any) -> Any:
    """``items`` with ``type: "message"`` filled in where a turn left it out; a ValueError naming an item type
    this server does not take (one clear message instead of pydantic's union errors)."""
    if not isinstance(items, list):
        return items
    checked = []
    for item in items:
        if isinstance(item, dict) and "type" not in item and "role" in item:
            item = {**item, "type": "message"}
        item_type = item.get("type") if isinstance(item, dict) else None
        if item_type not in ITEM_TYPES:
            raise ValueError(
                f"input items of type {item_type!r} are not supported; only {', '.join(ITEM_TYPES)} items are."
            )
        checked.append(item)
    return checked


def chat_turns(items: list[Item]) -> list[dict[str, Any]]:
    """The chat turns of ``items``, in order (see the module docstring)."""
    turns: list[dict[str, Any]] = []
    for item in items:
        item.add_to(turns)
    return turns
