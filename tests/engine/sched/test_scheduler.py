"""The scheduler driven by hand-made runner outputs, no model."""

import itertools

import pytest

from engine.config import CacheConfig, SchedulerConfig
from engine.sampling_params import SamplingParams
from engine.sched.request import Request, RequestStatus
from engine.sched.scheduler import Scheduler
from engine.sched.step_outputs import ModelRunnerOutput

EOS = 2
# Distinct token ranges per request, so prompts share no prefix unless a test asks for one.
_first_tokens = itertools.count(100, 1000)


def make_scheduler(
    budget=512,
    max_num_seqs=64,
    max_model_len=256,
    policy="fcfs",
    chunked=True,
    threshold=0,
    block_size=16,
    num_blocks=256,
    caching=True,
):
    return Scheduler(
        SchedulerConfig(
            max_num_batched_tokens=budget,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            policy=policy,
            enable_chunked_prefill=chunked,
            long_prefill_token_threshold=threshold,
        ),
        CacheConfig(block_size=block_size, num_blocks=num_blocks, enable_prefix_caching=caching),
    )


def add(scheduler, request_id, num_prompt_tokens, priority=0, arrival=None, first_token=None, **params):
    first_token = next(_first_tokens) if first_token is None else first_token
    request = Request(
        request_id,
        list(range(first_token, first_token + num_prompt_tokens)),
        SamplingParams(**params),
        EOS,
        priority=priority,
        arrival_time=arrival,
    )
    scheduler.add_request(request)
    return request


def step(scheduler, token=7, tokens=None):
    """One schedule() + update with ``token`` sampled for every request that finished its prompt."""
    output = scheduler.schedule()
    req_ids = list(output.num_scheduled_tokens)
    sampled = []
    for req_id in req_ids:
        request = scheduler.requests[req_id]
        is_done = request.num_computed_tokens == request.num_tokens
        sampled.append([(tokens or {}).get(req_id, token)] if is_done else [])
    results = scheduler.update_from_output(output, ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled))
    scheduler.kv_cache_manager.check_integrity()
    return output, {result.request_id: result for result in results}


def test_prompts_and_decodes_share_one_step():
    scheduler = make_scheduler()
    add(scheduler, "a", 30, max_tokens=5)
    step(scheduler)
    add(scheduler, "b", 40, max_tokens=5)
    output, _ = step(scheduler)
    assert output.num_scheduled_tokens == {"a": 1, "b": 40}
    assert output.scheduled_cached_reqs.req_ids == ["a"] and output.scheduled_cached_reqs.new_token_ids == [[7]]
    assert [new.req_id for new in output.scheduled_new_reqs] == ["b"]
    assert output.total_num_scheduled_tokens == 41


def test_chunked_prefill_splits_a_prompt_by_the_leftover_budget():
    scheduler = make_scheduler(budget=64)
    add(scheduler, "a", 10, max_tokens=4)
    add(scheduler, "b", 100, max_tokens=4)
    output, results = step(scheduler)
    assert output.num_scheduled_tokens == {"a": 10, "b": 54}
    assert "b" not in results  # a partial prefill samples nothing
    output, _ = step(scheduler)
    assert output.num_scheduled_tokens == {"a": 1, "b": 46}


def test_without_chunked_prefill_a_prompt_waits_for_a_whole_budget():
    scheduler = make_scheduler(budget=256, chunked=False)
    add(scheduler, "a", 200, max_tokens=4)
    add(scheduler, "b", 100, max_tokens=4)
    output, _ = step(scheduler)
    assert output.num_scheduled_tokens == {"a": 200}


def test_long_prefill_threshold_caps_tokens_per_request():
    scheduler = make_scheduler(threshold=32)
    add(scheduler, "a", 100, max_tokens=2)
    add(scheduler, "b", 20, max_tokens=2)
    output, _ = step(scheduler)
    assert output.num_scheduled_tokens == {"a": 32, "b": 20}


def test_max_num_seqs_limits_running_requests():
    scheduler = make_scheduler(max_num_seqs=2)
    for name in "abc":
        add(scheduler, name, 5, max_tokens=3)
    output, _ = step(scheduler)
    assert set(output.num_scheduled_tokens) == {"a", "b"}
    for _ in range(3):
        output, _ = step(scheduler)
    assert "c" in output.num_scheduled_tokens


