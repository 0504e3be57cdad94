"""The scheduler's side of speculative decoding (vLLM V1's design).

Contract:

* A running request's drafts (``Request.spec_token_ids``, proposed by the workers after the step
  that produced its last token) are scheduled as its next tokens: a request with ``k`` drafts asks
  for ``1 + k`` tokens, within the token budget like any other (``schedule_drafts`` records the
  drafts the budget reached, and consumes them).
* The step verifies them: it returns the accepted drafts and one more token. ``verify_drafts``
  moves ``num_computed_tokens`` back past the rejected ones; their KV slots stay allocated and
  later steps overwrite them. Drafts never enter ``all_token_ids`` until accepted, so a block
  holding unverified tokens is never hashed into the prefix cache.
* ``take_drafts`` keeps the next drafts, cut so that verifying all of them plus the bonus token
  stays within ``max_tokens`` and the draft's ``max_model_len``.
* A draft model writes its proposals' KV ahead of the step's tokens: ``num_lookahead`` slots are
  allocated beyond them (within ``max_model_len``).
* ``disable_by_batch_size``: while that many requests run, nothing is verified (drafts dropped).

Pure Python, like the rest of ``engine.sched``.
"""

from __future__ import annotations

from engine.config import SpeculativeConfig
from engine.sched.request import Request, RequestStatus
from engine.sched.spec_decode_stats import SpecDecodingStats
from engine.sched.step_plan import StepPlan


class SpecDecodeScheduling:
    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.stats = SpecDecodingStats(config.num_speculative_tokens)
        self._num_lookahead_tokens = config.num_speculative_tokens if config.method == "draft_model" else 0

    def is_enabled(self, running: list[Request]) -> bool:
        """Whether running requests verify drafts this step; when not, their drafts are dropped."""
        limit = self.config.disable_by_batch_size
        if limit is None or len(running) < limit:
            return True
        for request in running:
            request.spec_token_ids = []
        return False

    def num_lookahead(self, num_tokens_after: int) -> int:
        """Slots to allocate past a step that leaves a request at ``num_tokens_after`` tokens."""
        room = self.max_model_len - num_tokens_after
        return min(self._num_lookahead_tokens, room) if room > 0 else 0

    def schedule_drafts(self, request: Request, num_new_tokens: int, plan: StepPlan) -> None:
        """Records in ``plan`` the drafts that ``request``'s ``num_new_tokens`` reach, and consumes them."""
        num_drafts = num_new_tokens - (request.num_tokens - request.num_computed_tokens)
        if num_drafts > 0:
            plan.spec_token_ids[request.request_id] = request.spec_token_ids[:num_drafts]
        request.spec_token_ids = []

    def verify_drafts(self, request: Request, num_drafts: int, num_sampled: int) -> None:
        """The step verified ``num_drafts`` drafts and gave ``num_sampled`` tokens (the accepted drafts and one
        more): the rejected drafts' positions are no longer computed."""
        num_accepted = num_sampled - 1
        request.num_computed_tokens -= num_drafts - num_accepted
        self.stats.observe_draft(num_drafts, num_accepted)

    def take_drafts(self, draft_token_ids: dict[str, list[int]], requests: dict[str, Request]) -> None:
        """Keeps the drafts proposed for each request still running, cut to what max_tokens and the
        draft's max_model_len allow."""
        for req_id, drafts in draft_token_ids.items():
            request = requests.get(req_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue
            room = min(
                request.max_tokens - request.num_output_tokens - 1, self.config.max_model_len - request.num_tokens
            )
            request.spec_token_ids = drafts[:room] if room > 0 else []
