"""Speculative decoding's counters, as vLLM reports them (``vllm:spec_decode_*``).

The scheduler owns one ``SpecDecodingStats`` and updates it when a step's verified
tokens come back (``observe_draft``); ``SchedulerStats.spec_decoding_stats`` hands out
a copy. Every count is cumulative since the engine started, so a reader turns them
into rates by differencing (Prometheus counters).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodingStats:
    """Drafts verified since start; ``num_accepted_tokens_per_pos[i]``: drafts whose token ``i`` was accepted."""

    num_spec_tokens: int  # drafted tokens per request per step at most (num_speculative_tokens)
    num_drafts: int = 0  # (request, step) pairs that carried at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.num_accepted_tokens_per_pos:
            self.num_accepted_tokens_per_pos = [0] * self.num_spec_tokens

    def observe_draft(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        """Counts one request's verified draft: ``num_accepted_tokens`` of its ``num_draft_tokens`` held."""
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        for position in range(num_accepted_tokens):
            self.num_accepted_tokens_per_pos[position] += 1

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted tokens (0 before any draft)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens each verified draft step produced on average: 1 (the target's own) + accepted drafts."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    def copy(self) -> SpecDecodingStats:
        return SpecDecodingStats(
            self.num_spec_tokens,
            self.num_drafts,
            self.num_draft_tokens,
            self.num_accepted_tokens,
            list(self.num_accepted_tokens_per_pos),
        )
