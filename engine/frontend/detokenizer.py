"""Incremental detokenization and stop-string matching, one object per request.

Algorithm (vLLM's prefix / read offsets): the text of the new tokens is
``decode(ids[prefix:]) - decode(ids[prefix:read])``, decoding a small window
that starts a few tokens back so that decoders that depend on context (e.g.
SentencePiece's leading-space stripping) see the same neighbours as a full
decode. A window whose text ends in U+FFFD is an incomplete UTF-8 character:
nothing is emitted until later tokens complete it (or the request finishes,
when whatever is pending is flushed as :meth:`tokenizer.decode` would show it).

Guarantee: for a concatenative decoder (byte-level BPE, SentencePiece with
byte fallback), the finished ``output_text`` equals
``tokenizer.decode(output_ids, skip_special_tokens=..., clean_up_tokenization_spaces=False)``
cut at the first stop string. ``spaces_between_special_tokens`` only affects
HF *slow* tokenizers; fast tokenizers (the only kind supported here) ignore it,
as vLLM's fast detokenizer does. Pure Python: no torch.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.sampling_params import SamplingParams

# Prompt tokens kept as left context of the first window (vLLM uses 5).
NUM_PROMPT_CONTEXT_TOKENS = 5
REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns one request's output token ids into text as they arrive.

    Use: ``stop_str = detok.update(new_ids, is_finished=...)`` after every
    step, then ``detok.get_next_output_text(finished, delta)`` for what to send.
    """

    def __init__(self, tokenizer, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = params.skip_special_tokens
        self.stop = list(params.stop)
        self.min_tokens = params.min_tokens
        self.include_stop_str_in_output = params.include_stop_str_in_output
        # Characters held back while streaming: a stop string may be starting there.
        self.stop_buffer_length = (
            max(len(s) for s in self.stop) - 1 if self.stop and not self.include_stop_str_in_output else 0
        )
        context = list(prompt_token_ids[-NUM_PROMPT_CONTEXT_TOKENS:])
        self.token_ids: list[int] = context  # window context + all output tokens
        self.prefix_offset = 0
        self.read_offset = len(context)
        self.num_context_tokens = len(context)
        self.output_text = ""
        self.stop_reason: str | None = None
        self._num_sent_chars = 0
        self._stream = _make_decode_stream(tokenizer, self.skip_special_tokens)
        self._stream_text = ""  # everything the stream produced (before any stop-string cut)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_context_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_context_tokens

    @property
    def is_stopped(self) -> bool:
        """True once a stop string matched; the request must be aborted in the core."""
        return self.stop_reason is not None

    def update(
        self, new_token_ids: Sequence[int], is_finished: bool = False, is_stop_token: bool = False
    ) -> str | None:
        """Adds ``new_token_ids``; returns the stop string that matched, else None.

        ``is_finished``: the core finished the request with these tokens
        (flushes an incomplete trailing character). ``is_stop_token``: the last
        token is EOS / a stop_token_id; it is kept out of the text unless
        ``include_stop_str_in_output``. After a stop-string match the text is
        cut, ``num_output_tokens`` counts the tokens up to the one that completed
        it (later ones of ``new_token_ids`` are dropped), and later calls are ignored.
        """
        if self.is_stopped:
            return None
        new_token_ids = list(new_token_ids)
        if is_stop_token and new_token_ids and not self.include_stop_str_in_output:
            new_token_ids = new_token_ids[:-1]
        num_chars_before = len(self.output_text)
        for index, token_id in enumerate(new_token_ids):
            self.token_ids.append(token_id)
            self.output_text += self._decode_next(is_flush=False)
            # Token by token: a step may bring several (speculative decoding), and those after the one
            # that completes a stop string are not part of the output (``num_output_tokens`` ends there).
            if self.stop and index + 1 < len(new_token_ids) and self.num_output_tokens > self.min_tokens:
                if self._check_stop_strings(num_chars_before) is not None:
                    return self.stop_reason
                num_chars_before = len(self.output_text)
        if is_finished or is_stop_token:
            self.output_text += self._decode_next(is_flush=True)
        if self.stop and self.num_output_tokens > self.min_tokens:
            return self._check_stop_strings(num_chars_before)
        return None

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """The text to send now: the full text so far, or (``delta``) only the unsent part.

        Until ``finished``, the last ``stop_buffer_length`` characters are held
        back so that a stop string is never partially streamed.
        """
        buffer_length = 0 if finished or self.is_stopped else self.stop_buffer_length
        end = len(self.output_text) - buffer_length
        if not delta:
            return self.output_text[: max(end, 0)]
        if end <= self._num_sent_chars:
            return ""
        start, self._num_sent_chars = self._num_sent_chars, end
        return self.output_text[start:end]

    def _decode_next(self, is_flush: bool) -> str:
        """Text of ``token_ids[read_offset:]`` once it ends in a whole character (or on flush)."""
        if self._stream is not None:
            return self._stream_next(is_flush)
        if self.read_offset >= len(self.token_ids):
            return ""
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.token_ids[self.prefix_offset :])
        if not is_flush and (len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR)):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        return new_text[len(prefix_text) :]

    def _stream_next(self, is_flush: bool) -> str:
        """The fast path: the tokenizer's own incremental decoder (no re-decoding of earlier tokens)."""
        text = ""
        while self.read_offset < len(self.token_ids):
            chunk = self._stream.step(self.tokenizer.backend_tokenizer, self.token_ids[self.read_offset])
            self.read_offset += 1
            if chunk:
                text += chunk
        if is_flush:  # bytes of an unfinished character: show them as decode() does
            full = self._decode(self.token_ids[self.num_context_tokens :])
            emitted = self._stream_text + text
            if len(full) > len(emitted) and full.startswith(emitted):
                text += full[len(emitted) :]
        self._stream_text += text
        return text

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(
            token_ids, skip_special_tokens=self.skip_special_tokens, clean_up_tokenization_spaces=False
        )

    def _check_stop_strings(self, num_chars_before: int) -> str | None:
        match = find_stop_string(self.output_text, num_chars_before, self.stop)
        if match is None:
            return None
        stop_str, stop_index = match
        end = stop_index + len(stop_str) if self.include_stop_str_in_output else stop_index
        self.output_text = self.output_text[:end]
        self.stop_reason = stop_str
        return stop_str


def _make_decode_stream(tokenizer, skip_special_tokens: bool):
    """A ``tokenizers`` DecodeStream for byte-level BPE tokenizers (their text needs no left
    context); None for other tokenizers, which take the windowed path."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or type(backend.decoder).__name__ != "ByteLevel":
        return None
    from tokenizers.decoders import DecodeStream

    return DecodeStream(skip_special_tokens=skip_special_tokens)


def find_stop_string(text: str, num_old_chars: int, stop: Sequence[str]) -> tuple[str, int] | None:
    """The earliest stop string in ``text`` that ends after ``text[:num_old_chars]``.

    Returns ``(stop_str, start_index)``; ties at one index go to the stop
    string listed first. Old text was already checked, so only matches that
    overlap the new characters are looked for.
    """
    best: tuple[str, int] | None = None
    for stop_str in stop:
        start = max(0, num_old_chars - len(stop_str) + 1)
        index = text.find(stop_str, start)
        if index != -1 and (best is None or index < best[1]):
            best = (stop_str, index)
    return best
