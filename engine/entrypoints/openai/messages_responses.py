"""Anthropic's Messages API answers: the message (``MessageResponse``), its content blocks as a choice's
text is parsed (``MessageBlocks``), the stream's events (``sse``), and the stop reason.

A choice's ``choice_parser.ChoiceDelta``\\ s become blocks in the order they come: ``thinking`` (the
reasoning), ``text`` (the content) and ``tool_use`` (each tool call, its ``input`` the call's arguments).
Streamed, each block is a ``content_block_start``, its ``content_block_delta``\\ s (``thinking_delta``,
``text_delta``, ``input_json_delta``) and a ``content_block_stop``; not streamed, the same blocks are the
message's ``content``, so both say the same, however the text was cut.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel

from engine.entrypoints.openai.choice_parser import ChoiceDelta
from engine.request_output import CompletionOutput


class MessagesUsage(BaseModel):
    input_tokens: int
    output_tokens: int


class MessageResponse(BaseModel):
    """A non-streamed answer (Anthropic's ``Message``); ``content`` holds the blocks as their JSON objects."""

    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[dict[str, Any]]
    stop_reason: str | None
    stop_sequence: str | None = None
    usage: MessagesUsage


def stop_reason(completion: CompletionOutput, made_tool_calls: bool) -> tuple[str, str | None]:
    """Anthropic's ``(stop_reason, stop_sequence)``: ``max_tokens`` at the length cap, ``tool_use`` for an answer
    that called tools, ``stop_sequence`` (and which) for a stop string met, else ``end_turn``."""
    if completion.finish_reason == "length":
        return "max_tokens", None
    if made_tool_calls:
        return "tool_use", None
    if isinstance(completion.stop_reason, str):  # a stop string; an int is a stop token id
        return "stop_sequence", completion.stop_reason
    return "end_turn", None


def sse(event: dict[str, Any]) -> str:
    """One Anthropic server-sent event: ``event: <type>`` and its JSON."""
    return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"


class MessageBlocks:
    """One answer's content blocks, built from its parser's deltas; ``add`` and ``close`` return the stream
    events, ``blocks`` is the content so far (a ``tool_use``'s ``input`` set when it closes)."""

    def __init__(self, include_thinking: bool = True) -> None:
        """``include_thinking``: False leaves the reasoning out (thinking's ``display: omitted``)."""
        self.include_thinking = include_thinking
        self.blocks: list[dict[str, Any]] = []
        self._open: str | None = None  # the last block's type while it is open
        self._arguments = ""  # the open tool_use's arguments so far

    def add(self, delta: ChoiceDelta) -> list[dict[str, Any]]:
        events = []
        if delta.reasoning and self.include_thinking:
            events += self._ensure("thinking", {"thinking": "", "signature": ""})
            events.append(self._delta({"type": "thinking_delta", "thinking": delta.reasoning}))
            self.blocks[-1]["thinking"] += delta.reasoning
        if delta.content:
            events += self._ensure("text", {"text": ""})
            events.append(self._delta({"type": "text_delta", "text": delta.content}))
            self.blocks[-1]["text"] += delta.content
        for piece in delta.tool_calls:
            if piece.id is not None:  # a call's first piece: a block of its own
                events += self._close()
                events += self._start("tool_use", {"id": piece.id, "name": piece.function.name, "input": {}})
            if piece.function.arguments:
                self._arguments += piece.function.arguments
                events.append(self._delta({"type": "input_json_delta", "partial_json": piece.function.arguments}))
        return events

    def close(self) -> list[dict[str, Any]]:
        """The open block's end (once the answer is complete)."""
        return self._close()

    def _ensure(self, block_type: str, empty: dict[str, Any]) -> list[dict[str, Any]]:
        if self._open == block_type:
            return []
        return self._close() + self._start(block_type, empty)

    def _start(self, block_type: str, empty: dict[str, Any]) -> list[dict[str, Any]]:
        self._open, self._arguments = block_type, ""
        self.blocks.append({"type": block_type, **empty})
        return [{"type": "content_block_start", "index": len(self.blocks) - 1, "content_block": dict(self.blocks[-1])}]

    def _delta(self, delta: dict[str, Any]) -> dict[str, Any]:
        return {"type": "content_block_delta", "index": len(self.blocks) - 1, "delta": delta}

    def _close(self) -> list[dict[str, Any]]:
        if self._open is None:
            return []
        if self._open == "tool_use":
            self.blocks[-1]["input"] = _tool_input(self._arguments)
        self._open = None
        return [{"type": "content_block_stop", "index": len(self.blocks) - 1}]


def _tool_input(arguments: str) -> dict[str, Any]:
    """A call's arguments as its ``input`` object ({} when cut short before they were whole JSON)."""
    try:
        value = json.loads(arguments) if arguments else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}
