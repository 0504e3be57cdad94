"""The Ray executor on a real local Ray cluster: worker actors, gloo process groups, both control paths
(actor tasks, the CPU default, and a compiled graph, the GPU default).

Greedy tokens under TP=2, PP=2 and TP=2 x PP=2 must equal the single-device
run token for token (float32, a batch of mixed-length prompts with prefill
chunks forced small so chunks and decodes share steps); pipeline stages keep
two micro-batches in flight; every socket the workers open is on loopback;
a worker killed mid-generation fails the engine promptly instead of hanging it.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal

import pytest

from engine import LLM, SamplingParams
from engine.async_llm import AsyncLLM, EngineDeadError
from engine.engine_args import EngineArgs
from tests.conftest import assert_pool_clean, engine_kwargs, random_token_ids, token_prompt, wait_until
from tests.serve.cluster import is_loopback, listening_addresses

PROMPT_LENGTHS = (3, 17, 40, 66, 97)
GREEDY = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=12)
ENGINE_KWARGS = engine_kwargs(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=48, num_gpu_blocks_override=64)


def _prompts() -> list[dict]:
    rng = random.Random(7)
    return [token_prompt(random_token_ids(rng, n)) for n in PROMPT_LENGTHS]


def _greedy_token_ids(llm: LLM) -> list[list[int]]:
    return [list(output.outputs[0].token_ids) for output in llm.generate(_prompts(), GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module")
def single_device_tokens(tiny_checkpoint):
    def get(arch: str) -> list[list[int]]:
        llm = LLM(tiny_checkpoint(arch), **ENGINE_KWARGS)
        try:
            return _greedy_token_ids(llm)
        finally:
            llm.shutdown()

    return get


CONTROL_PATHS = [pytest.param(False, id="tasks"), pytest.param(True, id="graph")]


# Each layout on the actor-task path; Qwen3 and Gemma 3 (per-head q/k norms sharded under TP; Gemma's four norms
# a layer, its scaled embedding on the first stage and its two rotaries) and the compiled graph
# (its collectives and stage transfers) under TP=2 x PP=2, which holds both a TP group and a stage boundary.
# The compiled graph's pipeline is also test_pipeline_keeps_two_micro_batches_in_flight's.
@pytest.mark.parametrize(
    "arch,compiled_graph,tp,pp",
    [
        ("llama", False, 2, 1),
        ("llama", False, 1, 2),
        ("llama", False, 2, 2),
        ("qwen3", False, 2, 2),
        ("gemma3", False, 2, 2),
        ("llama", True, 2, 2),
    ],
    ids=[
        "tp2-llama-tasks",
        "pp2-llama-tasks",
        "tp2xpp2-llama-tasks",
        "tp2xpp2-qwen3-tasks",
        "tp2xpp2-gemma3-tasks",
        "tp2xpp2-llama-graph",
    ],
)
def test_greedy_tokens_equal_single_device(
    local_ray, tiny_checkpoint, single_device_tokens, arch, compiled_graph, tp, pp
):
    listeners_before = listening_addresses()
    llm = LLM(
        tiny_checkpoint(arch),
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        distributed_executor_backend="ray",
        num_cpus_per_worker=0.4,
        ray_compiled_graph=compiled_graph,
        **ENGINE_KWARGS,
    )
    try:
        new_listeners = listening_addresses() - listeners_before
        assert all(is_loopback(address) for address, _ in new_listeners), new_listeners
        assert _greedy_token_ids(llm) == single_device_tokens(arch)
        assert_pool_clean(llm)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("compiled_graph", CONTROL_PATHS)
def test_pipeline_keeps_two_micro_batches_in_flight(local_ray, tiny_checkpoint, single_device_tokens, compiled_graph):
    llm = LLM(
        tiny_checkpoint("llama"),
        pipeline_parallel_size=2,
        distributed_executor_backend="ray",
        num_cpus_per_worker=0.4,
        ray_compiled_graph=compiled_graph,
        **ENGINE_KWARGS,
    )
    core = llm.llm_engine.engine_core.engine_core
    executor = core.executor
    num_in_flight_at_submit: list[int] = []
    start_step = executor.execute_model_async

    def recording_start_step(scheduler_output):
        num_in_flight_at_submit.append(len(core.batches_in_flight))
        return start_step(scheduler_output)

    executor.execute_model_async = recording_start_step
    try:
        assert _greedy_token_ids(llm) == single_device_tokens("llama")
        assert max(num_in_flight_at_submit) == 1  # a second micro-batch started while the first was in flight
        assert num_in_flight_at_submit.count(1) >= len(num_in_flight_at_submit) // 3
        assert not core.batches_in_flight
        assert_pool_clean(llm)
    finally:
        llm.shutdown()


def _alive_actor_pids(class_name: str) -> list[int]:
    """This module's cluster's live actors of ``class_name`` (from the GCS: the cluster has no dashboard)."""
    import ray

    actors = ray._private.state.actors().values()
    return sorted(a["Pid"] for a in actors if a["ActorClassName"] == class_name and a["State"] == "ALIVE")


def _tp2_async_llm(tiny_checkpoint, **overrides) -> AsyncLLM:
    args = EngineArgs(
        model=tiny_checkpoint("llama"),
        tensor_parallel_size=2,
        distributed_executor_backend="ray",
        num_cpus_per_worker=0.4,
        **{**ENGINE_KWARGS, "max_model_len": 512, **overrides},
    )
    return AsyncLLM.from_engine_args(args)


async def _first_output_of_a_long_stream(engine: AsyncLLM, request_id: str):
    stream = engine.generate(
        _prompts()[1], SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=400), request_id
    )
    first = await anext(stream)
    assert first.outputs[0].token_ids
    return stream


async def _assert_engine_dead(engine: AsyncLLM, stream) -> None:
    with pytest.raises(EngineDeadError):
        async with asyncio.timeout(30):
            async for _ in stream:
                pass
    with pytest.raises(EngineDeadError):
        await engine.check_health()
    with pytest.raises(EngineDeadError):
        await anext(engine.generate(_prompts()[0], GREEDY, "after"))


@pytest.mark.parametrize("compiled_graph", CONTROL_PATHS)
def test_a_killed_worker_fails_streams_and_health(local_ray, tiny_checkpoint, compiled_graph):
    engine = _tp2_async_llm(tiny_checkpoint, ray_compiled_graph=compiled_graph)

    async def scenario() -> None:
        await engine.check_health()
        stream = await _first_output_of_a_long_stream(engine, "victim")
        os.kill(_alive_actor_pids("RayWorker")[1], signal.SIGKILL)
        await _assert_engine_dead(engine, stream)

    try:
        asyncio.run(scenario())
    finally:
        engine.shutdown()


def test_the_core_of_a_tp_engine_is_a_ray_actor_and_dies_loudly_with_its_workers(local_ray, tiny_checkpoint):
    """Serving a TP engine, the core (scheduler, executor) runs in an EngineCoreActor, not in this process:
    greedy tokens equal the single-device engine's; SIGKILLing it fails the open stream at once and the
    worker actors it owned go with it; shutting down a live one leaves no actor behind."""
    engine = _tp2_async_llm(tiny_checkpoint)

    async def scenario() -> None:
        outputs = [await _collect(engine, prompt, f"r{i}") for i, prompt in enumerate(_prompts())]
        assert [list(output.outputs[0].token_ids) for output in outputs] == reference
        stream = await _first_output_of_a_long_stream(engine, "victim")
        os.kill(engine.engine_core_pid, signal.SIGKILL)
        await _assert_engine_dead(engine, stream)

    reference = [
        list(output.outputs[0].token_ids)
        for output in LLM(tiny_checkpoint("llama"), **ENGINE_KWARGS).generate(_prompts(), GREEDY, use_tqdm=False)
    ]
    assert engine.engine_core_pid not in (None, os.getpid())
    assert _alive_actor_pids("EngineCoreActor") == [engine.engine_core_pid]
    assert len(_alive_actor_pids("RayWorker")) == 2
    try:
        asyncio.run(scenario())
    finally:
        engine.shutdown()
    assert wait_until(_nothing_of_the_engine_is_left, 30)

    engine = _tp2_async_llm(tiny_checkpoint)  # and a clean shutdown of a live one
    engine.shutdown()
    assert wait_until(_nothing_of_the_engine_is_left, 30)


def _nothing_of_the_engine_is_left() -> bool:
    """No core or worker actor alive, and the placement group made for them removed (every CPU free)."""
    import ray

    actors_gone = not _alive_actor_pids("RayWorker") and not _alive_actor_pids("EngineCoreActor")
    return actors_gone and ray.available_resources().get("CPU") == ray.cluster_resources()["CPU"]


async def _collect(engine: AsyncLLM, prompt, request_id: str):
    outputs = [output async for output in engine.generate(prompt, GREEDY, request_id)]
    return outputs[-1]


def test_structured_outputs_under_tp2_x_pp2_equal_single_device(local_ray, tiny_checkpoint):
    """The step's grammar bitmask reaches the output rank (last stage, TP rank 0) with two micro-batches
    in flight: greedy constrained outputs equal the single-device ones token for token, and validate."""
    schema = {
        "type": "object",
        "properties": {"id": {"type": "integer", "maximum": 999}, "kind": {"enum": ["x", "y"]}},
        "required": ["id", "kind"],
        "additionalProperties": False,
    }
    constraints = [{"json": schema}, {"choice": ["left", "right"]}, {"regex": "[a-c]{2,5}"}] * 2
    params = [
        SamplingParams(temperature=0.0, max_tokens=40, structured_outputs={**c, "disable_any_whitespace": True})
        for c in constraints
    ]

    def generate(**parallel) -> list[list[int]]:
        llm = LLM(tiny_checkpoint("llama"), **parallel, **ENGINE_KWARGS)
        try:
            outputs = llm.generate(_prompts() + _prompts()[:1], params, use_tqdm=False)
            assert_pool_clean(llm)
        finally:
            llm.shutdown()
        for output in outputs:
            assert output.outputs[0].finish_reason == "stop", output.outputs[0].text
        assert json.loads(outputs[0].outputs[0].text)["kind"] in ("x", "y")
        return [list(output.outputs[0].token_ids) for output in outputs]

    distributed = generate(
        tensor_parallel_size=2, pipeline_parallel_size=2, distributed_executor_backend="ray", num_cpus_per_worker=0.4
    )
    assert distributed == generate()


@pytest.mark.parametrize(
    "speculative_config",
    [
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3},
        {"model": "DRAFT", "num_speculative_tokens": 3},
    ],
    ids=["ngram", "draft_model"],
)
def test_speculative_decoding_under_tp2_equals_single_device(
    local_ray, tiny_checkpoint, single_device_tokens, speculative_config
):
    """Drafts are proposed on the output rank (the draft model whole, beside TP rank 0's slice of the target)
    and verified by both ranks: greedy tokens equal the single-device run's."""
    if speculative_config.get("model") == "DRAFT":
        speculative_config = {**speculative_config, "model": tiny_checkpoint("llama")}  # the target as its draft
    llm = LLM(
        tiny_checkpoint("llama"),
        tensor_parallel_size=2,
        distributed_executor_backend="ray",
        num_cpus_per_worker=0.4,
        speculative_config=speculative_config,
        **ENGINE_KWARGS,
    )
    try:
        assert _greedy_token_ids(llm) == single_device_tokens("llama")
        assert_pool_clean(llm)
        stats = llm.llm_engine.engine_core.engine_core.scheduler.get_stats().spec_decoding_stats
        assert stats.num_draft_tokens > 0, stats
        if "model" in speculative_config:  # the target drafting for itself: its drafts hold
            assert stats.num_accepted_tokens > 0.9 * stats.num_draft_tokens, stats
    finally:
        llm.shutdown()


def test_lora_adapters_load_on_every_worker_under_tp2(local_ray, tiny_checkpoint, tmp_path):
    """Each Ray worker reads the adapter on its own loading thread (``RayWorker.load_lora``, beside steps), and
    a TP=2 batch of the base model and two adapters gives the single-device tokens."""
    from engine.lora_request import LoRARequest
    from serval.tools.make_adapter import make_lora_adapter

    base = tiny_checkpoint("llama")
    loras = [
        None,
        *(LoRARequest(f"a{i}", i, str(make_lora_adapter(tmp_path / f"a{i}", base, rank=4, seed=i))) for i in (1, 2)),
    ]
    prompts = _prompts()[: len(loras)]
    lora_kwargs = dict(enable_lora=True, max_loras=2, max_lora_rank=8, **ENGINE_KWARGS)

    def tokens(llm: LLM) -> list[list[int]]:
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras)
        return [output.outputs[0].token_ids for output in outputs]

    with LLM(base, **lora_kwargs) as one_device:
        expected = tokens(one_device)
    with LLM(
        base, tensor_parallel_size=2, distributed_executor_backend="ray", num_cpus_per_worker=0.4, **lora_kwargs
    ) as tp2:
        assert tokens(tp2) == expected
        assert tp2.llm_engine.engine_core.engine_core.lora_loading.num_waiting_requests() == 0
