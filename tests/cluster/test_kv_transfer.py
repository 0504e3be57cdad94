"""Disaggregated prefill at the engine level: a prefill engine and a decode engine in this process,
KV blocks moving between them through Ray's object store.

Greedy tokens equal colocated serving, blocks the decode side already holds are not
transferred, a lost transfer is computed locally, and both pools end clean.
"""

from __future__ import annotations

import dataclasses
import random

import pytest

from engine.config import KVTransferConfig
from engine.engine_args import EngineArgs
from engine.inputs import RequestOptions
from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.sampling_params import RequestOutputKind, SamplingParams
from tests.conftest import assert_pool_clean, engine_kwargs, random_token_ids, token_prompt

# seed=0 (from engine_kwargs) is EngineArgs' default: these are the arguments these engines always had.
ENGINE_KWARGS = engine_kwargs(max_model_len=256, max_num_seqs=8, num_gpu_blocks_override=96, block_size=16)
PROMPT_LENGTHS = (1, 5, 16, 17, 40, 64, 100, 181)
MAX_TOKENS = 12


class _Engine:
    """An LLMEngine that ``assert_pool_clean`` accepts (it reads ``llm_engine``)."""

    def __init__(self, model: str, role: str | None, connector: str = "object_store") -> None:
        kv_config = None if role is None else KVTransferConfig(kv_role=role, kv_connector=connector)
        backend = "ray" if connector == "ray_direct" else None  # ray_direct moves blocks between worker actors
        args = EngineArgs(
            model=model,
            kv_transfer_config=kv_config,
            distributed_executor_backend=backend,
            num_cpus_per_worker=0.5,
            **ENGINE_KWARGS,
        )
        self.llm_engine = LLMEngine(args.create_engine_config())

    @property
    def connector(self):
        return self.llm_engine.engine_core.engine_core.scheduler.kv_connector

    def run(self, requests: dict[str, tuple[list[int], SamplingParams, dict | None]]) -> dict:
        """Adds the requests, steps until all finish (checking block integrity every step); final outputs."""
        engine = self.llm_engine
        for request_id, (token_ids, params, kv_params) in requests.items():
            engine.add_request(
                request_id, token_prompt(token_ids), params, RequestOptions(kv_transfer_params=kv_params)
            )
        finals = {}
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    finals[output.request_id] = output
            engine.engine_core.engine_core.scheduler.kv_cache_manager.check_integrity()
        return finals


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(
        max_tokens=max_tokens, temperature=0.0, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY
    )


def _prefill(prefill: _Engine, prompts: dict[str, list[int]]) -> dict[str, dict]:
    finals = prefill.run({rid: (ids, _greedy(1), {"do_remote_decode": True}) for rid, ids in prompts.items()})
    return {rid: output.kv_transfer_params for rid, output in finals.items()}


def _decode(decode: _Engine, prompts: dict[str, list[int]], kv_params: dict[str, dict]) -> dict[str, list[int]]:
    finals = decode.run({rid: (ids, _greedy(MAX_TOKENS), kv_params.get(rid)) for rid, ids in prompts.items()})
    return {rid: output.outputs[0].token_ids for rid, output in finals.items()}


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    return tiny_checkpoint("llama")


@pytest.fixture(scope="module")
def prompts() -> dict[str, list[int]]:
    rng = random.Random(7)
    return {f"r{i}": random_token_ids(rng, length) for i, length in enumerate(PROMPT_LENGTHS)}


@pytest.fixture(scope="module")
def colocated_tokens(model, prompts) -> dict[str, list[int]]:
    llm = LLM(model, **ENGINE_KWARGS)
    outputs = llm.generate([token_prompt(ids) for ids in prompts.values()], _greedy(MAX_TOKENS))
    return {rid: output.outputs[0].token_ids for rid, output in zip(prompts, outputs)}