def test_stop_conditions():
    scheduler = make_scheduler(max_model_len=64)
    add(scheduler, "eos", 4, max_tokens=10)
    add(scheduler, "ignore", 4, max_tokens=3, ignore_eos=True)
    add(scheduler, "stop_id", 4, max_tokens=10, stop_token_ids=[9])
    add(scheduler, "min", 4, max_tokens=10, min_tokens=2)
    add(scheduler, "model_len", 60, max_tokens=None)
    tokens = {"eos": EOS, "ignore": EOS, "stop_id": 9, "min": EOS, "model_len": 5}
    finished = {}
    for _ in range(6):
        _, results = step(scheduler, tokens=tokens)
        finished.update({rid: r for rid, r in results.items() if r.finished})
    assert finished["eos"].finish_reason == "stop" and finished["eos"].stop_reason is None
    assert finished["stop_id"].finish_reason == "stop" and finished["stop_id"].stop_reason == 9
    assert finished["ignore"].finish_reason == "length"
    assert scheduler.requests == {} and len(finished) == 5
    assert finished["model_len"].finish_reason == "length"


def test_min_tokens_holds_back_eos_and_outputs_count():
    scheduler = make_scheduler()
    request = add(scheduler, "a", 4, max_tokens=10, min_tokens=3)
    for _ in range(3):
        step(scheduler, token=EOS)
    assert request.output_token_ids == [EOS, EOS, EOS] and request.status == RequestStatus.FINISHED_STOPPED


def test_max_model_len_caps_a_request_without_max_tokens():
    scheduler = make_scheduler(max_model_len=20)
    request = add(scheduler, "a", 15, max_tokens=None)
    while scheduler.has_unfinished_requests():
        step(scheduler)
    assert request.num_tokens == 20 and request.get_finish_reason() == "length"


def test_bad_requests_are_rejected_without_side_effects():
    """(A prompt too long for max_model_len is the front end's to refuse: ``Processor.validate``, whose
    check ``tests/engine/test_llm_api.py`` covers; the core trusts what it is sent.)"""
    scheduler = make_scheduler(max_model_len=32)
    with pytest.raises(ValueError, match="empty"):
        Request("empty", [], SamplingParams(), EOS)
    add(scheduler, "a", 4)
    with pytest.raises(ValueError, match="already in use"):
        add(scheduler, "a", 4)
    assert scheduler.get_num_unfinished_requests() == 1


def test_pool_smaller_than_one_sequence_is_a_config_error():
    with pytest.raises(ValueError, match="fewer than max_model_len"):
        make_scheduler(max_model_len=64, block_size=16, num_blocks=4)


def test_fcfs_preempts_the_most_recently_admitted_and_admits_nothing_that_step():
    scheduler = make_scheduler(block_size=4, num_blocks=9, max_model_len=32)  # 8 usable blocks
    a = add(scheduler, "a", 16, max_tokens=12, ignore_eos=True)
    b = add(scheduler, "b", 16, max_tokens=12, ignore_eos=True)
    step(scheduler)  # 4 blocks each: the pool is full
    add(scheduler, "c", 3, max_tokens=1)
    output, _ = step(scheduler)  # a's 17th token needs a 5th block
    assert output.preempted_req_ids == {"b"} and b.status == RequestStatus.PREEMPTED
    assert output.num_scheduled_tokens == {"a": 1}  # no admissions in a preempting step
    assert b.num_computed_tokens == 0 and b.num_preemptions == 1
    while scheduler.has_unfinished_requests():
        step(scheduler)
    assert a.num_output_tokens == 12 and b.num_output_tokens == 12


def test_priority_policy_preempts_the_worst_request_even_if_already_scheduled():
    scheduler = make_scheduler(block_size=4, num_blocks=9, max_model_len=32, policy="priority")
    add(scheduler, "low", 10, priority=5, arrival=1.0, max_tokens=20, ignore_eos=True)
    step(scheduler)
    add(scheduler, "high", 12, priority=0, arrival=2.0, max_tokens=20, ignore_eos=True)
    for _ in range(10):  # low runs ahead of high; high is the first to need a block the pool lacks
        output, _ = step(scheduler)
        if output.preempted_req_ids:
            break
    assert output.preempted_req_ids == {"low"}
    assert output.num_scheduled_tokens == {"high": 1}  # low's tokens went back to the budget
    assert output.scheduled_cached_reqs.req_ids == ["high"]


