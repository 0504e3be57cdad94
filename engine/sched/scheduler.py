"""The continuous-batching scheduler (vLLM V1 design).

There are no prefill and decode phases. Each step hands every request the
number of tokens that brings its ``num_computed_tokens`` toward its
``num_tokens`` (a whole prompt, a prompt chunk, or one decode token), within
the step's token budget and ``max_num_seqs``: running requests first, then
waiting ones. When the KV pool runs dry, running requests are preempted (their
blocks freed, to be recomputed later) and nothing new is admitted that step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from engine.config import CacheConfig, KVTransferConfig, SchedulerConfig, SpeculativeConfig
from engine.sampling_params import RequestKind
from engine.sched.block_pool import KVCacheBlock
from engine.sched.kv_cache_groups import FULL_ATTENTION, KVCacheGroup
from engine.sched.kv_cache_manager import KVCacheManager, PrefixCacheStats, check_pool_holds_one_sequence
from engine.sched.kv_transfer import KVConnectorScheduler, KVTransferStats
from engine.sched.request import Request, RequestStatus, lora_slot_blocked
from engine.sched.request_queue import make_request_queue
from engine.sched.spec_decode import SpecDecodeScheduling
from engine.sched.spec_decode_stats import SpecDecodingStats
from engine.sched.step_outputs import EngineCoreOutput, LoRAWorkerCounts, ModelRunnerOutput, SchedulerOutput
from engine.sched.step_plan import StepPlan
from engine.sched.stop_conditions import check_stop


@dataclass
class SchedulerStats:
    num_running_reqs: int
    num_waiting_reqs: int
    kv_cache_usage: float
    num_preemptions: int  # since start
    prefix_cache_stats: PrefixCacheStats
    kv_transfer_stats: KVTransferStats | None = None  # with KV transfer configured
    spec_decoding_stats: SpecDecodingStats | None = None  # with speculative decoding configured (a copy)
    lora_counts: LoRAWorkerCounts | None = None  # with enable_lora: the workers' (filled in by the EngineCore)


class Scheduler:
    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        kv_transfer_config: KVTransferConfig | None = None,
        speculative_config: SpeculativeConfig | None = None,
        max_loras: int = 0,
        kv_cache_groups: tuple[KVCacheGroup, ...] = FULL_ATTENTION,
    ) -> None:
        """``kv_cache_groups``: the model's (the workers report them; ``engine.sched.kv_cache_groups``)."""
        self.scheduler_config = scheduler_config
        self.cache_config = cache_config
        self.max_model_len = scheduler_config.max_model_len
        self._long_prefill_token_threshold = scheduler_config.long_prefill_token_threshold  # read per request
        max_step_tokens = self._long_prefill_token_threshold or scheduler_config.max_num_batched_tokens
        check_pool_holds_one_sequence(cache_config, self.max_model_len, kv_cache_groups, max_step_tokens)
        self.kv_cache_manager = KVCacheManager(cache_config, kv_cache_groups)
        self.requests: dict[str, Request] = {}
        self.waiting = make_request_queue(scheduler_config.policy)
        self.running: list[Request] = []
        # Finished or aborted since the last schedule(): the workers must drop them.
        self.finished_req_ids: set[str] = set()
        self.num_preemptions = 0
        self.kv_connector = (
            None
            if kv_transfer_config is None
            else KVConnectorScheduler(kv_transfer_config.kv_role, cache_config.block_size, kv_cache_groups)
        )
        self.max_loras = max_loras  # multi-LoRA: distinct adapters the running batch may hold; 0: off
        self.spec_decode = (
            None if speculative_config is None else SpecDecodeScheduling(speculative_config, self.max_model_len)
        )

    # ----------------------------------------------------------------- requests

    def add_request(self, request: Request) -> None:
        """Queues a new request; the front end has checked that it fits (``Processor.validate``).

        Raises ValueError (and changes nothing) if its id is in use."""
        if request.request_id in self.requests:
            raise ValueError(f"Request id {request.request_id!r} is already in use.")
        if request.kind is RequestKind.GENERATE:
            room, max_tokens = self.max_model_len - request.num_prompt_tokens, request.sampling_params.max_tokens
            request.max_tokens = room if max_tokens is None else max_tokens
        request.status = RequestStatus.WAITING
        self.waiting.add(request)
        self.requests[request.request_id] = request

    def abort_requests(self, request_ids) -> None:
        """Finishes the given requests as aborted and frees their blocks; unknown ids are ignored."""
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            request.status = RequestStatus.FINISHED_ABORTED
            self._free_request(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.running) or len(self.waiting) > 0

    def get_num_unfinished_requests(self) -> int:
        return len(self.running) + len(self.waiting)

    # ----------------------------------------------------------------- schedule

    def schedule(self) -> SchedulerOutput:
        """Decides this step: how many tokens each request computes.

        Running requests first (preempting when the pool runs dry), then, unless one was preempted,
        waiting ones. The output describes the requests as they were before this step; only then does
        ``_update_after_schedule`` move them past it.
        """
        plan = StepPlan(token_budget=self.scheduler_config.max_num_batched_tokens)
        self._schedule_running(plan)
        if not plan.preempted:
            self._admit_waiting(plan)
        output = plan.build_output(
            self.kv_cache_manager.get_block_ids, self.scheduler_config.max_num_batched_tokens, self.finished_req_ids
        )
        self._update_after_schedule(output)
        return output

    def _num_tokens_to_compute(self, request: Request, num_computed_tokens: int, token_budget: int) -> int:
        """How many of ``request``'s tokens (its drafts included) past ``num_computed_tokens`` fit this step
        (0: none are new)."""
        num_new_tokens = request.num_tokens + len(request.spec_token_ids) - num_computed_tokens
        threshold = self._long_prefill_token_threshold
        if 0 < threshold < num_new_tokens:
            num_new_tokens = threshold
        return num_new_tokens if num_new_tokens < token_budget else token_budget

    def _schedule_running(self, plan: StepPlan) -> None:
        """Gives running requests, oldest first, their next tokens while ``plan``'s budget lasts."""
        running = self.running
        # Locals, the budget too: this loop runs once per running request per step.
        allocate_slots, num_tokens_to_compute = self.kv_cache_manager.allocate_slots, self._num_tokens_to_compute
        num_scheduled_tokens, new_block_ids = plan.num_scheduled_tokens, plan.new_block_ids
        scheduled_running = plan.scheduled_running
        token_budget = plan.token_budget
        spec_decode = self.spec_decode
        speculating = spec_decode is not None and spec_decode.is_enabled(running)
        index = 0
        while index < len(running) and token_budget > 0:
            request = running[index]
            num_new_tokens = num_tokens_to_compute(request, request.num_computed_tokens, token_budget)
            if num_new_tokens == 0:  # nothing new since the last step (its output is not in yet)
                index += 1
                continue
            lookahead = spec_decode.num_lookahead(request.num_computed_tokens + num_new_tokens) if speculating else 0
            new_blocks = allocate_slots(request, num_new_tokens, num_lookahead_tokens=lookahead)
            if new_blocks is None:
                plan.token_budget = token_budget
                new_blocks = self._preempt_until_fits(request, num_new_tokens, lookahead, plan)
                token_budget = plan.token_budget  # unscheduled victims gave their tokens back
                if new_blocks is None:
                    break  # ``request`` itself was preempted: the pool holds nothing more this step
                index = running.index(request)  # victims ahead of it (priority policy) moved it forward
            scheduled_running.append(request)
            num_scheduled_tokens[request.request_id] = num_new_tokens
            new_block_ids[request.request_id] = tuple([block.block_id for block in blocks] for blocks in new_blocks)
            if request.spec_token_ids:
                spec_decode.schedule_drafts(request, num_new_tokens, plan)
            token_budget -= num_new_tokens
            index += 1
        plan.token_budget = token_budget

    def _preempt_until_fits(
        self, request: Request, num_new_tokens: int, num_lookahead_tokens: int, plan: StepPlan
    ) -> tuple[list[KVCacheBlock], ...] | None:
        """Preempts the policy's victims one by one until ``num_new_tokens`` (and the lookahead) fit for ``request``.

        Returns the new blocks; None when ``request`` itself became the victim (it is preempted then).
        Every victim is appended to ``plan.preempted``; one already scheduled this step (only the
        priority policy picks one) is taken out of ``plan`` and its tokens go back to the budget.
        """
        while True:
            victim = self._pick_victim()
            self._preempt(victim)
            plan.preempted.append(victim)
            if victim is request:
                return None
            if victim.request_id in plan.num_scheduled_tokens:
                plan.unschedule(victim)
            new_blocks = self.kv_cache_manager.allocate_slots(
                request, num_new_tokens, num_lookahead_tokens=num_lookahead_tokens
            )
            if new_blocks is not None:
                return new_blocks

    def _admit_waiting(self, plan: StepPlan) -> None:
        """Moves waiting requests to running while ``plan``'s budget, seats and blocks last."""
        kv = self.kv_cache_manager
        while (
            len(self.waiting) > 0 and plan.token_budget > 0 and len(self.running) < self.scheduler_config.max_num_seqs
        ):
            request = self.waiting.peek()
            if lora_slot_blocked(request, self.running, self.max_loras):
                break  # its adapter has no device slot free: it (and, FCFS, those behind it) wait
            # Waiting requests (new or preempted) hold no blocks: start from the prefix cache.
            computed_blocks, num_hit_tokens = kv.get_computed_blocks(request)
            # Then what a remote prefill computed (disaggregated serving): loaded, not computed, this step.
            num_external_tokens = (
                0
                if self.kv_connector is None
                else self.kv_connector.get_num_new_matched_tokens(request, num_hit_tokens)
            )
            num_computed_tokens = num_hit_tokens + num_external_tokens
            num_wanted = request.num_tokens - num_computed_tokens
            if not self.scheduler_config.enable_chunked_prefill and num_wanted > plan.token_budget:
                break
            num_new_tokens = self._num_tokens_to_compute(request, num_computed_tokens, plan.token_budget)
            lookahead = (
                0 if self.spec_decode is None else self.spec_decode.num_lookahead(num_computed_tokens + num_new_tokens)
            )
            num_tokens = num_external_tokens + num_new_tokens
            if kv.allocate_slots(request, num_tokens, num_hit_tokens, computed_blocks, lookahead) is None:
                break
            kv.record_prefix_cache_query(request, num_hit_tokens)
            if self.kv_connector is not None:
                self.kv_connector.update_state_after_alloc(
                    request, kv.get_block_ids(request.request_id)[0], num_hit_tokens, num_external_tokens
                )
            self.waiting.pop()
            self.running.append(request)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_computed_tokens
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit_tokens
                request.first_scheduled_time = time.monotonic()
            plan.scheduled_new.append(request)
            plan.num_scheduled_tokens[request.request_id] = num_new_tokens
            plan.token_budget -= num_new_tokens

    def _pick_victim(self) -> Request:
        if self.scheduler_config.policy == "priority":
            return max(self.running, key=lambda request: (request.priority, request.arrival_time))
        return self.running[-1]  # FCFS: the most recently admitted

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.num_preemptions += 1
        self.num_preemptions += 1
        if self.kv_connector is not None:
            self.kv_connector.preempted(request)
        self.waiting.prepend(request)

    def _update_after_schedule(self, output: SchedulerOutput) -> None:
        """Every state change that follows from scheduling ``output``, in one place.

        The scheduled requests count this step's tokens as computed now, so the next ``schedule()``
        moves on without waiting for the step to run; the connector plans its saves from those counts;
        the finished ids are handed over to ``output`` and collection starts afresh.
        """
        requests = self.requests
        for req_id, num_new_tokens in output.num_scheduled_tokens.items():
            requests[req_id].num_computed_tokens += num_new_tokens
        if self.kv_connector is not None:
            output.kv_connector_metadata = self.kv_connector.build_connector_meta(
                output.num_scheduled_tokens, lambda req_id: self.kv_cache_manager.get_block_ids(req_id)[0]
            )
        self.finished_req_ids = set()

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Appends sampled tokens, finishes requests that hit a stop condition (a pooling request once its
        vector came), frees their blocks.

        Returns one output per request that got tokens, prompt logprobs or its pooled vector.
        Requests aborted since ``schedule()`` are skipped.
        """
        outputs: list[EngineCoreOutput] = []
        logprobs = model_runner_output.logprobs or {}
        prompt_logprobs = model_runner_output.prompt_logprobs or {}
        pooled = model_runner_output.pooler_output or {}
        any_finished = False
        requests = self.requests
        if self.kv_connector is not None:
            self.kv_connector.update_connector_output(model_runner_output.kv_transfer_output, requests)
        scheduled_drafts = scheduler_output.scheduled_spec_decode_tokens
        for req_id, sampled in zip(model_runner_output.req_ids, model_runner_output.sampled_token_ids):
            request = requests.get(req_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue
            if req_id in scheduled_drafts and sampled:
                self.spec_decode.verify_drafts(request, len(scheduled_drafts[req_id]), len(sampled))
            new_token_ids = self._append_until_stop(request, sampled) if sampled else sampled
            vector = pooled.get(req_id)
            if vector is not None:  # its prompt is done: the vector is all a pooling request produces
                request.status = RequestStatus.FINISHED_STOPPED
            new_prompt_logprobs = prompt_logprobs.get(req_id)
            if not new_token_ids and new_prompt_logprobs is None and request.status == RequestStatus.RUNNING:
                continue
            output = EngineCoreOutput.of(request, new_token_ids, logprobs.get(req_id), new_prompt_logprobs, vector)
            outputs.append(output)
            if output.finish_reason is not None:
                any_finished = True
                output.kv_transfer_params = self._free_request(request)
        if any_finished:
            self.running = [request for request in self.running if request.status == RequestStatus.RUNNING]
        if model_runner_output.draft_token_ids:
            self.spec_decode.take_drafts(model_runner_output.draft_token_ids, requests)
        return outputs

    def _append_until_stop(self, request: Request, sampled_token_ids: list[int]) -> list[int]:
        """Appends the tokens up to the first that finishes ``request``; returns those appended.

        A structured-output request's grammar accepts each token first; one it refuses (only other
        constraints masking every token it allows can cause that) is not appended and finishes the
        request with an error.
        """
        grammar = request.grammar
        for num_accepted, token_id in enumerate(sampled_token_ids, start=1):
            if grammar is not None and not grammar.accept_token(token_id):
                request.status = RequestStatus.FINISHED_ERROR
                request.stop_reason = f"The sampled token {token_id} is not allowed by the request's grammar."
                return sampled_token_ids[: num_accepted - 1]
            request.append_output_token_id(token_id)
            if check_stop(request, self.max_model_len):
                return sampled_token_ids[:num_accepted]
        return sampled_token_ids

    def _free_request(self, request: Request) -> dict | None:
        """Frees the request's blocks and forgets it; returns its ``kv_transfer_params`` (KV it saved)."""
        self.kv_cache_manager.free(request)
        del self.requests[request.request_id]
        self.finished_req_ids.add(request.request_id)
        return None if self.kv_connector is None else self.kv_connector.request_finished(request)

    def get_stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            kv_cache_usage=self.kv_cache_manager.usage,
            num_preemptions=self.num_preemptions,
            prefix_cache_stats=self.kv_cache_manager.prefix_cache_stats,
            kv_transfer_stats=None if self.kv_connector is None else self.kv_connector.stats,
            spec_decoding_stats=None if self.spec_decode is None else self.spec_decode.stats.copy(),
        )