def test_object_store_decode_equals_colocated(local_ray, model, prompts, colocated_tokens):
    prefill, decode = _Engine(model, "kv_producer"), _Engine(model, "kv_consumer")
    kv_params = _prefill(prefill, prompts)
    handles = {rid: params["remote_kv"] for rid, params in kv_params.items()}
    assert {rid: handle.num_tokens for rid, handle in handles.items()} == {r: len(p) for r, p in prompts.items()}
    assert_pool_clean(prefill)  # the prefill side copied its blocks out and freed them at once

    assert _decode(decode, prompts, kv_params) == colocated_tokens
    assert_pool_clean(decode)
    stats = decode.connector.stats
    # Every prompt but the 1-token one has KV to load: the blocks holding all its tokens but the last.
    expected_blocks = sum(-(-(len(ids) - 1) // 16) for ids in prompts.values())
    assert (stats.num_loads, stats.num_loaded_blocks, stats.num_failed_loads) == (len(prompts) - 1, expected_blocks, 0)
    handle = handles["r7"]
    assert stats.num_loaded_bytes == expected_blocks * handle.num_bytes // handle.num_blocks


def test_prefix_hits_on_the_decode_side_skip_transfers(local_ray, model, prompts, colocated_tokens):
    prefill, decode = _Engine(model, "kv_producer"), _Engine(model, "kv_consumer")
    long_prompt = {"r7": prompts["r7"]}  # 181 tokens: 11 full blocks and a partial one
    _decode(decode, long_prompt, _prefill(prefill, long_prompt))
    stats = decode.connector.stats
    assert (stats.num_loads, stats.num_loaded_blocks, stats.num_skipped_blocks) == (1, 12, 0)

    # The same prompt again: its 11 full blocks are in the decode side's prefix cache; only the partial one moves.
    assert _decode(decode, long_prompt, _prefill(prefill, long_prompt)) == {"r7": colocated_tokens["r7"]}
    assert (stats.num_loads, stats.num_loaded_blocks, stats.num_skipped_blocks) == (2, 13, 11)

    # A prompt sharing its first 160 tokens (10 blocks): only the 4 blocks past them move.
    extended = {"x": prompts["r7"][:160] + random_token_ids(random.Random(3), 60)}
    expected = _decode(_Engine(model, None), extended, {})
    assert _decode(decode, extended, _prefill(prefill, extended)) == expected
    assert (stats.num_loads, stats.num_loaded_blocks, stats.num_skipped_blocks) == (3, 17, 21)
    assert_pool_clean(prefill)
    assert_pool_clean(decode)


def test_a_lost_transfer_is_computed_locally(local_ray, model, prompts, colocated_tokens):
    """Blocks that cannot be fetched (here: references whose task failed, as a lost object's do) are
    computed on the decode side, in the same step."""
    import ray

    @ray.remote(num_cpus=0)
    def lost_block():
        raise RuntimeError("the prefill replica holding this block is gone")

    prefill, decode = _Engine(model, "kv_producer"), _Engine(model, "kv_consumer")
    kv_params = _prefill(prefill, prompts)
    for rid in ("r4", "r6"):
        handle = kv_params[rid]["remote_kv"]
        lost = dataclasses.replace(handle.data, refs=[lost_block.remote() for _ in handle.data.refs])
        kv_params[rid] = {"remote_kv": dataclasses.replace(handle, data=lost)}
    assert _decode(decode, prompts, kv_params) == colocated_tokens
    assert decode.connector.stats.num_failed_loads == 2
    assert_pool_clean(decode)


def test_an_aborted_decode_frees_its_loaded_blocks(local_ray, model, prompts):
    prefill, decode = _Engine(model, "kv_producer"), _Engine(model, "kv_consumer")
    kv_params = _prefill(prefill, prompts)
    engine = decode.llm_engine
    for rid, ids in prompts.items():
        engine.add_request(
            rid, token_prompt(ids), _greedy(MAX_TOKENS), RequestOptions(kv_transfer_params=kv_params[rid])
        )
    engine.step()  # admitted, KV loaded
    assert decode.connector.stats.num_loads > 0
    engine.abort_request(list(prompts))
    engine.step()
    assert_pool_clean(decode)


def test_ray_direct_moves_blocks_worker_to_worker_over_gloo(local_ray, model, prompts, colocated_tokens):
    """Both engines run Ray worker actors; the coordinator forms one gloo group over them and every
    block goes prefill worker -> decode worker through it (not through the object store)."""
    import ray

    from cluster.kv_transfer.ray_direct import COORDINATOR_NAME, COORDINATOR_NAMESPACE
    from cluster.kv_transfer.transports import DirectKVRef

    prefill, decode = _Engine(model, "kv_producer", "ray_direct"), _Engine(model, "kv_consumer", "ray_direct")
    kv_params = _prefill(prefill, prompts)
    assert all(isinstance(params["remote_kv"].data, DirectKVRef) for params in kv_params.values())
    assert _decode(decode, prompts, kv_params) == colocated_tokens
    coordinator = ray.get_actor(COORDINATOR_NAME, namespace=COORDINATOR_NAMESPACE)
    assert ray.get(coordinator.stats.remote()) == {
        "num_registered": 2,
        "group_size": 2,
        "num_transfers": {"direct": len(prompts) - 1, "object_store": 0},
    }
    stats = decode.connector.stats
    assert stats.num_loads == len(prompts) - 1 and stats.num_failed_loads == 0
    assert_pool_clean(prefill)
    assert_pool_clean(decode)
    # A handle pulled once is gone from the prefill worker: a second pull fails, and that decode computes it.
    again = {"r7": prompts["r7"]}
    fresh = _Engine(model, "kv_consumer", "ray_direct")
    assert _decode(fresh, again, {"r7": kv_params["r7"]}) == {"r7": colocated_tokens["r7"]}
    assert fresh.connector.stats.num_failed_loads == 1
    for engine in (prefill, decode, fresh):
        engine.llm_engine.shutdown()


def test_object_store_packs_small_blocks_and_fetches_only_the_objects_needed(local_ray):
    """64 KiB blocks go 16 to an object; loading blocks 20-39 never touches the object of blocks 0-15."""
    import ray
    import torch

    from cluster.kv_transfer.transports import ObjectStoreTransport

    @ray.remote(num_cpus=0)
    def lost_object():
        raise RuntimeError("this object must not be fetched")

    transport = ObjectStoreTransport(KVTransferConfig(kv_role="kv_both"), torch.device("cpu"))
    blocks = [torch.full((4, 2, 16, 4, 32), float(index)) for index in range(40)]  # 64 KiB each
    data = transport.save("req", blocks)
    assert data.starts == [0, 16, 32, 40] and len(data.refs) == 3
    data = dataclasses.replace(data, refs=[lost_object.remote(), *data.refs[1:]])
    loaded = transport.load("req", data, list(range(20, 40)))
    assert [int(block[0, 0, 0, 0, 0]) for block in loaded] == list(range(20, 40))
    with pytest.raises(Exception, match="must not be fetched"):
        transport.load("req", data, [3])


def test_cores_in_actors_pass_handles_by_ray_calls_and_leak_no_object(local_ray, model, prompts, colocated_tokens):
    """Serving's engines (``AsyncLLM``) run their cores in Ray actors (``cluster.core_actor``): each handle
    crosses by an actor call, never by the core's pipe, so once the responses are dropped the object
    store holds none of the blocks (a handle pickled through the pipe would pin its objects for good)."""
    import asyncio
    import gc
    import os

    from engine.async_llm import AsyncLLM

    def async_engine(role: str) -> AsyncLLM:
        args = EngineArgs(model=model, kv_transfer_config=KVTransferConfig(kv_role=role), **ENGINE_KWARGS)
        return AsyncLLM(args.create_engine_config(), num_cpus=1)

    async def final(llm: AsyncLLM, rid: str, ids: list[int], max_tokens: int, kv_params: dict):
        async for output in llm.generate(
            token_prompt(ids), _greedy(max_tokens), rid, RequestOptions(kv_transfer_params=kv_params)
        ):
            last = output
        return last

    async def disaggregated() -> dict[str, list[int]]:
        prefilled = await asyncio.gather(
            *(final(prefill, rid, ids, 1, {"do_remote_decode": True}) for rid, ids in prompts.items())
        )
        decoded = await asyncio.gather(
            *(
                final(decode, rid, prompts[rid], MAX_TOKENS, out.kv_transfer_params)
                for rid, out in zip(prompts, prefilled)
            )
        )
        return {output.request_id: output.outputs[0].token_ids for output in decoded}

    prefill, decode = async_engine("kv_producer"), async_engine("kv_consumer")
    try:
        assert {prefill.engine_core_pid, decode.engine_core_pid}.isdisjoint({None, os.getpid()})
        assert asyncio.run(disaggregated()) == colocated_tokens
        gc.collect()
        assert _objects_in_store(local_ray) == 0
    finally:
        prefill.shutdown()
        decode.shutdown()


def _objects_in_store(ray, timeout_s: float = 10.0) -> int:
    """How many objects the node's object store holds, once that number stops falling (frees are async)."""
    import re
    import time

    from ray._private.internal_api import memory_summary

    deadline = time.monotonic() + timeout_s
    while True:
        summary = memory_summary(ray.get_runtime_context().gcs_address, stats_only=True)
        count = int(re.search(r"(\d+) objects", summary).group(1))
        if count == 0 or time.monotonic() > deadline:
            return count
        time.sleep(0.5)
