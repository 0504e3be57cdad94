"""One generated choice's text split into what a chat-style answer carries: the reasoning (a
``reasoning_parser``, ``engine.reasoning``), then, in the part after it, content and tool calls (a
``tool_parsers`` parser). Chat completions and the Messages API share it.

``ChoiceParser.feed(text)`` takes the text as it is generated and ``finish()`` once at the end; each returns a
``ChoiceDelta``. A response that is not streamed is the same parser fed the whole text once (``parse``), so a
stream reassembles into exactly the non-streamed answer, however it is cut.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.entrypoints.openai.responses import DeltaToolCall, FunctionCall, ToolCall
from engine.entrypoints.openai.tool_parsers import ParsedDelta, ToolParser
from engine.reasoning import ReasoningParser, ReasoningStream


@dataclass
class ChoiceDelta:
    """What one piece of text adds: reasoning, content and tool-call deltas (OpenAI's), in that order."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[DeltaToolCall] = field(default_factory=list)

    def extend(self, other: ChoiceDelta) -> ChoiceDelta:
        self.reasoning += other.reasoning
        self.content += other.content
        self.tool_calls.extend(other.tool_calls)
        return self


@dataclass
class ParsedChoice:
    """A whole choice: ``reasoning`` None when it held none; ``content`` None when it is empty and tool calls
    or a reasoning were made (OpenAI's null content)."""

    reasoning: str | None
    content: str | None
    tool_calls: list[ToolCall]


class ChoiceParser:
    """One choice's reasoning stream (None: no reasoning parser) feeding its tool parser (None: plain content)."""

    def __init__(
        self, reasoning: ReasoningParser | None, tools: ToolParser | None, prompt_text: str | None = None
    ) -> None:
        """``prompt_text``: the rendered prompt the choice follows (its last tag may open or close a reasoning)."""
        self.reasoning: ReasoningStream | None = None if reasoning is None else reasoning.stream(prompt_text)
        self.tools = tools

    @property
    def num_calls(self) -> int:
        return 0 if self.tools is None else self.tools.num_calls

    def feed(self, text: str) -> ChoiceDelta:
        if self.reasoning is None:
            return self._content(text)
        reasoning, content = self.reasoning.feed(text)
        return ChoiceDelta(reasoning=reasoning).extend(self._content(content))

    def finish(self) -> ChoiceDelta:
        delta = ChoiceDelta()
        if self.reasoning is not None:
            reasoning, content = self.reasoning.finish()
            delta = ChoiceDelta(reasoning=reasoning).extend(self._content(content))
        if self.tools is not None:
            delta.extend(_from_parsed(self.tools.finish()))
        return delta

    def _content(self, text: str) -> ChoiceDelta:
        if self.tools is None:
            return ChoiceDelta(content=text)
        return _from_parsed(self.tools.feed(text))

    def parse(self, text: str) -> ParsedChoice:
        """A whole text's reasoning, content and tool calls (this parser must be fresh)."""
        delta = self.feed(text).extend(self.finish())
        calls: list[ToolCall] = []
        for piece in delta.tool_calls:
            if piece.id is not None:
                calls.append(ToolCall(id=piece.id, function=FunctionCall(name=piece.function.name, arguments="")))
            calls[piece.index].function.arguments += piece.function.arguments or ""
        has_reasoning = self.reasoning is not None and self.reasoning.has_reasoning
        content = delta.content if delta.content or not (calls or has_reasoning) else None
        return ParsedChoice(delta.reasoning if has_reasoning else None, content, calls)

    def num_reasoning_tokens(self, tokenizer: Any, token_ids: Sequence[int], skip_special_tokens: bool) -> int:
        """How many of the choice's ``token_ids`` its reasoning took: those up to the one that ended it (its tags
        included), all of them while it never ended, none without one. Call after the last ``feed``."""
        stream = self.reasoning
        if stream is None or not stream.has_reasoning:
            return 0
        if stream.content_start is None:
            return len(token_ids)
        low, high = 1, len(token_ids)  # the fewest tokens whose text reaches the content's start
        while low < high:
            middle = (low + high) // 2
            text = tokenizer.decode(
                token_ids[:middle], skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
            )
            if len(text) >= stream.content_start:
                high = middle
            else:
                low = middle + 1
        return low


def _from_parsed(parsed: ParsedDelta) -> ChoiceDelta:
    return ChoiceDelta(content=parsed.content, tool_calls=parsed.tool_calls)
