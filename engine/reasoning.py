"""Reasoning content: the text a reasoning model writes between ``<think>`` and ``</think>``, split from its
answer (vLLM's ``--reasoning-parser``; the engine argument ``reasoning_parser``, one of ``REASONING_PARSERS``).

The interface (stable: chat completions, the Responses API and the Messages API use it):

* ``reasoning_parser(name) -> ReasoningParser`` (None for None); ``REASONING_PARSERS`` holds them by name.
* Not streamed: ``parser.extract(text, prompt=None) -> (reasoning | None, content | None)``: ``reasoning`` is
  None when the output held no reasoning, ``content`` None when nothing followed it.
* Streamed: ``stream = parser.stream(prompt=None)``, then ``stream.feed(delta) -> ReasoningDelta(reasoning,
  content)`` for each piece of text and ``stream.finish()`` once at the end (what was held back: a piece
  that may begin a tag). The pieces of a stream join into exactly what ``extract`` returns for the whole
  text, however it is cut. ``stream.has_reasoning``: whether reasoning began; ``stream.content_start``: the
  offset in the output where the content begins (after the end tag; None while reasoning goes on).

The rules (one ``Phase`` machine, the same for text and, in the engine core, for tokens' bytes):

* ``deepseek_r1``: the model starts inside its reasoning (the chat template may have opened it); a leading
  ``<think>`` is dropped; everything before the first ``</think>`` is reasoning, the rest content. No
  ``</think>``: all of it is reasoning (a cut-short thought is still a thought).
* ``qwen3``: reasoning only when the output opens with ``<think>``; then up to ``</think>`` as above;
  otherwise all of it is content (Qwen3 with ``enable_thinking: false``, or a model that did not think).

``prompt`` (the rendered prompt's text) moves the start: when its last tag is an open ``<think>``, the
output starts inside the reasoning (both parsers); when it is ``</think>`` (the reasoning prefilled or
switched off), ``deepseek_r1``'s output is all content and ``qwen3``'s may open a new reasoning with a
leading ``<think>`` (Qwen3's template keeps the reasoning of earlier turns of a tool loop). Tags are
matched as text, exactly; a ``<think>`` later in the content is content. vLLM differs on one case: its
``qwen3`` returns a reasoning that never closed as content when not streamed; here it is reasoning, streamed
or not.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import AnyStr, Generic, Literal, NamedTuple

ReasoningParserName = Literal["qwen3", "deepseek_r1"]


class Phase(enum.Enum):
    """Where an output is: it may still open a reasoning, it is inside one, or it is the content."""

    OPENING = "opening"
    REASONING = "reasoning"
    CONTENT = "content"


class ReasoningDelta(NamedTuple, Generic[AnyStr]):
    """What one piece of output adds: to the reasoning and to the content (either may be empty)."""

    reasoning: AnyStr
    content: AnyStr


@dataclass(frozen=True)
class ReasoningParser:
    """One ``reasoning_parser``: its tags and whether its model starts inside the reasoning."""

    name: ReasoningParserName
    start_tag: str = "<think>"
    end_tag: str = "</think>"
    starts_in_reasoning: bool = False

    def initial_phase(self, prompt: AnyStr | None = None) -> Phase:
        """The phase the output starts in, after ``prompt`` (text, or bytes with the tags UTF-8 encoded)."""
        start, end = self._tags(type(prompt) if prompt is not None else str)
        last_start = -1 if prompt is None else prompt.rfind(start)
        last_end = -1 if prompt is None else prompt.rfind(end)
        if last_start > last_end:
            return Phase.REASONING
        if not self.starts_in_reasoning:
            return Phase.OPENING
        return Phase.CONTENT if last_end >= 0 else Phase.REASONING

    def stream(self, prompt: AnyStr | None = None, *, binary: bool = False) -> ReasoningStream:
        """A stream over one output's pieces (bytes with ``binary`` or a bytes ``prompt``, else text)."""
        kind = bytes if binary or isinstance(prompt, bytes) else str
        phase = self.initial_phase(prompt)
        # deepseek_r1's model may write the <think> its template did not: dropped, if it leads the output.
        opened_by_prompt = prompt is not None and self._tags(kind)[0] in prompt
        at_start = phase is Phase.OPENING or (phase is Phase.REASONING and not opened_by_prompt)
        return ReasoningStream(*self._tags(kind), phase, at_start)

    def extract(self, text: str, prompt: str | None = None) -> tuple[str | None, str | None]:
        """``(reasoning, content)`` of a whole output (see the module docstring)."""
        stream = self.stream(prompt)
        reasoning, content = stream.feed(text)
        rest = stream.finish()
        reasoning, content = reasoning + rest.reasoning, content + rest.content
        if not stream.has_reasoning:
            return None, content
        return reasoning, content or None

    def _tags(self, kind: type) -> tuple:
        if kind is bytes:
            return self.start_tag.encode(), self.end_tag.encode()
        return self.start_tag, self.end_tag


