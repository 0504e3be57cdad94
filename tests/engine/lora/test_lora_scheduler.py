"""Multi-LoRA admission: the running batch never holds more than ``max_loras`` distinct adapters; a request
whose adapter has no slot waits (it does not fail) and runs once one is free. The scheduler alone, no model."""

from __future__ import annotations

from engine.config import CacheConfig, SchedulerConfig
from engine.lora_request import LoRARequest
from engine.sampling_params import SamplingParams
from engine.sched.request import Request, RequestStatus
from engine.sched.scheduler import Scheduler
from engine.sched.step_outputs import ModelRunnerOutput


def _scheduler(max_loras: int) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=8, max_model_len=64),
        CacheConfig(block_size=4, num_blocks=64),
        max_loras=max_loras,
    )


def _add(scheduler: Scheduler, request_id: str, lora_id: int | None, max_tokens: int = 2) -> Request:
    lora = None if lora_id is None else LoRARequest(f"l{lora_id}", lora_id, f"/adapters/{lora_id}")
    request = Request(request_id, [5, 6, 7], SamplingParams(max_tokens=max_tokens), 1, lora_request=lora)
    scheduler.add_request(request)
    return request


def _step(scheduler: Scheduler) -> set[str]:
    """One step sampling token 9 for everyone scheduled; returns the ids scheduled."""
    output = scheduler.schedule()
    req_ids = list(output.num_scheduled_tokens)
    scheduler.update_from_output(output, ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=[[9]] * len(req_ids)))
    return set(req_ids)


def test_a_request_whose_adapter_has_no_slot_waits_then_runs():
    scheduler = _scheduler(max_loras=2)
    _add(scheduler, "a1", 1)
    _add(scheduler, "base", None)
    _add(scheduler, "b1", 2)
    _add(scheduler, "a2", 1)
    late = _add(scheduler, "c1", 3)
    first = scheduler.schedule()
    assert set(first.num_scheduled_tokens) == {"a1", "base", "b1", "a2"}
    assert {new.req_id: new.lora_request for new in first.scheduled_new_reqs}["b1"].lora_int_id == 2
    assert late.status == RequestStatus.WAITING
    scheduler.update_from_output(
        first, ModelRunnerOutput(req_ids=list(first.num_scheduled_tokens), sampled_token_ids=[[9]] * 4)
    )
    assert "c1" not in _step(scheduler)  # a and b still run: still no slot (and nothing failed)
    for _ in range(3):
        _step(scheduler)
    assert late.status == RequestStatus.FINISHED_LENGTH_CAPPED and late.output_token_ids == [9, 9]


def test_without_lora_nothing_is_held_back():
    scheduler = _scheduler(max_loras=0)
    for index in range(5):
        _add(scheduler, f"r{index}", index + 1)
    assert len(_step(scheduler)) == 5
