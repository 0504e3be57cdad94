"""Tool calls out of a chat completion's text, one piece of text at a time.

A parser is fed a choice's text as it is generated (``feed``) and told when it
ends (``finish``); each call returns a ``ParsedDelta``: content to send and
OpenAI tool-call deltas (a call's first delta carries ``id``, ``type``,
``function.name`` and ``arguments: ""``, later ones argument fragments). A
response that is not streamed is the same parser fed the whole text once
(``choice_parser.ChoiceParser.parse``), so a stream reassembles into exactly the
non-streamed message, whatever the chunking.

* ``NamedToolParser``: the whole output is the named tool's arguments.
* ``RequiredToolParser``: the output is ``[{"name": ..., "parameters": {...}}, ...]``
  (``tool_calls.required_tools_schema``); each element's arguments stream as
  they are generated.
* ``HermesToolParser`` (``tool_choice`` auto): ``<tool_call>{"name": ...,
  "arguments": {...}}</tool_call>`` blocks; text that may begin a tag is held
  back until it is decided, and a block is only sent once it is complete and
  valid (a malformed one stays content).

Arguments are compact JSON: the named / required ones are the model's own text
without the whitespace between JSON tokens, the Hermes ones ``json.dumps``
of the parsed arguments.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from engine.entrypoints.openai.json_scan import JsonCompactor, ToolArrayScanner
from engine.entrypoints.openai.responses import DeltaFunctionCall, DeltaToolCall
from engine.entrypoints.openai.tool_calls import ToolFields

TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"


@dataclass
class ParsedDelta:
    """What one piece of text adds to the message: content, and tool-call deltas in order."""

    content: str = ""
    tool_calls: list[DeltaToolCall] = field(default_factory=list)

    def extend(self, other: ParsedDelta) -> ParsedDelta:
        self.content += other.content
        self.tool_calls.extend(other.tool_calls)
        return self


class ToolParser:
    """Base: numbers the calls and builds their deltas; subclasses say where calls are in the text."""

    def __init__(self) -> None:
        self.num_calls = 0

    def feed(self, text: str) -> ParsedDelta:
        raise NotImplementedError

    def finish(self) -> ParsedDelta:
        return ParsedDelta()

    def _start_call(self, name: str) -> DeltaToolCall:
        self.num_calls += 1
        return DeltaToolCall(
            index=self.num_calls - 1,
            id=f"call_{uuid.uuid4().hex[:24]}",
            type="function",
            function=DeltaFunctionCall(name=name, arguments=""),
        )

    @staticmethod
    def _arguments(index: int, fragment: str) -> DeltaToolCall:
        return DeltaToolCall(index=index, function=DeltaFunctionCall(arguments=fragment))


class NamedToolParser(ToolParser):
    """``tool_choice`` naming one function: one call, the whole output its arguments."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        self.compactor = JsonCompactor()

    def feed(self, text: str) -> ParsedDelta:
        delta = ParsedDelta()
        if self.num_calls == 0:
            delta.tool_calls.append(self._start_call(self.name))
        fragment = self.compactor.feed(text)
        if fragment:
            delta.tool_calls.append(self._arguments(0, fragment))
        return delta

    def finish(self) -> ParsedDelta:
        return self.feed("") if self.num_calls == 0 else ParsedDelta()


class RequiredToolParser(ToolParser):
    """``tool_choice`` required: the array's elements become calls as their names complete."""

    def __init__(self) -> None:
        super().__init__()
        self.scanner = ToolArrayScanner()
        self.compactors: list[JsonCompactor] = []
        self.num_raw_sent: list[int] = []  # per call: characters of its parameters text handed on
        self.text = ""

    def feed(self, text: str) -> ParsedDelta:
        self.text += text
        self.scanner.feed(text)
        delta = ParsedDelta()
        for index, element in enumerate(self.scanner.elements):
            if element.name is None:
                break  # calls go out in order: a later one waits for this one's name
            if index == self.num_calls:
                delta.tool_calls.append(self._start_call(element.name))
                self.compactors.append(JsonCompactor())
                self.num_raw_sent.append(0)
            raw = self.scanner.parameters_text(element)
            fragment = self.compactors[index].feed(raw[self.num_raw_sent[index] :])
            self.num_raw_sent[index] = len(raw)
            if fragment:
                delta.tool_calls.append(self._arguments(index, fragment))
        return delta

    def finish(self) -> ParsedDelta:
        # Nothing was a call (cut short before the first name): the text is all there is to show.
        return ParsedDelta(content=self.text) if self.num_calls == 0 else ParsedDelta()


