"""Token masks and biases applied to raw logits before penalties (vLLM V1 order).

Every function edits ``logits`` ([num_reqs, vocab] float32) in place and
returns it. Rows not named in the metadata are untouched.
"""

from __future__ import annotations

import torch

from engine.sample.metadata import SamplingMetadata

NEG_INF = float("-inf")


def apply_allowed_token_ids(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Sets every token outside a row's ``allowed_token_ids`` to -inf."""
    for row, allowed in meta.allowed_token_ids.items():
        keep = torch.zeros(logits.shape[1], dtype=torch.bool, device=logits.device)
        keep[torch.as_tensor(allowed, dtype=torch.int64, device=logits.device)] = True
        logits[row].masked_fill_(~keep, NEG_INF)
    return logits


def apply_logit_bias(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Adds each row's ``logit_bias`` to the named tokens."""
    for row, bias in meta.logit_bias.items():
        ids = torch.as_tensor(list(bias.keys()), dtype=torch.int64, device=logits.device)
        values = torch.as_tensor(list(bias.values()), dtype=logits.dtype, device=logits.device)
        logits[row].index_add_(0, ids, values)
    return logits


def apply_bad_words(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Bans the last token of every bad word whose other tokens end the row's output.

    A single-token bad word is always banned (its prefix is empty).
    """
    for row, bad_words in meta.bad_words_token_ids.items():
        output = meta.output_token_ids[row]
        for word in bad_words:
            if is_bad_word_prefix_matched(word, output):
                logits[row, word[-1]] = NEG_INF
    return logits


def is_bad_word_prefix_matched(word: list[int], output_token_ids: list[int]) -> bool:
    """True when all tokens of ``word`` but the last are the tail of ``output_token_ids``."""
    num_prefix = len(word) - 1
    if num_prefix > len(output_token_ids):
        return False
    return num_prefix == 0 or list(output_token_ids[-num_prefix:]) == list(word[:-1])


def apply_min_tokens(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Bans EOS and stop_token_ids for rows that have fewer than ``min_tokens`` outputs."""
    for row, banned in meta.min_tokens_banned_ids.items():
        logits[row, torch.as_tensor(banned, dtype=torch.int64, device=logits.device)] = NEG_INF
    return logits


def apply_all_masks(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """allowed_token_ids, bad words, min_tokens, then logit_bias (vLLM V1 order)."""
    if meta.is_no_masks:
        return logits
    apply_allowed_token_ids(logits, meta)
    apply_bad_words(logits, meta)
    apply_min_tokens(logits, meta)
    apply_logit_bias(logits, meta)
    return logits


def tokenize_bad_words(bad_words: list[str], tokenizer) -> list[list[int]]:
    """Token-id sequences for ``SamplingParams.bad_words`` (vLLM's rule).

    Each word is encoded as-is (left-stripped) and, to also ban it mid-text,
    with a leading space; the spaced form is kept only when it is a different
    word token of the same length. ``tokenizer`` is a HF tokenizer (``encode``).
    """
    sequences: list[list[int]] = []
    for word in bad_words:
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        if not plain:
            continue
        sequences.append(list(plain))
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            sequences.append(list(spaced))
    return sequences
