"""AsyncLLM end to end on a tiny Qwen2 checkpoint: streams, continuous batching, aborts, errors.

Each test drives the engine from a fresh ``asyncio.run`` (the front end moves
to whichever loop a request comes from once the last one stopped) and checks
results against the offline ``LLM`` on the same checkpoint; KV blocks are
checked through the stats snapshot the front end publishes, never by touching
the engine from the test thread.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import random
import time

import pytest
from pydantic import ValidationError

from engine import LLM, AsyncLLM, EngineArgs, EngineDeadError, EngineOverloadedError, RequestOutputKind, SamplingParams
from engine.config import SchedulerConfig
from engine.executor.uniproc import UniProcExecutor
from engine.frontend.output_collector import merge_outputs
from engine.request_output import CompletionOutput, RequestOutput
from tests.conftest import engine_kwargs, greedy, random_token_ids, token_prompt
from tests.conftest import make_async_llm as make_test_async_llm

# Long enough that a 1000-token request outlasts any event-loop lag on a loaded machine.
MAX_MODEL_LEN = 1024
ENGINE_KWARGS = engine_kwargs(
    max_model_len=MAX_MODEL_LEN,
    max_num_seqs=8,
    enable_prefix_caching=True,
    num_gpu_blocks_override=8 * MAX_MODEL_LEN // 16 + 1,
)
DELTA, CUMULATIVE, FINAL_ONLY = RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE, RequestOutputKind.FINAL_ONLY


# No stat loggers; call sites override the arguments or pass ``executor_class=``.
make_async_llm = functools.partial(make_test_async_llm, **ENGINE_KWARGS)


@pytest.fixture(scope="module")
def async_llm(model_path):
    llm = make_async_llm(model_path)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def offline(model_path) -> LLM:
    return LLM(model=model_path, **ENGINE_KWARGS)


@pytest.fixture(scope="module")
def prompts() -> list:
    rng = random.Random(5)
    return [
        token_prompt(random_token_ids(rng, 40)),
        "Hello, world. The answer is",
        token_prompt(random_token_ids(rng, 7)),
        token_prompt(random_token_ids(rng, 70)),
    ]


def run(coro):
    """Runs a test body on a fresh event loop; a hang fails the test instead of stalling the suite."""

    async def bounded():
        return await asyncio.wait_for(coro, timeout=60)

    return asyncio.run(bounded())


async def collect(llm: AsyncLLM, prompt, params: SamplingParams, request_id: str) -> list[RequestOutput]:
    return [output async for output in llm.generate(prompt, params, request_id)]


async def wait_until(predicate, timeout: float = 20.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        assert loop.time() < deadline, "timed out waiting for the engine"
        await asyncio.sleep(0.005)


def is_idle_and_clean(llm: AsyncLLM) -> bool:
    stats = llm.get_stats()
    return (
        stats.num_running_reqs == 0 and stats.num_waiting_reqs == 0 and stats.num_free_blocks == stats.num_total_blocks
    )


def concat_deltas(outputs: list[RequestOutput]) -> dict[int, tuple[list[int], str]]:
    """index -> (token ids, text) of DELTA outputs joined."""
    joined: dict[int, tuple[list[int], str]] = {}
    for output in outputs:
        for completion in output.outputs:
            token_ids, text = joined.get(completion.index, ([], ""))
            joined[completion.index] = (token_ids + completion.token_ids, text + completion.text)
    return joined


def assert_one_final(outputs: list[RequestOutput]) -> None:
    assert outputs and outputs[-1].finished
    assert not any(output.finished for output in outputs[:-1])


# ----------------------------------------------------------------- results


def test_concurrent_greedy_requests_match_offline(async_llm, offline, prompts):
    params = greedy(16)
    expected = offline.generate(prompts, params, use_tqdm=False)
    before = async_llm.get_stats()

    async def body():
        results = await asyncio.gather(
            *(collect(async_llm, prompt, params, f"concurrent-{i}") for i, prompt in enumerate(prompts))
        )
        await wait_until(lambda: is_idle_and_clean(async_llm))
        return results

    for outputs, reference in zip(run(body()), expected):
        assert_one_final(outputs)
        final = outputs[-1]
        assert final.outputs[0].token_ids == reference.outputs[0].token_ids
        assert final.outputs[0].text == reference.outputs[0].text
        assert final.prompt_token_ids == reference.prompt_token_ids
        assert final.outputs[0].finish_reason == "length"
    after = async_llm.get_stats()
    assert after.num_finished_reqs_total - before.num_finished_reqs_total == len(prompts)
    assert after.num_generated_tokens_total - before.num_generated_tokens_total == 16 * len(prompts)
    assert after.num_prompt_tokens_total - before.num_prompt_tokens_total == sum(
        len(reference.prompt_token_ids) for reference in expected
    )
    assert after.kv_cache_usage == 0.0


def test_delta_chunks_concatenate_to_the_final_result(async_llm, offline, prompts):
    params = greedy(24, output_kind=DELTA)
    expected = offline.generate(prompts[1], params, use_tqdm=False)[0].outputs[0]
    outputs = run(collect(async_llm, prompts[1], params, "delta"))
    assert_one_final(outputs)
    assert len(outputs) > 1
    assert all(len(output.outputs) == 1 for output in outputs)
    assert concat_deltas(outputs)[0] == (expected.token_ids, expected.text)
    assert outputs[-1].outputs[0].finish_reason == "length"


def test_cumulative_grows_and_final_only_sends_one_output(async_llm, offline, prompts):
    expected = offline.generate(prompts[0], greedy(20), use_tqdm=False)[0].outputs[0]

    async def body():
        return await asyncio.gather(
            collect(async_llm, prompts[0], greedy(20, output_kind=CUMULATIVE), "cumulative"),
            collect(async_llm, prompts[0], greedy(20, output_kind=FINAL_ONLY), "final-only"),
        )

    cumulative, final_only = run(body())
    assert_one_final(cumulative)
    for earlier, later in zip(cumulative, cumulative[1:]):
        earlier_ids, later_ids = earlier.outputs[0].token_ids, later.outputs[0].token_ids
        assert later_ids[: len(earlier_ids)] == earlier_ids and len(later_ids) > len(earlier_ids)
    assert cumulative[-1].outputs[0].token_ids == expected.token_ids
    assert cumulative[-1].outputs[0].text == expected.text
    assert len(final_only) == 1 and final_only[0].finished
    assert final_only[0].outputs[0].token_ids == expected.token_ids


def test_n_greater_than_one_streams_deltas_by_index(async_llm, offline, prompts):
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12, ignore_eos=True, output_kind=DELTA)
    expected = offline.generate(prompts[2], params, use_tqdm=False)[0].outputs
    outputs = run(collect(async_llm, prompts[2], params, "fan-out"))
    assert_one_final(outputs)
    for output in outputs:
        indices = [completion.index for completion in output.outputs]
        assert indices == sorted(set(indices)), "each completion at most once per output, by index"
    joined = concat_deltas(outputs)
    assert sorted(joined) == [0, 1, 2]
    for completion in expected:
        assert joined[completion.index] == (completion.token_ids, completion.text)
    finish_reasons = {c.index: c.finish_reason for output in outputs for c in output.outputs if c.finish_reason}
    assert finish_reasons == {0: "length", 1: "length", 2: "length"}


# ---------------------------------------------------- continuous batching


def test_request_added_mid_decode_joins_the_running_batch(async_llm, offline, prompts):
    long_prompt, short_prompt = token_prompt(list(range(10, 20))), prompts[2]
    expected_short = offline.generate(short_prompt, greedy(8), use_tqdm=False)[0].outputs[0].token_ids
    events: list[str] = []  # which request each consumed output belonged to, in arrival order
    num_running_seen: list[int] = []

    async def body():
        before = async_llm.get_stats()
        long_stream = async_llm.generate(long_prompt, greedy(1000, output_kind=DELTA), "long")
        short_done = asyncio.Event()

        async def read_long():
            async for output in long_stream:
                events.append("long")
                assert not output.finished, "the long request ended before the short one joined and left"
                if short_done.is_set():
                    break  # one output after the short request finished is all this test needs

        long_task = asyncio.create_task(read_long())
        await wait_until(lambda: len(events) >= 3)
        short_outputs = []
        async for output in async_llm.generate(short_prompt, greedy(8, output_kind=DELTA), "short"):
            events.append("short")
            num_running_seen.append(async_llm.get_stats().num_running_reqs)
            short_outputs.append(output)
        stats = async_llm.get_stats()  # includes the short request's last step
        short_done.set()
        await long_task
        await long_stream.aclose()  # aborts the long request
        await wait_until(lambda: is_idle_and_clean(async_llm))
        return short_outputs, before, stats

    short_outputs, before, stats = run(body())
    assert concat_deltas(short_outputs)[0][0] == expected_short
    first_short, last_short = events.index("short"), len(events) - 1 - events[::-1].index("short")
    assert "long" in events[:first_short] and "long" in events[last_short + 1 :], "short ran inside long's decode"
    assert max(num_running_seen) == 2
    # Every step so far gave the long request one token: the short one only rode along, adding no step.
    num_steps = stats.num_steps_total - before.num_steps_total
    num_long_tokens = stats.num_generated_tokens_total - before.num_generated_tokens_total - 8
    assert num_steps == num_long_tokens


def test_the_idle_front_end_blocks_instead_of_spinning(async_llm, prompts):
    run(collect(async_llm, prompts[2], greedy(4), "wake-up"))  # the engine worked, then went idle
    cpu_before = time.process_time()  # this process: the core client's thread (the core runs in its own)
    # A fixed window on purpose: what is checked is that nothing happens (the CPU time stays flat), so there
    # is no event to poll for; a spinning thread would burn about the whole 0.3 s, 10x the bound.
    time.sleep(0.3)
    assert time.process_time() - cpu_before < 0.03, "the idle engine burns CPU in the server's process"
    outputs = run(collect(async_llm, prompts[2], greedy(4), "wakes-it"))  # a new request wakes it
    assert outputs[-1].finished


# ----------------------------------------------------------- cancellation


def test_closing_or_cancelling_a_stream_aborts_and_frees_blocks(async_llm, prompts):
    params = greedy(900, output_kind=DELTA)

    async def body():
        await wait_until(lambda: is_idle_and_clean(async_llm))
        before = async_llm.get_stats()
        # A client that stops reading: the generator is closed.
        stream = async_llm.generate(prompts[0], params, "closed")
        for _ in range(3):
            await stream.__anext__()
        await stream.aclose()
        # A client whose handler task is cancelled mid-stream.
        started = asyncio.Event()

        async def handler():
            async for _ in async_llm.generate(prompts[3], params, "cancelled"):
                started.set()

        task = asyncio.create_task(handler())
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await wait_until(
            lambda: (
                is_idle_and_clean(async_llm)
                and async_llm.get_stats().num_aborted_reqs_total == before.num_aborted_reqs_total + 2
            )
        )
        return before, async_llm.get_stats()

    before, after = run(body())
    assert after.num_free_blocks == before.num_free_blocks == after.num_total_blocks
    assert after.num_steps_total - before.num_steps_total < 900, "the aborted requests stopped early"
    assert after.num_finished_reqs_total == before.num_finished_reqs_total


@pytest.mark.parametrize("in_process", [True, False], ids=["in-process core", "core process"])
def test_check_integrity_runs_between_steps_and_catches_a_corrupt_pool(model_path, prompts, in_process):
    """``check_integrity`` (what ``serval bench soak`` asks every replica afterwards) holds while requests run:
    it is checked between steps by the core's own loop, wherever the core runs, never
    racing one. A block both free and held fails it (corrupted by hand in the in-process core)."""
    llm = make_async_llm(model_path, engine_core_process=not in_process)

    async def body():
        streams = [
            asyncio.create_task(collect(llm, prompt, greedy(48), f"integrity-{i}"))
            for i, prompt in enumerate(prompts[:4])
        ]
        for _ in range(8):
            await llm.check_integrity()
            await asyncio.sleep(0.01)
        await asyncio.gather(*streams)
        await llm.check_integrity()
        if not in_process:
            return
        kv = llm._frontend.engine.engine_core.engine_core.scheduler.kv_cache_manager
        kv.req_to_blocks["ghost"] = ([next(iter(kv.block_pool.free_queue))],)  # held, and still on the free list
        try:
            with pytest.raises(AssertionError, match="both free and referenced"):
                await llm.check_integrity()
        finally:
            del kv.req_to_blocks["ghost"]
        await llm.check_integrity()

    try:
        run(body())
    finally:
        llm.shutdown()


def test_abort_ends_the_stream_with_abort_reason(async_llm, prompts):
    async def body():
        outputs = []
        async for output in async_llm.generate(prompts[0], greedy(900, output_kind=CUMULATIVE), "to-abort"):
            outputs.append(output)
            if len(outputs) == 2:
                await async_llm.abort("to-abort")
        await async_llm.abort("to-abort")  # finished: no-op
        await async_llm.abort("never-seen")  # unknown: no-op
        await wait_until(lambda: is_idle_and_clean(async_llm))
        # The id is free again.
        again = await collect(async_llm, prompts[0], greedy(4), "to-abort")
        return outputs, again

    outputs, again = run(body())
    assert_one_final(outputs)
    final = outputs[-1].outputs[0]
    assert final.finish_reason == "abort" and final.token_ids[:2] == outputs[1].outputs[0].token_ids[:2]
    assert again[-1].outputs[0].finish_reason == "length"


# ------------------------------------------------------------- bad input


def test_bad_input_raises_value_error_and_does_not_disturb_others(async_llm, offline, prompts):
    params = greedy(30, output_kind=DELTA)
    expected = offline.generate(prompts[3], params, use_tqdm=False)[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)

    async def expect_value_error(prompt, request_id, match, sampling_params=None):
        stream = async_llm.generate(prompt, sampling_params or greedy(4), request_id)
        with pytest.raises(ValueError, match=match):
            await stream.__anext__()

    async def body():
        good = asyncio.create_task(collect(async_llm, prompts[3], params, "good"))
        await wait_until(lambda: async_llm.get_stats().num_running_reqs == 1)
        await expect_value_error(token_prompt([]), "empty", "empty")
        await expect_value_error(token_prompt([7] * (MAX_MODEL_LEN + 1)), "too-long", "max_model_len")
        await expect_value_error(token_prompt([5, 10**6]), "out-of-vocab", "outside the vocabulary")
        await expect_value_error(42, "not-a-prompt", "must be a string")
        await expect_value_error(prompts[0], "good", "already in use")  # the running request's id
        fan_out = asyncio.create_task(collect(async_llm, prompts[2], greedy(8, n=2), "x"))
        await asyncio.sleep(0)
        await expect_value_error(prompts[0], "0_x", "in-flight")  # would take over a child's id
        good_outputs, fan_out_outputs = await good, await fan_out
        # Refused ids left nothing behind: they can be used now.
        empty_again = await collect(async_llm, prompts[2], greedy(4), "empty")
        await wait_until(lambda: is_idle_and_clean(async_llm))
        return good_outputs, fan_out_outputs, empty_again

    good_outputs, fan_out_outputs, empty_again = run(body())
    assert concat_deltas(good_outputs)[0][0] == expected
    # A streamed n > 1 request's outputs each carry the completions that changed (vLLM's way), so the two
    # children's ends may come in one output or in two: each child's latest completion holds its 8 tokens.
    latest = {c.index: c for output in fan_out_outputs for c in output.outputs}
    assert sorted(latest) == [0, 1] and [len(latest[i].token_ids) for i in (0, 1)] == [8, 8]
    assert fan_out_outputs[-1].finished
    assert empty_again[-1].finished


# -------------------------------------------------------------- overload


def test_max_num_queued_reqs_refuses_new_requests_when_reached(model_path, offline, prompts):
    with pytest.raises(ValidationError):
        EngineArgs(model=model_path, max_num_queued_reqs=0)
    with pytest.raises(ValidationError):
        SchedulerConfig(max_num_queued_reqs=0)
    llm = make_async_llm(model_path, max_num_seqs=1, max_num_queued_reqs=1)
    params = greedy(12, output_kind=DELTA)

    async def body():
        running = llm.generate(prompts[0], params, "running")
        first = await running.__anext__()  # "running" holds the only seat
        queued = asyncio.create_task(collect(llm, prompts[1], params, "queued"))
        await asyncio.sleep(0)  # "queued" is submitted and waits for the seat
        refused = []
        for i in range(5):
            with pytest.raises(EngineOverloadedError, match="max_num_queued_reqs=1") as info:
                await llm.generate(prompts[2], params, f"refused-{i}").__anext__()
            refused.append(info.value)
        rest = [output async for output in running]
        queued_outputs = await queued
        later = await collect(llm, prompts[2], params, "later")  # the queue drained: accepted again
        return [first] + rest, queued_outputs, later, refused

    try:
        running_outputs, queued_outputs, later, refused = run(body())
    finally:
        llm.shutdown()
    assert len(refused) == 5
    for outputs, prompt in ((running_outputs, prompts[0]), (queued_outputs, prompts[1]), (later, prompts[2])):
        assert_one_final(outputs)
        expected = offline.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
        assert concat_deltas(outputs)[0][0] == expected


# ---------------------------------------------------------- slow consumer


def test_slow_consumer_gets_merged_outputs(async_llm, offline, prompts):
    expected = offline.generate(prompts[0], greedy(200), use_tqdm=False)[0].outputs[0]

    async def read_slowly(kind, request_id):
        before = async_llm.get_stats().num_finished_reqs_total
        stream = async_llm.generate(prompts[0], greedy(200, output_kind=kind), request_id)
        outputs = [await stream.__anext__()]
        # Don't read while the engine runs the request to the end.
        await wait_until(lambda: async_llm.get_stats().num_finished_reqs_total > before)
        outputs += [output async for output in stream]
        return outputs

    async def body():
        return await read_slowly(DELTA, "slow-delta"), await read_slowly(CUMULATIVE, "slow-cumulative")

    delta, cumulative = run(body())
    for outputs in (delta, cumulative):
        assert_one_final(outputs)
        assert len(outputs) <= 3, "outputs were merged instead of queued one per step"
    assert concat_deltas(delta)[0] == (expected.token_ids, expected.text)
    # One token per step: without merging, the tokens after the first output would come one output each.
    assert sum(len(output.outputs[0].token_ids) for output in delta[1:]) >= 100
    assert cumulative[-1].outputs[0].token_ids == expected.token_ids
    assert cumulative[-1].outputs[0].text == expected.text


def test_merge_outputs_concatenates_deltas_and_keeps_newest_cumulative():
    def output(*completions, finished=False):
        return RequestOutput("r", None, [1, 2], list(completions), finished)

    pending = output(CompletionOutput(1, "a", [5]), CompletionOutput(0, "x", [9]))
    new = output(CompletionOutput(1, "b", [6], finish_reason="stop"), CompletionOutput(2, "z", [7]))
    merged = merge_outputs(pending, new, is_delta=True)
    assert [(c.index, c.text, c.token_ids, c.finish_reason) for c in merged.outputs] == [
        (0, "x", [9], None),
        (1, "ab", [5, 6], "stop"),
        (2, "z", [7], None),
    ]
    merged = merge_outputs(pending, new, is_delta=False)
    assert [(c.index, c.text, c.token_ids) for c in merged.outputs] == [(0, "x", [9]), (1, "b", [6]), (2, "z", [7])]
    assert merge_outputs(output(finished=True), output(), is_delta=True).finished


# ------------------------------------------------------- shutdown, death


def assert_core_process_gone(pid: int) -> None:
    with pytest.raises(ProcessLookupError):  # exited and reaped: shutdown released it
        os.kill(pid, 0)


def test_shutdown_ends_streams_and_releases_the_core(model_path, prompts):
    llm = make_async_llm(model_path)
    pid = llm.engine_core_pid

    async def body():
        stream = llm.generate(prompts[0], greedy(900, output_kind=DELTA), "open")
        await stream.__anext__()
        llm.shutdown()
        assert_core_process_gone(pid)
        with pytest.raises(EngineDeadError, match="shut down"):
            async for _ in stream:
                pass
        with pytest.raises(EngineDeadError):
            await llm.generate(prompts[0], greedy(4), "after").__anext__()
        with pytest.raises(EngineDeadError):
            await llm.check_health()

    run(body())
    llm.shutdown()  # idempotent


class FailingExecutor(UniProcExecutor):
    """A real executor with one injected fault: the step after ``num_good_steps`` raises."""

    num_good_steps = 3

    def execute_model(self, scheduler_output):
        if self.num_good_steps == 0:
            raise RuntimeError("injected worker failure")
        self.num_good_steps -= 1
        return super().execute_model(scheduler_output)


def test_a_failed_step_makes_the_engine_dead(model_path, prompts, caplog):
    llm = make_async_llm(model_path, executor_class=FailingExecutor)
    pid = llm.engine_core_pid

    async def body():
        await llm.check_health()
        results = await asyncio.gather(
            *(collect(llm, prompt, greedy(50), f"doomed-{i}") for i, prompt in enumerate(prompts[:2])),
            return_exceptions=True,
        )
        with pytest.raises(EngineDeadError):
            await llm.generate(prompts[0], greedy(4), "late").__anext__()
        with pytest.raises(EngineDeadError, match="injected worker failure"):
            await llm.check_health()
        return results

    with caplog.at_level(logging.ERROR, logger="engine.async_llm"):
        results = run(body())
    llm.shutdown()
    assert all(isinstance(result, EngineDeadError) for result in results), results
    assert isinstance(results[0].__cause__, RuntimeError)
    assert "engine died" in caplog.text and "injected worker failure" in caplog.text
    assert_core_process_gone(pid)
