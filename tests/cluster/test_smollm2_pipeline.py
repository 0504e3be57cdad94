"""Pipeline parallelism on a real pretrained model, SmolLM2-135M-Instruct (float32): two stages of 15
layers each as Ray worker actors (gloo on loopback) generate, for the batch of chat prompts of
tests/real_model/, the greedy tokens transformers' ``generate(do_sample=False)`` generates (which one
device generates too, tests/real_model/test_smollm2_offline.py). Prompt chunks are kept small so the two
micro-batches in flight mix prefill chunks and decodes. Every KV block is free again after the run.
"""

from __future__ import annotations

import pytest

from engine import LLM
from tests.conftest import assert_pool_clean
from tests.real_model.smollm2 import (
    CONVERSATIONS,
    ENGINE_KWARGS,
    NAMES,
    assert_greedy_equals_transformers,
    greedy_params,
)

pytestmark = pytest.mark.slow  # Ray, two stage actors loading 135M weights, 40 pipelined steps: ~15-20 s

PP_KWARGS = {**ENGINE_KWARGS, "max_num_batched_tokens": 48}  # ~40-token prompts arrive in chunks


@pytest.fixture(scope="module")
def pp_outputs(local_ray, smollm2_path) -> dict:
    llm = LLM(
        smollm2_path,
        pipeline_parallel_size=2,
        distributed_executor_backend="ray",
        num_cpus_per_worker=0.4,
        **PP_KWARGS,
    )
    try:
        outputs = llm.chat([CONVERSATIONS[name] for name in NAMES], greedy_params(), use_tqdm=False)
        # generate returns once every request has finished; a micro-batch may still be in flight then, but only
        # one that tells the workers which requests finished (it schedules no token).
        in_flight = llm.llm_engine.engine_core.engine_core.batches_in_flight
        assert all(scheduler_output.total_num_scheduled_tokens == 0 for scheduler_output, _ in in_flight)
        assert_pool_clean(llm)
    finally:
        llm.shutdown()
    return dict(zip(NAMES, outputs))


@pytest.mark.parametrize("name", NAMES)
def test_pp2_greedy_tokens_equal_transformers_generate(smollm2_path, pp_outputs, name):
    completion = pp_outputs[name].outputs[0]
    assert_greedy_equals_transformers(smollm2_path, name, completion)