def test_priority_policy_preempts_a_victim_that_got_nothing_this_step():
    # low's last output is not in yet (a pipeline step in flight), so it is skipped, not scheduled, when
    # high, behind it in the running list, needs the block the pool lacks and low is the victim.
    scheduler = make_scheduler(block_size=4, num_blocks=9, max_model_len=32, policy="priority")
    low = add(scheduler, "low", 16, priority=5, arrival=1.0, max_tokens=4, ignore_eos=True)
    scheduler.schedule()  # low's prompt; its sampled token never comes back here
    high = add(scheduler, "high", 16, priority=0, arrival=2.0, max_tokens=4, ignore_eos=True)
    output = scheduler.schedule()  # 4 blocks each: the pool is full
    assert output.num_scheduled_tokens == {"high": 16}
    scheduler.update_from_output(output, ModelRunnerOutput(req_ids=["high"], sampled_token_ids=[[7]]))
    assert [request.request_id for request in scheduler.running] == ["low", "high"]
    output, _ = step(scheduler)  # high's 17th token needs a 5th block
    assert output.preempted_req_ids == {"low"} and low.status == RequestStatus.PREEMPTED
    assert output.num_scheduled_tokens == {"high": 1} and output.scheduled_cached_reqs.req_ids == ["high"]
    while scheduler.has_unfinished_requests():
        step(scheduler)
    assert low.num_output_tokens == 4 and high.num_output_tokens == 4


def test_priority_policy_admits_by_priority_then_arrival():
    scheduler = make_scheduler(max_num_seqs=1, policy="priority")
    add(scheduler, "late_urgent", 4, priority=0, arrival=3.0, max_tokens=1)
    add(scheduler, "early_lazy", 4, priority=1, arrival=1.0, max_tokens=1)
    add(scheduler, "early_urgent", 4, priority=0, arrival=2.0, max_tokens=1)
    order = [list(step(scheduler)[0].num_scheduled_tokens)[0] for _ in range(3)]
    assert order == ["early_urgent", "late_urgent", "early_lazy"]


def test_abort_frees_everything_and_tells_the_workers():
    scheduler = make_scheduler()
    add(scheduler, "running", 40, max_tokens=10)
    step(scheduler)
    add(scheduler, "waiting", 10)
    scheduler.abort_requests(["running", "waiting", "unknown"])
    assert not scheduler.has_unfinished_requests()
    assert scheduler.kv_cache_manager.block_pool.num_free_blocks == 255
    output = scheduler.schedule()
    assert output.finished_req_ids == {"running", "waiting"} and output.is_empty


def test_output_for_an_aborted_request_is_dropped():
    scheduler = make_scheduler()
    add(scheduler, "a", 4)
    output = scheduler.schedule()
    scheduler.abort_requests(["a"])
    assert scheduler.update_from_output(output, ModelRunnerOutput(["a"], [[7]])) == []


def test_a_repeated_prompt_hits_the_cache_and_ships_its_block_ids():
    scheduler = make_scheduler()
    add(scheduler, "a", 50, max_tokens=1, first_token=5)
    step(scheduler)
    add(scheduler, "b", 50, max_tokens=1, first_token=5)
    output, results = step(scheduler)
    (new,) = output.scheduled_new_reqs
    assert new.num_computed_tokens == 48 and output.num_scheduled_tokens == {"b": 2}
    assert results["b"].num_cached_tokens == 48
    stats = scheduler.get_stats().prefix_cache_stats
    assert stats.num_queried_tokens == 100 and stats.num_hit_tokens == 48


def test_new_blocks_are_shipped_as_deltas():
    scheduler = make_scheduler(block_size=4)
    add(scheduler, "a", 4, max_tokens=6)
    output, _ = step(scheduler)
    assert [len(ids) for ids in output.scheduled_new_reqs[0].block_ids] == [1]  # one list per KV cache group
    output, _ = step(scheduler)  # token 5 needs a second block
    assert [len(ids) for ids in output.scheduled_cached_reqs.new_block_ids[0]] == [1]
    output, _ = step(scheduler)
    assert output.scheduled_cached_reqs.new_block_ids == [([],)]


def test_an_engine_core_output_pickles_to_an_equal_one():
    """Its ``__reduce__`` lists every field (a field added without it would be lost across processes)."""
    import dataclasses
    import pickle

    from engine.sched.step_outputs import EngineCoreOutput, LogprobsLists

    values = {
        "request_id": "r",
        "new_token_ids": [1, 2],
        "finish_reason": "stop",
        "stop_reason": "x",
        "new_logprobs": LogprobsLists([[1]], [[-0.5]], [1]),
        "new_prompt_logprobs": LogprobsLists([[2]], [[-1.5]], [2]),
        "num_cached_tokens": 16,
        "first_scheduled_time": 3.5,
        "kv_transfer_params": {"k": 1},
        "pooling_output": [0.25, -0.5],
    }
    assert set(values) == {field.name for field in dataclasses.fields(EngineCoreOutput)}
    output = EngineCoreOutput(**values)
    assert pickle.loads(pickle.dumps(output)) == output
