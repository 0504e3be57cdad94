"""``EngineStats``' totals, as ``LLMEngine`` keeps them: every token, prompt, step and request counted once.

The engine here has no stat loggers (as ``AsyncLLM`` with ``disable_log_stats``), so
no request keeps latency statistics: the totals must not depend on them.
"""

from __future__ import annotations

import pytest

from engine import RequestOutputKind
from engine.engine_args import EngineArgs
from engine.llm_engine import LLMEngine
from engine.metrics import EngineStats
from tests.conftest import greedy

MAX_TOKENS = 6


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    engine = LLMEngine(
        EngineArgs(
            model=tiny_checkpoint("llama"), dtype="float32", max_model_len=128, enable_prefix_caching=False
        ).create_engine_config()
    )
    yield engine
    engine.shutdown()


def prompt(length: int) -> dict:
    return {"prompt_token_ids": list(range(10, 10 + length))}


def step_until_done(engine: LLMEngine, kind: RequestOutputKind = RequestOutputKind.CUMULATIVE) -> tuple[int, int]:
    """(steps taken, tokens the outputs handed out: DELTA ones added up, other kinds' latest per completion)."""
    num_steps, num_tokens_of = 0, {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            for completion in output.outputs:
                key = (output.request_id, completion.index)
                earlier = num_tokens_of.get(key, 0) if kind == RequestOutputKind.DELTA else 0
                num_tokens_of[key] = earlier + len(completion.token_ids)
        num_steps += 1
    return num_steps, sum(num_tokens_of.values())


def delta(before: EngineStats, after: EngineStats, field: str) -> int:
    return getattr(after, field) - getattr(before, field)


@pytest.mark.parametrize("kind", list(RequestOutputKind))
def test_each_token_prompt_and_request_counts_once_whatever_the_output_kind(engine, kind):
    before = engine.get_stats()
    engine.add_request(f"{kind.name}-n2", prompt(20), greedy(MAX_TOKENS, n=2, output_kind=kind))
    engine.add_request(f"{kind.name}-n1", prompt(5), greedy(MAX_TOKENS, output_kind=kind))
    num_steps, num_tokens_delivered = step_until_done(engine, kind)
    after = engine.get_stats()
    assert num_tokens_delivered == 3 * MAX_TOKENS  # what the outputs carried: the reference
    assert delta(before, after, "num_generated_tokens_total") == 3 * MAX_TOKENS
    assert delta(before, after, "num_prompt_tokens_total") == 20 + 5  # one prompt per user request
    assert delta(before, after, "num_finished_reqs_total") == 2  # user requests, not the n children
    assert delta(before, after, "num_steps_total") == num_steps
    assert delta(before, after, "num_aborted_reqs_total") == 0
    assert after.num_running_reqs == after.num_waiting_reqs == 0
    assert after.num_free_blocks == after.num_total_blocks and after.kv_cache_usage == 0.0


def test_aborts_count_requests_still_in_the_engine(engine):
    before = engine.get_stats()
    engine.add_request("to-abort", prompt(8), greedy(50, n=2))
    engine.step()
    engine.step()
    mid = engine.get_stats()
    assert mid.num_running_reqs == 2 and mid.num_free_blocks < mid.num_total_blocks
    engine.abort_request(["to-abort", "to-abort", "never-added"])  # once, however often asked
    engine.add_request("finishes", prompt(4), greedy(1))
    step_until_done(engine)
    engine.abort_request(["finishes"])  # already finished: not an abort
    after = engine.get_stats()
    assert delta(before, after, "num_aborted_reqs_total") == 1
    assert delta(before, after, "num_finished_reqs_total") == 1
    assert delta(before, after, "num_prompt_tokens_total") == 8 + 4
    # Generated tokens are counted as the engine makes them: 2 steps of 2 completions, then 1 token.
    assert delta(before, after, "num_generated_tokens_total") == 2 * 2 + 1
    assert after.num_free_blocks == after.num_total_blocks


def test_a_snapshot_shares_nothing_with_the_engine(engine):
    snapshot = engine.get_stats()
    engine.add_request("later", prompt(4), greedy(2))
    step_until_done(engine)
    assert engine.get_stats().num_steps_total > snapshot.num_steps_total
    with pytest.raises(AttributeError):  # frozen: readers on other threads cannot change it either
        snapshot.num_steps_total = 0  # type: ignore[misc]
