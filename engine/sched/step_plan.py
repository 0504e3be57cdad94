"""One ``Scheduler.schedule()`` call's decisions, and the ``SchedulerOutput`` the workers get from them.

Contract:

* ``StepPlan`` is the scheduler's scratch record for a single step: the token
  budget left, the tokens given to each request, the running requests' new
  block ids, and which requests were scheduled (running or newly admitted) or
  preempted. The scheduler fills it in; it never outlives the step.
* ``StepPlan.unschedule`` is the only way a decision is taken back (a victim
  the priority policy picks after it was scheduled): its tokens return to the
  budget.
* ``StepPlan.build_output`` reads the scheduled requests as they were before
  the step (``num_computed_tokens`` not yet moved past it) and changes neither
  them nor the plan. The output shares the plan's ``num_scheduled_tokens``
  dict and the ``finished_req_ids`` set it is given.

Pure Python, like the rest of ``engine.sched``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from engine.sched.request import Request
from engine.sched.step_outputs import CachedRequestData, NewRequestData, SchedulerOutput


@dataclass(slots=True)
class StepPlan:
    """What one ``schedule()`` has decided so far, and the token budget it has left."""

    token_budget: int
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    # Running requests' new blocks, one list per KV cache group.
    new_block_ids: dict[str, tuple[list[int], ...]] = field(default_factory=dict)
    scheduled_running: list[Request] = field(default_factory=list)
    scheduled_new: list[Request] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)  # the drafts each request verifies

    def unschedule(self, request: Request) -> None:
        """Takes back a running request scheduled earlier this step: its tokens return to the budget."""
        self.scheduled_running.remove(request)
        self.token_budget += self.num_scheduled_tokens.pop(request.request_id)
        del self.new_block_ids[request.request_id]
        self.spec_token_ids.pop(request.request_id, None)

    def build_output(
        self,
        get_block_ids: Callable[[str], tuple[list[int], ...]],
        max_num_batched_tokens: int,
        finished_req_ids: set[str],
    ) -> SchedulerOutput:
        """The step as the workers see it; ``get_block_ids`` gives a new request's blocks (all of them, per group)."""
        new_reqs_data = [
            NewRequestData(
                req_id=request.request_id,
                prompt_token_ids=request.prompt_token_ids,
                output_token_ids=list(request.output_token_ids),
                sampling_params=request.sampling_params,
                block_ids=get_block_ids(request.request_id),
                num_computed_tokens=request.num_computed_tokens,
                lora_request=request.lora_request,
                pooling_params=request.pooling_params,
            )
            for request in self.scheduled_new
        ]
        cached = CachedRequestData()
        num_scheduled_tokens, new_block_ids = self.num_scheduled_tokens, self.new_block_ids
        for request in self.scheduled_running:
            num_computed = request.num_computed_tokens
            num_new_tokens = num_scheduled_tokens[request.request_id]
            cached.req_ids.append(request.request_id)
            cached.new_token_ids.append(request.all_token_ids[num_computed : num_computed + num_new_tokens])
            cached.new_block_ids.append(new_block_ids[request.request_id])
            cached.num_computed_tokens.append(num_computed)
        return SchedulerOutput(
            scheduled_new_reqs=new_reqs_data,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=num_scheduled_tokens,
            total_num_scheduled_tokens=max_num_batched_tokens - self.token_budget,
            preempted_req_ids={request.request_id for request in self.preempted},
            finished_req_ids=finished_req_ids,
            scheduled_spec_decode_tokens=self.spec_token_ids,
        )
