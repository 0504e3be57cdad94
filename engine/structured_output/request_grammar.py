"""``RequestGrammar``: one request's position in its grammar (an xgrammar matcher), as the core drives it.

The scheduler advances it on every sampled token (``accept_token``) and finishes the request once
it ``is_terminated``; before each step that samples the request, the manager writes its allowed
tokens into one row of the step's bitmask (``fill_bitmask``). ``rollback`` takes back accepted
tokens (speculative decoding's rejected drafts).
"""

from __future__ import annotations

import torch
import xgrammar as xgr


class RequestGrammar:
    """Implements ``engine.sched.request.Grammar``; not thread-safe (the core's loop alone drives it)."""

    def __init__(self, matcher: xgr.GrammarMatcher) -> None:
        self._matcher = matcher
        self.num_accepted_tokens = 0

    def accept_token(self, token_id: int) -> bool:
        """Advances past ``token_id``; False (and nothing changes) if the grammar does not allow it here."""
        if self._matcher.accept_token(token_id):
            self.num_accepted_tokens += 1
            return True
        return False

    def accept_string(self, data: bytes) -> bool:
        """Advances past ``data`` as one step (one token to ``rollback``); False (nothing changes) if not allowed.
        The bytes of a token that only partly belongs to the constrained output (``reasoning_gate``)."""
        if self._matcher.accept_string(data):
            self.num_accepted_tokens += 1
            return True
        return False

    def is_terminated(self) -> bool:
        """True once the grammar is complete and its stop token was accepted: the output is whole."""
        return self._matcher.is_terminated()

    def rollback(self, num_tokens: int) -> None:
        """Takes back the last ``num_tokens`` accepted tokens."""
        if num_tokens:
            self._matcher.rollback(num_tokens)
            self.num_accepted_tokens -= num_tokens

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Writes the tokens allowed next into ``bitmask[row]`` (int32, bit i of word j: token 32 * j + i)."""
        self._matcher.fill_next_token_bitmask(bitmask, row)
