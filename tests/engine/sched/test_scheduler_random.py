"""Random workloads through the real scheduler and a checking simulated worker.

Each example draws a configuration (tiny block pools that force preemption,
small budgets, chunked prefill on or off, both policies) and a workload
(shared prefixes, cache salts, staggered arrivals, random aborts, drafts to
verify, some of them wrong), runs it to
the end, and checks after every step: the budget and max_num_seqs hold, the
KV pool's integrity holds, and the simulated worker saw consistent block
tables. At the end every request has exactly the tokens it was due and no
block is leaked.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from engine.sampling_params import SamplingParams
from engine.sched.request import Request, RequestStatus
from engine.sched.scheduler import Scheduler
from tests.engine.sched.simulated_worker import SimulatedWorker, next_token

VOCAB_SIZE = 40
EOS_TOKEN_ID = 0


def expected_output(prompt: list[int], params: SamplingParams, max_model_len: int) -> list[int]:
    """The tokens a request is due, by the stop rules written out independently."""
    output: list[int] = []
    max_tokens = params.max_tokens or max_model_len - len(prompt)
    while True:
        token = next_token(prompt + output, VOCAB_SIZE)
        output.append(token)
        if len(output) >= params.min_tokens:
            if (not params.ignore_eos and token == EOS_TOKEN_ID) or token in params.stop_token_ids:
                return output
        if len(output) >= max_tokens or len(prompt) + len(output) >= max_model_len:
            return output


@st.composite
def workloads(draw):
    block_size = draw(st.sampled_from([1, 2, 4, 8, 16]))
    max_model_len = draw(st.integers(24, 120))
    chunked = draw(st.booleans())
    min_budget = 4 if chunked else max_model_len
    budget = draw(st.integers(min_budget, max(min_budget, 160)))
    min_blocks = -(-max_model_len // block_size) + 1
    num_blocks = draw(st.integers(min_blocks, min_blocks * 4))
    scheduler_config = SchedulerConfig(
        max_num_batched_tokens=budget,
        max_num_seqs=draw(st.integers(1, 8)),
        max_model_len=max_model_len,
        policy=draw(st.sampled_from(["fcfs", "priority"])),
        enable_chunked_prefill=chunked,
        long_prefill_token_threshold=draw(st.sampled_from([0, 0, 5, 17])),
    )
    cache_config = CacheConfig(block_size=block_size, num_blocks=num_blocks, enable_prefix_caching=draw(st.booleans()))
    num_spec_tokens = draw(st.sampled_from([0, 0, 1, 3]))
    speculative_config = None
    if num_spec_tokens:  # a draft model's lookahead slots, or none (n-gram); sometimes off for larger batches
        method = draw(st.sampled_from(["ngram", "draft_model"]))
        speculative_config = SpeculativeConfig(
            method=method,
            model="draft" if method == "draft_model" else None,
            num_speculative_tokens=num_spec_tokens,
            disable_by_batch_size=draw(st.sampled_from([None, None, 3])),
            max_model_len=max_model_len,
        )
    prefixes = [draw(st.lists(st.integers(1, VOCAB_SIZE - 1), min_size=0, max_size=40)) for _ in range(2)]
    requests = []
    for i in range(draw(st.integers(1, 10))):
        prefix = draw(st.sampled_from(prefixes))
        # Identical prompts (an empty suffix) make full-prompt cache hits likely.
        suffix = draw(
            st.lists(st.integers(0, VOCAB_SIZE - 1), min_size=0 if prefix else 1, max_size=30)
            if draw(st.booleans())
            else st.just([] if prefix else [1])
        )
        prompt = (prefix + suffix)[: max_model_len - 1]
        max_tokens = draw(st.sampled_from([None, 1, 3, 12, 40]))
        params = SamplingParams(
            max_tokens=max_tokens,
            min_tokens=min(draw(st.sampled_from([0, 0, 2])), max_tokens or 2),
            ignore_eos=draw(st.booleans()),
            stop_token_ids=draw(st.sampled_from([[], [5], [7, 11]])),
        )
        requests.append(
            dict(
                request=Request(
                    f"r{i}",
                    prompt,
                    params,
                    EOS_TOKEN_ID,
                    priority=draw(st.integers(0, 2)),
                    arrival_time=float(i),
                    cache_salt=draw(st.sampled_from([None, None, "a", "b"])),
                ),
                arrive_at=draw(st.integers(0, 6)),
                abort_at=draw(st.sampled_from([None, None, None, 1, 4, 9])),
            )
        )
    return scheduler_config, cache_config, speculative_config, requests


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_random_workloads_finish_with_exact_tokens(workload):
    scheduler_config, cache_config, speculative_config, specs = workload
    scheduler = Scheduler(scheduler_config, cache_config, speculative_config=speculative_config)
    num_spec_tokens = 0 if speculative_config is None else speculative_config.num_speculative_tokens
    worker = SimulatedWorker(cache_config.num_blocks, cache_config.block_size, VOCAB_SIZE, num_spec_tokens)
    salts = {spec["request"].request_id: spec["request"].cache_salt for spec in specs}
    aborted: set[str] = set()
    outputs: dict[str, list[int]] = {spec["request"].request_id: [] for spec in specs}
    finish: dict[str, str] = {}
    for step in range(2000):
        for spec in specs:
            if spec["arrive_at"] == step:
                scheduler.add_request(spec["request"])
            if spec["abort_at"] is not None and spec["arrive_at"] + spec["abort_at"] == step:
                request_id = spec["request"].request_id
                if request_id not in finish:
                    scheduler.abort_requests([request_id])
                    aborted.add(request_id)
        if step > 6 and not scheduler.has_unfinished_requests():
            break
        schedule = scheduler.schedule()
        assert schedule.total_num_scheduled_tokens <= scheduler_config.max_num_batched_tokens
        assert sum(schedule.num_scheduled_tokens.values()) == schedule.total_num_scheduled_tokens
        assert len(schedule.num_scheduled_tokens) <= scheduler_config.max_num_seqs
        assert len(scheduler.running) <= scheduler_config.max_num_seqs
        runner_output = worker.execute(schedule)
        for new in schedule.scheduled_new_reqs:  # salted requests never reuse another salt's blocks
            for block_id in worker.hit_blocks[new.req_id]:
                assert salts[worker.block_writer[block_id]] == salts[new.req_id]
        for output in scheduler.update_from_output(schedule, runner_output):
            outputs[output.request_id].extend(output.new_token_ids)
            if output.finished:
                finish[output.request_id] = output.finish_reason
        scheduler.kv_cache_manager.check_integrity()
    else:
        raise AssertionError("the workload did not finish")

    for spec in specs:
        request = spec["request"]
        due = expected_output(request.prompt_token_ids, request.sampling_params, scheduler_config.max_model_len)
        got = outputs[request.request_id]
        if request.request_id in aborted:
            assert request.status == RequestStatus.FINISHED_ABORTED or request.request_id in finish
            assert got == due[: len(got)]
        else:
            assert got == due, request.request_id
            assert request.output_token_ids == due
            assert finish[request.request_id] in ("stop", "length")
    pool = scheduler.kv_cache_manager.block_pool
    assert pool.num_free_blocks == cache_config.num_blocks - 1, "blocks leaked"
    assert not scheduler.kv_cache_manager.req_to_blocks and not scheduler.requests
