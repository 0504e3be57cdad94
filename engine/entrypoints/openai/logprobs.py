"""The engine's per-position logprobs in OpenAI's two formats.

A position is ``{token id: Logprob}`` holding the chosen token and the top-N
alternatives (``engine.request_output``); the first prompt position is ``None`` (no
context). JSON has no infinities, so ``-inf`` goes out as ``-9999.0`` (what
OpenAI sends).
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.entrypoints.openai.responses import (
    ChatCompletionLogProbs,
    ChatLogProb,
    ChatLogProbsContent,
    CompletionLogProbs,
)
from engine.request_output import Logprob, PositionLogprobs

MIN_LOGPROB = -9999.0


def _finite(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)


def _token_text(token_id: int, logprob: Logprob | None, tokenizer) -> str:
    if logprob is not None and logprob.decoded_token is not None:
        return logprob.decoded_token
    return tokenizer.decode([token_id])


def completion_logprobs(
    token_ids: Sequence[int], positions: Sequence[PositionLogprobs | None], tokenizer, initial_text_offset: int = 0
) -> CompletionLogProbs:
    """The legacy format: per token its text, logprob, offset and ``{text: logprob}`` of the alternatives.

    ``text_offset`` counts characters from ``initial_text_offset`` by each
    token's own text, as vLLM does.
    """
    result = CompletionLogProbs()
    offset = initial_text_offset
    for token_id, position in zip(token_ids, positions):
        chosen = position.get(token_id) if position is not None else None
        token = _token_text(token_id, chosen, tokenizer)
        result.tokens.append(token)
        result.text_offset.append(offset)
        offset += len(token)
        if position is None:
            result.token_logprobs.append(None)
            result.top_logprobs.append(None)
            continue
        result.token_logprobs.append(_finite(chosen.logprob) if chosen is not None else None)
        result.top_logprobs.append(
            {_token_text(alt_id, alt, tokenizer): _finite(alt.logprob) for alt_id, alt in position.items()}
        )
    return result


def chat_logprobs(
    token_ids: Sequence[int], positions: Sequence[PositionLogprobs], num_top_logprobs: int, tokenizer
) -> ChatCompletionLogProbs:
    """The chat format: per token its logprob and bytes plus the ``num_top_logprobs`` most likely tokens."""
    content = []
    for token_id, position in zip(token_ids, positions):
        chosen = position[token_id]
        top = sorted(
            (item for item in position.items() if item[1].rank is not None and item[1].rank <= num_top_logprobs),
            key=lambda item: item[1].rank,
        )
        content.append(
            ChatLogProbsContent(
                **_chat_logprob(token_id, chosen, tokenizer).model_dump(),
                top_logprobs=[_chat_logprob(alt_id, alt, tokenizer) for alt_id, alt in top],
            )
        )
    return ChatCompletionLogProbs(content=content)


def _chat_logprob(token_id: int, logprob: Logprob, tokenizer) -> ChatLogProb:
    token = _token_text(token_id, logprob, tokenizer)
    return ChatLogProb(token=token, logprob=_finite(logprob.logprob), bytes=list(token.encode("utf-8")))
