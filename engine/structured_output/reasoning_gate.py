"""A constraint that starts where the reasoning ends (vLLM's structured outputs with a ``reasoning_parser``).

With a reasoning parser (and ``structured_outputs_config.enable_in_reasoning`` off), a request's grammar
sees only the output after the reasoning: ``ReasoningGatedGrammar`` wraps the request's ``RequestGrammar``
and runs the parser's ``Phase`` machine (``engine.reasoning``) over the bytes of each accepted token, as the
front end runs it over the text, so both split the output at the same place:

* ``REASONING``: every token is allowed and the grammar does not move (nor can it end the request);
* ``OPENING`` (``qwen3``'s output may still open a reasoning): the grammar's tokens plus those that begin
  the start tag; once a token began it, only tokens that go on with it are allowed until it is complete;
* ``CONTENT``: the grammar's tokens only. The token that ends the reasoning hands the grammar the bytes it
  holds after the end tag (none where, as in Qwen3's and DeepSeek-R1's vocabularies, the tag is one token).

The prompt's tags set the first phase (``ReasoningParser.initial_phase`` of its bytes). Taking tokens back
(``rollback``: speculative decoding's rejected drafts) restores the phase they were accepted in.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.reasoning import Phase, ReasoningParser
from engine.structured_output.request_grammar import RequestGrammar

ALL_ALLOWED = -1  # an int32 bitmask word with every bit set


class ReasoningGate:
    """One parser over one vocabulary: each token's bytes, and the tokens that go on with a start tag."""

    def __init__(self, parser: ReasoningParser, token_bytes: list[bytes], num_words: int) -> None:
        """``token_bytes``: each token id's bytes (xgrammar's ``decoded_vocab``); ``num_words``: a bitmask row's."""
        self.parser = parser
        self.token_bytes = token_bytes
        self.num_words = num_words
        start_tag = parser.start_tag.encode()
        # Built here, in the compile thread that builds the backend: never on the step's path.
        self._opening_masks = [self._going_on(start_tag[matched:]) for matched in range(len(start_tag))]

    def grammar(self, inner: RequestGrammar, prompt_token_ids: Sequence[int]) -> ReasoningGatedGrammar:
        """``inner`` gated for an output that follows ``prompt_token_ids``."""
        prompt = b"".join(self.bytes_of(token_id) for token_id in prompt_token_ids)
        return ReasoningGatedGrammar(inner, self, self.parser.stream(prompt))

    def bytes_of(self, token_id: int) -> bytes:
        return self.token_bytes[token_id] if token_id < len(self.token_bytes) else b""

    def opening_mask(self, num_matched: int) -> torch.Tensor:
        """The int32 bitmask row of the tokens that go on with (or complete) the start tag past ``num_matched``
        of its bytes."""
        return self._opening_masks[num_matched]

    def _going_on(self, rest: bytes) -> torch.Tensor:
        token_ids = [
            token_id
            for token_id, piece in enumerate(self.token_bytes)
            if piece and (rest.startswith(piece) or piece.startswith(rest))
        ]
        return bitmask_row(token_ids, self.num_words)


def bitmask_row(token_ids: list[int], num_words: int) -> torch.Tensor:
    """An int32 bitmask row allowing exactly ``token_ids`` (bit i of word j: token 32 * j + i)."""
    words = [0] * num_words
    for token_id in token_ids:
        words[token_id // 32] |= 1 << (token_id % 32)
    return torch.tensor([word - (1 << 32) if word >= 1 << 31 else word for word in words], dtype=torch.int32)


class ReasoningGatedGrammar:
    """A ``RequestGrammar`` that starts after the reasoning (see the module docstring); same interface."""

    def __init__(self, inner: RequestGrammar, gate: ReasoningGate, stream) -> None:
        self._inner = inner
        self._gate = gate
        self._stream = stream  # engine.reasoning.ReasoningStream over bytes
        # Per token accepted before the content began (and the one that began it): the stream's state
        # before it, and the grammar steps it took (0, or 1 for the bytes after the end tag).
        self._gated: list[tuple[tuple, int]] = []
        self._num_content_tokens = 0  # tokens accepted since, one grammar step each

    def accept_token(self, token_id: int) -> bool:
        if self._stream.phase is Phase.CONTENT:
            return self._accept_content(token_id)
        before = self._stream.state
        piece = self._gate.bytes_of(token_id)
        content = self._stream.feed(piece).content
        if not content:
            self._gated.append((before, 0))
            return True
        accepted = self._inner.accept_token(token_id) if content == piece else self._inner.accept_string(content)
        if not accepted:
            self._stream.state = before
            return False
        self._gated.append((before, 1))
        return True

    def _accept_content(self, token_id: int) -> bool:
        if self._inner.accept_token(token_id):
            self._num_content_tokens += 1
            return True
        return False

    def is_terminated(self) -> bool:
        return self._stream.phase is Phase.CONTENT and self._inner.is_terminated()

    def rollback(self, num_tokens: int) -> None:
        num_content = min(num_tokens, self._num_content_tokens)
        self._inner.rollback(num_content)
        self._num_content_tokens -= num_content
        num_gated = num_tokens - num_content
        if num_gated:
            taken_back = self._gated[len(self._gated) - num_gated :]
            del self._gated[len(self._gated) - num_gated :]
            self._inner.rollback(sum(steps for _, steps in taken_back))
            self._stream.state = taken_back[0][0]

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        phase = self._stream.phase
        if phase is Phase.CONTENT:
            self._inner.fill_bitmask(bitmask, row)
        elif phase is Phase.REASONING:
            bitmask[row].fill_(ALL_ALLOWED)
        elif (num_matched := self._stream.num_opening_matched) > 0:
            bitmask[row].copy_(self._gate.opening_mask(num_matched))
        else:
            self._inner.fill_bitmask(bitmask, row)
            bitmask[row].bitwise_or_(self._gate.opening_mask(0))