class ReasoningStream(Generic[AnyStr]):
    """One output's ``Phase`` machine, fed its text (or bytes) piece by piece (see the module docstring)."""

    def __init__(self, start_tag: AnyStr, end_tag: AnyStr, phase: Phase, at_start: bool) -> None:
        self.start_tag, self.end_tag = start_tag, end_tag
        self.phase = phase
        self.at_start = at_start  # nothing decided yet: a leading start tag opens (or, reasoning, is dropped)
        self.has_reasoning = phase is Phase.REASONING
        self.content_start: int | None = 0 if phase is Phase.CONTENT else None
        self.held = start_tag[:0]  # the end of what was fed that may begin a tag
        self.num_fed = 0

    @property
    def state(self) -> tuple:
        """Everything that changes as it is fed (a caller that takes tokens back restores an earlier one)."""
        return self.phase, self.at_start, self.has_reasoning, self.content_start, self.held, self.num_fed

    @state.setter
    def state(self, value: tuple) -> None:
        self.phase, self.at_start, self.has_reasoning, self.content_start, self.held, self.num_fed = value

    @property
    def num_opening_matched(self) -> int:
        """How much of the start tag the output has written so far while it may still open a reasoning."""
        return len(self.held) if self.at_start else 0

    def feed(self, piece: AnyStr) -> ReasoningDelta:
        """What ``piece`` adds; text that may begin a tag is held back until it is decided."""
        pending, self.held = self.held + piece, piece[:0]
        position = self.num_fed - (len(pending) - len(piece))  # the output offset of pending[0]
        self.num_fed += len(piece)
        reasoning, content = piece[:0], piece[:0]
        if self.at_start:
            if len(pending) < len(self.start_tag) and self.start_tag.startswith(pending):
                self.held = pending
                return ReasoningDelta(reasoning, content)
            self.at_start = False
            if pending.startswith(self.start_tag):
                pending, position = pending[len(self.start_tag) :], position + len(self.start_tag)
                self.phase, self.has_reasoning = Phase.REASONING, True
            elif self.phase is Phase.OPENING:
                self.phase, self.content_start = Phase.CONTENT, 0
        if self.phase is Phase.REASONING:
            end = pending.find(self.end_tag)
            if end < 0:
                keep = _partial_tag_length(pending, self.end_tag)
                self.held = pending[len(pending) - keep :]
                return ReasoningDelta(pending[: len(pending) - keep], content)
            reasoning, pending = pending[:end], pending[end + len(self.end_tag) :]
            self.phase, self.content_start = Phase.CONTENT, position + end + len(self.end_tag)
        return ReasoningDelta(reasoning, pending)

    def finish(self) -> ReasoningDelta:
        """The held-back rest: reasoning inside one, else content (a start tag left unfinished is content)."""
        held, self.held = self.held, self.held[:0]
        empty = held[:0]
        if self.at_start and self.phase is Phase.OPENING:
            self.at_start, self.phase, self.content_start = False, Phase.CONTENT, 0
        self.at_start = False
        if self.phase is Phase.REASONING:
            return ReasoningDelta(held, empty)
        return ReasoningDelta(empty, held)


def _partial_tag_length(text: AnyStr, tag: AnyStr) -> int:
    """The length of the longest end of ``text`` that is a proper beginning of ``tag``."""
    for size in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


REASONING_PARSERS: dict[str, ReasoningParser] = {
    "qwen3": ReasoningParser("qwen3"),
    "deepseek_r1": ReasoningParser("deepseek_r1", starts_in_reasoning=True),
}


def reasoning_parser(name: str | None) -> ReasoningParser | None:
    """The parser of that name (None: none); ValueError naming the choices for an unknown one."""
    if name is None:
        return None
    if name not in REASONING_PARSERS:
        raise ValueError(f"Unknown reasoning_parser {name!r}; choose one of {', '.join(REASONING_PARSERS)}.")
    return REASONING_PARSERS[name]
