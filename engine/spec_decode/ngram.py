"""N-gram (prompt lookup) proposer: drafts what followed the context's last n tokens the last time
they appeared in the context (prompt and output). No model; numpy over each request's tokens.

The longest n from ``prompt_lookup_max`` down to ``prompt_lookup_min`` whose suffix n-gram occurs
earlier wins; of its occurrences the earliest is taken (the longest continuation to copy). It pays
off where outputs repeat their context (code edits, summaries quoting the text, retrieval).
"""

from __future__ import annotations

import numpy as np

from engine.config import SpeculativeConfig
from engine.spec_decode.proposer import ProposerInputs


class NgramProposer:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max

    def propose(self, inputs: ProposerInputs) -> list[list[int]]:
        return [
            propose_ngram(state.token_ids, self.min_n, self.max_n, num) if num > 0 else []
            for state, num in zip(inputs.states, inputs.max_num_drafts)
        ]


def propose_ngram(token_ids: list[int], min_n: int, max_n: int, num_drafts: int) -> list[int]:
    """Up to ``num_drafts`` tokens that followed the earliest earlier occurrence of the longest suffix
    n-gram of ``token_ids`` (``min_n <= n <= max_n``); [] when none occurs."""
    tokens = np.asarray(token_ids, dtype=np.int64)  # [L]
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        # Windows starting at 0 .. length - n - 1: every n-gram but the suffix itself.
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)  # [length - n, n]
        matches = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
        if len(matches):
            start = int(matches[0]) + n
            return token_ids[start : start + num_drafts]
    return []
