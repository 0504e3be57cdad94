"""Incremental scans of JSON text as a model generates it (for streamed tool calls).

``JsonCompactor`` drops the whitespace between JSON tokens, chunk by chunk: the
compaction of a prefix is a prefix of the whole's compaction, so fragments can
go out as they arrive. ``ToolArrayScanner`` follows ``[{"name": ..., "parameters":
...}, ...]`` (the shape a required ``tool_choice`` constrains the output to) and
says, at any point, each element's name once complete and where its parameters
text begins and (once known) ends. Both tolerate truncated input (a completion
cut by ``max_tokens``): they report what they have seen.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

_WHITESPACE = " \t\n\r"


class JsonCompactor:
    """Removes whitespace outside JSON strings from text fed piece by piece."""

    def __init__(self) -> None:
        self.in_string = False
        self.escaped = False

    def feed(self, text: str) -> str:
        kept = []
        for char in text:
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif char == "\\":
                    self.escaped = True
                elif char == '"':
                    self.in_string = False
            elif char == '"':
                self.in_string = True
            elif char in _WHITESPACE:
                continue
            kept.append(char)
        return "".join(kept)


@dataclass
class ToolArrayElement:
    """One element seen so far: its name once its string closed, its parameters' span in the text."""

    name: str | None = None
    parameters_start: int | None = None
    parameters_end: int | None = None  # None while the value is still being generated


class ToolArrayScanner:
    """Follows a JSON array of objects, recording each object's ``name`` and ``parameters`` members.

    ``member`` is where the current element's member stands: ``key`` (a key string is next), ``colon``,
    ``value`` (its value is next), ``in_value`` (from ``value_start``) or ``after`` (a ',' or '}' is next).
    """

    def __init__(self) -> None:
        self.text = ""
        self.elements: list[ToolArrayElement] = []
        self.stack: list[str] = []  # open brackets outside strings
        self.in_string = False
        self.escaped = False
        self.string_start = 0
        self.member = "key"
        self.key: str | None = None
        self.value_start = 0
        self.in_primitive = False  # a number / true / false / null member value

    def feed(self, text: str) -> None:
        start = len(self.text)
        self.text += text
        for position in range(start, len(self.text)):
            self._step(position, self.text[position])

    def parameters_text(self, element: ToolArrayElement) -> str:
        """The element's parameters text so far ('' before it starts)."""
        if element.parameters_start is None:
            return ""
        end = len(self.text) if element.parameters_end is None else element.parameters_end
        return self.text[element.parameters_start : end]

    def _at_member_level(self) -> bool:
        return self.stack == ["[", "{"]

    def _step(self, position: int, char: str) -> None:
        if self.in_string:
            self._string_step(position, char)
            return
        if self.in_primitive:
            if char not in ",}]" + _WHITESPACE:
                return
            self._end_value(position)
        if char in _WHITESPACE:
            return
        at_member_level = self._at_member_level()
        if at_member_level and self.member == "value":
            self._start_value(position, is_primitive=char not in '"[{')
            if self.in_primitive:
                return
        if char == '"':
            self.in_string, self.string_start = True, position
        elif char in "[{":
            if self.stack == ["["]:
                self.elements.append(ToolArrayElement())
                self.member, self.key = "key", None
            self.stack.append(char)
        elif char in "]}":
            if self.stack:
                self.stack.pop()
            if self._at_member_level() and self.member == "in_value":
                self._end_value(position + 1)  # a container value closed
        elif at_member_level and char == ":" and self.member == "colon":
            self.member = "value"
        elif at_member_level and char == "," and self.member == "after":
            self.member, self.key = "key", None

    def _string_step(self, position: int, char: str) -> None:
        if self.escaped:
            self.escaped = False
        elif char == "\\":
            self.escaped = True
        elif char == '"':
            self.in_string = False
            if not self._at_member_level():
                return
            if self.member == "key":
                self.key, self.member = json.loads(self.text[self.string_start : position + 1]), "colon"
            elif self.member == "in_value":
                self._end_value(position + 1)

    def _start_value(self, position: int, is_primitive: bool) -> None:
        self.member, self.value_start, self.in_primitive = "in_value", position, is_primitive
        if self.key == "parameters":
            self.elements[-1].parameters_start = position

    def _end_value(self, end: int) -> None:
        self.member, self.in_primitive = "after", False
        element = self.elements[-1]
        if self.key == "parameters" and element.parameters_end is None:
            element.parameters_end = end
        elif self.key == "name" and element.name is None and self.text[self.value_start] == '"':
            element.name = json.loads(self.text[self.value_start : end])