class HermesToolParser(ToolParser):
    """``tool_choice`` auto: ``<tool_call>`` blocks anywhere in the text, several allowed.

    Content is the text outside the blocks; the whitespace around a block is dropped, except that two
    pieces of content either side of blocks keep the whitespace that preceded the first block between them.
    """

    def __init__(self) -> None:
        super().__init__()
        self.pending = ""  # text not decided yet: a possible tag start, or a whole open block
        self.in_block = False
        self.after_block = False  # drop the whitespace that follows a block
        self.has_content = False
        self.separator = ""  # whitespace before a block, sent only if more content follows

    def feed(self, text: str) -> ParsedDelta:
        self.pending += text
        delta = ParsedDelta()
        while True:
            if self.in_block:
                end = self.pending.find(TOOL_CALL_END)
                if end < 0:
                    return delta
                delta.extend(self._close_block(self.pending[:end]))
                self.pending = self.pending[end + len(TOOL_CALL_END) :]
                continue
            start = self.pending.find(TOOL_CALL_START)
            if start < 0:
                keep = _held_back(self.pending)
                delta.content += self._content(self.pending[: len(self.pending) - keep])
                self.pending = self.pending[len(self.pending) - keep :]
                return delta
            before = self.pending[:start]
            delta.content += self._content(before.rstrip())
            if self.has_content and not self.after_block:
                self.separator += before[len(before.rstrip()) :]
            self.pending = self.pending[start + len(TOOL_CALL_START) :]
            self.in_block = True

    def finish(self) -> ParsedDelta:
        text, self.pending = self.pending, ""
        if self.in_block:  # an unterminated last block still counts when it holds a whole call
            return self._close_block(text, closed=False)
        return ParsedDelta(content=self._content(text))

    def _content(self, text: str) -> str:
        if self.after_block:
            text = text.lstrip()
            self.after_block = not text
        if not text:
            return ""
        text, self.separator, self.has_content = self.separator + text, "", True
        return text

    def _close_block(self, body: str, closed: bool = True) -> ParsedDelta:
        self.in_block = False
        call = _parse_hermes_call(body)
        if call is None:  # malformed: the model's text, tags and all
            return ParsedDelta(content=self._content(TOOL_CALL_START + body + (TOOL_CALL_END if closed else "")))
        self.after_block = True
        name, arguments = call
        start = self._start_call(name)
        return ParsedDelta(tool_calls=[start, self._arguments(start.index, arguments)])


def _held_back(text: str) -> int:
    """How many trailing characters to hold: whitespace and a possible beginning of ``<tool_call>``."""
    for size in range(min(len(text), len(TOOL_CALL_START) - 1), 0, -1):
        if TOOL_CALL_START.startswith(text[-size:]):
            return size + len(text[:-size]) - len(text[:-size].rstrip())
    return len(text) - len(text.rstrip())


def _parse_hermes_call(body: str) -> tuple[str, str] | None:
    """``(name, arguments JSON)`` of a block's ``{"name": ..., "arguments": {...}}``, or None if it is not one."""
    try:
        call = json.loads(body)
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
        return None
    arguments = call.get("arguments", call.get("parameters", {}))
    if isinstance(arguments, str):
        return call["name"], arguments
    if not isinstance(arguments, dict):
        return None
    return call["name"], json.dumps(arguments, ensure_ascii=False, separators=(",", ":"))


def make_tool_parser(request: ToolFields) -> ToolParser | None:
    """The parser a request's ``tool_choice`` needs; None when its text is plain content (``none``)."""
    mode = request.tool_mode
    if mode == "named":
        return NamedToolParser(request.named_tool.name)
    if mode == "required":
        return RequiredToolParser()
    if mode == "auto":
        return HermesToolParser()
    return None
