"""A response's ``output`` items built as its text is parsed, and the stream events that announce them.

``OutputBuilder`` is fed what the parsers make of the text (``choice_parser.ChoiceDelta``), in order: reasoning
text, message text and tool-call deltas. Each piece of a new kind opens an
item and closes the one before: a ``reasoning`` item, a ``message`` (one ``output_text`` part) or a
``function_call``. A streamed response hands it ``ResponseEvents``, where each step is announced as OpenAI
announces it (``response.output_item.added``, ``response.content_part.added``, ``response.output_text.delta``
/ ``response.reasoning_text.delta`` / ``response.function_call_arguments.delta``, then the ``.done`` events
and ``response.output_item.done``); a response that is not streamed feeds the whole text once and reads
``items``: the same items either way, whatever the chunking.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine.entrypoints.openai.choice_parser import ChoiceDelta
from engine.entrypoints.openai.response_items import (
    FunctionCallItem,
    Item,
    ItemStatus,
    MessageItem,
    OutputText,
    ReasoningItem,
    ReasoningText,
    item_id,
)
from engine.entrypoints.openai.responses import DeltaToolCall


class ResponseEvents:
    """A streamed response's events as SSE text (OpenAI's framing: an ``event:`` line naming the type, then
    ``data:``), numbered by ``sequence_number`` from 0. ``take()`` returns those emitted since the last take."""

    def __init__(self) -> None:
        self.next_number = 0
        self._pending: list[str] = []

    def emit(self, event_type: str, **fields: Any) -> None:
        payload = {"type": event_type, "sequence_number": self.next_number, **fields}
        self.next_number += 1
        self._pending.append(f"event: {event_type}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n")

    def take(self) -> str:
        text, self._pending = "".join(self._pending), []
        return text


def dumped(item: Item) -> dict[str, Any]:
    return item.model_dump(mode="json")


@dataclass(frozen=True)
class _TextKind:
    """An item kind written as one text part: its id prefix, its events' prefix, how the item looks."""

    id_prefix: str
    event_prefix: str
    make: Callable[[str, list, ItemStatus], Item]  # (id, content parts, status) -> the item
    part: Callable[[str], Any]  # text -> its content part
    extra: tuple[tuple[str, Any], ...] = ()  # fields of its delta / done events beside the text


MESSAGE = _TextKind(
    "msg",
    "response.output_text",
    lambda id_, parts, status: MessageItem(id=id_, role="assistant", content=parts, status=status),
    lambda text: OutputText(text=text),
    (("logprobs", []),),
)
REASONING = _TextKind(
    "rs",
    "response.reasoning_text",
    lambda id_, parts, status: ReasoningItem(type="reasoning", id=id_, summary=[], content=parts, status=status),
    lambda text: ReasoningText(text=text),
)


class _OpenText:
    """A message or reasoning item being written."""

    def __init__(self, kind: _TextKind, output_index: int, events: ResponseEvents | None) -> None:
        self.kind, self.output_index, self.events = kind, output_index, events
        self.id = item_id(kind.id_prefix)
        self.text = ""
        if events is not None:
            where = {"item_id": self.id, "output_index": output_index, "content_index": 0}
            events.emit("response.output_item.added", output_index=output_index, item=self._item([], "in_progress"))
            events.emit("response.content_part.added", **where, part=kind.part("").model_dump(mode="json"))

    def writes(self, kind: _TextKind) -> bool:
        return self.kind is kind

    def continues(self, call_index: int) -> bool:
        return False

    def _item(self, parts: list, status: ItemStatus) -> dict[str, Any]:
        return dumped(self.kind.make(self.id, parts, status))

    def append(self, text: str) -> None:
        self.text += text
        if self.events is not None:
            where = {"item_id": self.id, "output_index": self.output_index, "content_index": 0}
            self.events.emit(f"{self.kind.event_prefix}.delta", **where, delta=text, **dict(self.kind.extra))

    def close(self, status: ItemStatus) -> Item:
        part = self.kind.part(self.text)
        if self.events is not None:
            where = {"item_id": self.id, "output_index": self.output_index, "content_index": 0}
            self.events.emit(f"{self.kind.event_prefix}.done", **where, text=self.text, **dict(self.kind.extra))
            self.events.emit("response.content_part.done", **where, part=part.model_dump(mode="json"))
        item = self.kind.make(self.id, [part], status)
        if self.events is not None:
            self.events.emit("response.output_item.done", output_index=self.output_index, item=dumped(item))
        return item


class _OpenCall:
    """A function call being written: the parser's call ``index``, its arguments so far."""

    def __init__(self, start: DeltaToolCall, output_index: int, events: ResponseEvents | None) -> None:
        self.index, self.output_index, self.events = start.index, output_index, events
        self.item = FunctionCallItem(
            type="function_call",
            id=item_id("fc"),
            call_id=start.id,
            name=start.function.name,
            arguments="",
            status="in_progress",
        )
        if events is not None:
            events.emit("response.output_item.added", output_index=output_index, item=dumped(self.item))
        self.append(start.function.arguments or "")

    def writes(self, kind: _TextKind) -> bool:
        return False

    def continues(self, call_index: int) -> bool:
        return self.index == call_index

    def append(self, fragment: str) -> None:
        if not fragment:
            return
        self.item.arguments += fragment
        if self.events is not None:
            where = {"item_id": self.item.id, "output_index": self.output_index}
            self.events.emit("response.function_call_arguments.delta", **where, delta=fragment)

    def close(self, status: ItemStatus) -> Item:
        item = self.item.model_copy(update={"status": status})
        if self.events is not None:
            where = {"item_id": item.id, "output_index": self.output_index}
            self.events.emit("response.function_call_arguments.done", **where, arguments=item.arguments, name=item.name)
            self.events.emit("response.output_item.done", output_index=self.output_index, item=dumped(item))
        return item


class OutputBuilder:
    """One response's output items (see the module docstring); ``events``: a stream's, None when not streamed."""

    def __init__(self, events: ResponseEvents | None = None) -> None:
        self.events = events
        self.items: list[Item] = []
        self.open: _OpenText | _OpenCall | None = None

    def add(self, parsed: ChoiceDelta) -> None:
        """One piece of the text: its reasoning first, then its content and tool calls, in order."""
        if parsed.reasoning:
            self._write(REASONING, parsed.reasoning)
        if parsed.content:
            self._write(MESSAGE, parsed.content)
        for call in parsed.tool_calls:
            if call.id is not None:  # a call's first delta: a new item
                self._close("completed")
                self.open = _OpenCall(call, len(self.items), self.events)
            elif self.open is not None and self.open.continues(call.index):
                self.open.append(call.function.arguments or "")
            else:  # the parsers finish each call before the next starts
                raise RuntimeError(f"Arguments for tool call {call.index} after it was closed.")

    def finish(self, status: ItemStatus) -> list[Item]:
        """Closes the open item with ``status``; the output (one empty message when nothing was written)."""
        if self.open is None and not self.items:
            self.open = _OpenText(MESSAGE, 0, self.events)
        self._close(status)
        return self.items

    def _write(self, kind: _TextKind, text: str) -> None:
        if self.open is None or not self.open.writes(kind):
            self._close("completed")
            self.open = _OpenText(kind, len(self.items), self.events)
        self.open.append(text)

    def _close(self, status: ItemStatus) -> None:
        if self.open is not None:
            self.items.append(self.open.close(status))
            self.open = None
