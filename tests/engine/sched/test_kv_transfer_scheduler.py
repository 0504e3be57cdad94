"""The scheduler side of KV transfer, driven by hand-made runner outputs, no model and no transport."""

import pytest

from engine.config import CacheConfig, KVTransferConfig, SchedulerConfig
from engine.sampling_params import SamplingParams
from engine.sched.kv_cache_groups import KVCacheGroup
from engine.sched.kv_transfer import KVHandle, KVTransferOutput
from engine.sched.request import Request
from engine.sched.scheduler import Scheduler
from engine.sched.step_outputs import ModelRunnerOutput

EOS = 2
BLOCK = 16


def make_scheduler(role: str, budget: int = 512, num_blocks: int = 64) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=8, max_model_len=256),
        CacheConfig(block_size=BLOCK, num_blocks=num_blocks),
        KVTransferConfig(kv_role=role),
    )


def make_request(
    request_id: str, num_tokens: int, kv_transfer_params=None, first_token: int = 100, **params
) -> Request:
    return Request(
        request_id,
        list(range(first_token, first_token + num_tokens)),
        SamplingParams(**params),
        EOS,
        kv_transfer_params=kv_transfer_params,
    )


def handle_for(num_tokens: int, block_size: int = BLOCK) -> KVHandle:
    num_blocks = -(-num_tokens // block_size)
    return KVHandle(
        data=f"blocks-of-{num_tokens}",
        num_tokens=num_tokens,
        num_blocks=num_blocks,
        block_size=block_size,
        num_bytes=num_blocks * 100,
    )


def step(scheduler: Scheduler, kv_output: KVTransferOutput | None = None, token: int = 7):
    output = scheduler.schedule()
    req_ids = list(output.num_scheduled_tokens)
    sampled = [
        [token] if scheduler.requests[r].num_computed_tokens == scheduler.requests[r].num_tokens else []
        for r in req_ids
    ]
    results = scheduler.update_from_output(output, ModelRunnerOutput(req_ids, sampled, kv_transfer_output=kv_output))
    scheduler.kv_cache_manager.check_integrity()
    return output, {result.request_id: result for result in results}


def test_the_decode_side_loads_all_but_the_last_prompt_token_and_computes_that_one():
    scheduler = make_scheduler("kv_consumer")
    scheduler.add_request(make_request("a", 40, {"remote_kv": handle_for(40)}, max_tokens=3))
    output, results = step(scheduler)
    assert output.num_scheduled_tokens == {"a": 1}  # tokens 0..38 are loaded, token 39 computed
    assert output.scheduled_new_reqs[0].num_computed_tokens == 39
    (load,) = output.kv_connector_metadata.loads
    assert load.src_block_indices == [0, 1, 2]
    assert load.dst_block_ids == output.scheduled_new_reqs[0].block_ids[0][:3]
    assert results["a"].new_token_ids == [7]  # the first token is sampled here, not taken from the prefill
    step(scheduler)
    _, results = step(scheduler)
    assert results["a"].finish_reason == "length" and results["a"].kv_transfer_params is None
    assert scheduler.kv_cache_manager.block_pool.num_free_blocks == 63


def test_blocks_in_the_local_prefix_cache_are_not_loaded():
    scheduler = make_scheduler("kv_consumer")
    scheduler.add_request(make_request("first", 40, max_tokens=1))
    step(scheduler)  # computed locally: blocks 0 and 1 (32 tokens) are now cached
    scheduler.add_request(make_request("second", 60, {"remote_kv": handle_for(60)}, max_tokens=1))
    output, _ = step(scheduler)
    (load,) = output.kv_connector_metadata.loads
    assert load.src_block_indices == [2, 3]  # tokens 32..58; token 59 is computed
    assert output.num_scheduled_tokens == {"second": 1}
    stats = scheduler.kv_connector.stats
    assert (stats.num_loads, stats.num_loaded_blocks, stats.num_skipped_blocks) == (1, 2, 2)


def test_requests_without_a_usable_handle_are_computed_locally():
    scheduler = make_scheduler("kv_consumer")
    scheduler.add_request(make_request("other-block-size", 40, {"remote_kv": handle_for(40, block_size=8)}))
    scheduler.add_request(
        make_request("logprobs", 40, {"remote_kv": handle_for(40)}, first_token=900, prompt_logprobs=1)
    )
    output, _ = step(scheduler)
    assert output.num_scheduled_tokens == {"other-block-size": 40, "logprobs": 40}
    assert not output.kv_connector_metadata


def test_a_preempted_request_recomputes_instead_of_loading_again():
    scheduler = make_scheduler("kv_consumer", num_blocks=17)  # 16 usable blocks: 256 tokens
    scheduler.add_request(make_request("a", 100, {"remote_kv": handle_for(100)}, max_tokens=200, ignore_eos=True))
    output, _ = step(scheduler)
    assert len(output.kv_connector_metadata.loads) == 1
    scheduler.add_request(make_request("b", 120, first_token=5000, max_tokens=200, ignore_eos=True))
    loads = []
    for _ in range(40):
        output, _ = step(scheduler)
        loads += output.kv_connector_metadata.loads
    assert scheduler.num_preemptions > 0 and loads == []
    assert scheduler.kv_connector.stats.num_loads == 1


def test_the_prefill_side_saves_when_the_prompt_completes_and_returns_the_handle():
    scheduler = make_scheduler("kv_producer", budget=32)  # a 70-token prompt takes three chunked steps
    scheduler.add_request(make_request("p", 70, {"do_remote_decode": True}, max_tokens=1))
    output, _ = step(scheduler)
    assert not output.kv_connector_metadata.saves
    output, _ = step(scheduler)
    assert not output.kv_connector_metadata.saves
    output = scheduler.schedule()
    (save,) = output.kv_connector_metadata.saves
    assert save.num_tokens == 70
    assert save.block_ids == scheduler.kv_cache_manager.get_block_ids("p")[0] and len(save.block_ids) == 5
    handle = handle_for(70)
    results = scheduler.update_from_output(
        output, ModelRunnerOutput(["p"], [[7]], kv_transfer_output=KVTransferOutput(saved={"p": handle}))
    )
    assert results[0].finish_reason == "length" and results[0].kv_transfer_params == {"remote_kv": handle}
    assert scheduler.kv_cache_manager.block_pool.num_free_blocks == 63  # freed at once: the KV was copied out
    assert scheduler.kv_connector.stats.num_saved_bytes == handle.num_bytes


def test_an_aborted_prefill_saves_nothing_and_frees_its_blocks():
    scheduler = make_scheduler("kv_producer", budget=32)
    scheduler.add_request(make_request("p", 70, {"do_remote_decode": True}, max_tokens=1))
    step(scheduler)
    scheduler.abort_requests(["p"])
    output, _ = step(scheduler)
    assert not output.kv_connector_metadata and not scheduler.kv_connector._pending_saves
    assert scheduler.kv_cache_manager.block_pool.num_free_blocks == 63


def test_a_handle_saved_for_a_request_aborted_during_the_step_is_dropped():
    scheduler = make_scheduler("kv_producer")
    scheduler.add_request(make_request("p", 40, {"do_remote_decode": True}, max_tokens=1))
    output = scheduler.schedule()
    assert output.kv_connector_metadata.saves
    scheduler.abort_requests(["p"])  # while the step runs
    results = scheduler.update_from_output(
        output, ModelRunnerOutput(["p"], [[7]], kv_transfer_output=KVTransferOutput(saved={"p": handle_for(40)}))
    )
    assert results == [] and not scheduler.kv_connector._handles


def test_a_sliding_window_model_is_refused():
    """KV transfer moves one block table of full attention; a model of sliding groups has more to move."""
    groups = (KVCacheGroup(None, (0,)), KVCacheGroup(16, (1,)))
    with pytest.raises(ValueError, match="not a sliding-window model's"):
        Scheduler(
            SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=8, max_model_len=256),
            CacheConfig(block_size=BLOCK, num_blocks=64),
            KVTransferConfig(kv_role="kv_consumer"),
            kv_cache_groups=groups,
        )
