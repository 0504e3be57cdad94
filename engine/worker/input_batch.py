"""The worker's persistent batch: per-request state and block table, kept in step by the scheduler's deltas.

Every rank applies the same deltas in the same order, so with TP/PP every
rank holds the same state. The state changes in three places only, in this
order within a step: ``apply_deltas`` (before anything else), ``advance``
(once the step's KV is in the cache: the one place ``num_computed_tokens``
moves), ``append_sampled_tokens`` (the output rank, after sampling; the other
ranks learn those tokens from the next step's deltas).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from engine.sample import make_generator
from engine.sched.kv_cache_groups import FULL_ATTENTION, KVCacheGroup
from engine.sched.step_outputs import SchedulerOutput
from engine.worker.request_state import BlockTable, CachedRequestState
from engine.worker.step_inputs import StepInputs, build_step_inputs


class InputBatch:
    def __init__(
        self,
        max_num_reqs: int,
        max_num_blocks_per_req: int,
        block_size: int,
        device: torch.device,
        kv_cache_groups: tuple[KVCacheGroup, ...] = FULL_ATTENTION,
    ) -> None:
        self.block_size = block_size
        self.device = device
        self.kv_cache_groups = kv_cache_groups  # the model's: a block table per group
        self.block_table = BlockTable(max_num_reqs, max_num_blocks_per_req, len(kv_cache_groups))
        self.requests: dict[str, CachedRequestState] = {}
        self.pooling_req_ids: set[str] = set()  # the pooling requests among them (the runner pools theirs)
        # Generators of preempted requests survive until the request finishes, so a seeded
        # request draws the same tokens whether or not it was preempted.
        self._parked_generators: dict[str, torch.Generator] = {}

    def apply_deltas(self, scheduler_output: SchedulerOutput) -> None:
        """Drops finished and preempted requests, adds new ones, applies the running ones' deltas."""
        for req_id in scheduler_output.finished_req_ids:
            self._remove_request(req_id)
            self._parked_generators.pop(req_id, None)
        for req_id in scheduler_output.preempted_req_ids:
            state = self._remove_request(req_id)
            if state is not None and state.generator is not None:
                self._parked_generators[req_id] = state.generator
        for new in scheduler_output.scheduled_new_reqs:
            params = new.sampling_params
            generator = self._parked_generators.pop(new.req_id, None)
            if generator is None and params is not None and params.seed is not None and not params.is_greedy:
                generator = make_generator(params.seed, self.device)
            self.requests[new.req_id] = CachedRequestState(
                req_id=new.req_id,
                prompt_token_ids=new.prompt_token_ids,
                sampling_params=params,
                token_ids=list(new.prompt_token_ids) + list(new.output_token_ids),
                num_computed_tokens=new.num_computed_tokens,
                slot=self.block_table.add_request(new.block_ids),
                generator=generator,
                lora_request=new.lora_request,
                pooling_params=new.pooling_params,
            )
            if new.pooling_params is not None:
                self.pooling_req_ids.add(new.req_id)
        cached = scheduler_output.scheduled_cached_reqs
        drafts = scheduler_output.scheduled_spec_decode_tokens
        for i, req_id in enumerate(cached.req_ids):
            state = self.requests[req_id]
            state.num_computed_tokens = cached.num_computed_tokens[i]
            if state.spec_token_ids:
                _take_accepted_drafts(state)
            state.write_tokens(state.num_computed_tokens, cached.new_token_ids[i])
            self.block_table.append(state.slot, cached.new_block_ids[i])
            state.spec_token_ids = drafts.get(req_id, [])

    def _remove_request(self, req_id: str) -> CachedRequestState | None:
        state = self.requests.pop(req_id, None)
        if state is not None:
            self.block_table.remove_request(state.slot)
            self.pooling_req_ids.discard(req_id)
        return state

    def prepare_inputs(
        self, num_scheduled_tokens: Mapping[str, int], starts: Mapping[str, int] | None = None
    ) -> StepInputs:
        """The flattened batch (see ``build_step_inputs``); on return nothing here has changed."""
        return build_step_inputs(
            self.requests, self.block_table, num_scheduled_tokens, self.block_size, self.device, starts
        )

    def advance(self, inputs: StepInputs) -> None:
        """Marks the batch's tokens computed: each request's num_computed_tokens moves past them."""
        for req_id, start, num_tokens in zip(inputs.req_ids, inputs.starts, inputs.query_lens):
            self.requests[req_id].num_computed_tokens = start + num_tokens

    def append_sampled_tokens(self, req_ids: list[str], token_ids: list[int]) -> None:
        """Appends each request's sampled token to its sequence (the output rank's own copy)."""
        for req_id, token_id in zip(req_ids, token_ids):
            self.requests[req_id].token_ids.append(token_id)

    def append_verified_tokens(self, req_ids: list[str], token_ids: list[list[int]]) -> None:
        """Appends each request's accepted drafts and the token after them; its rejected drafts' positions
        are no longer computed (the output rank's own copy; the others learn it from the next deltas)."""
        for req_id, tokens in zip(req_ids, token_ids):
            state = self.requests[req_id]
            state.num_computed_tokens -= len(state.spec_token_ids) + 1 - len(tokens)
            state.token_ids.extend(tokens)


def _take_accepted_drafts(state: CachedRequestState) -> None:
    """A rank that did not sample learns which of its last drafts were accepted from how far
    ``num_computed_tokens`` now reaches past its tokens: those positions hold the drafts it verified.
    (The output rank appended them when it sampled, so nothing changes there.)"""
    num_accepted = state.num_computed_tokens - len(state.token_ids)
    if num_accepted > 0:
        state.token_ids.extend(state.spec_token_ids[:num_accepted])
