"""Multi-LoRA under tensor parallelism on CPU (gloo, spawned processes, no Ray): adapters sharded like their
base layers give the single device's greedy tokens, logprobs within 1e-4, for a batch mixing the base model
and more adapters than ``max_loras``. The harness of tests/engine/worker/test_distributed_worker.py, with LoRA
requests."""

from __future__ import annotations

import multiprocessing
import traceback
from collections import defaultdict

import pytest
import torch
import torch.distributed as dist

from engine.config import (
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from engine.lora_request import LoRARequest
from engine.sampling_params import SamplingParams
from engine.sched.request import Request
from engine.sched.scheduler import Scheduler
from serval.tools.make_adapter import make_lora_adapter
from tests.engine.worker.test_distributed_worker import free_port

NUM_BLOCKS = 64
GREEDY = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=6, logprobs=1)
LORAS = [None, 1, 2, 3, 1, None]  # adapter id per prompt: three adapters over two slots


def _config(path: str, tp_size: int) -> EngineConfig:
    return EngineConfig(
        model_config=ModelConfig(model=path, dtype="float32"),
        cache_config=CacheConfig(block_size=4, num_blocks=NUM_BLOCKS, kv_cache_memory_bytes=1 << 20),
        scheduler_config=SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=8, max_model_len=64),
        parallel_config=ParallelConfig(tensor_parallel_size=tp_size),
        device_config=DeviceConfig(device="cpu", num_threads=1),
        lora_config=LoRAConfig(enable_lora=True, max_loras=2, max_lora_rank=8),
    )


def _generate(path: str, adapters: list[str], tp_size: int, rank: int, init_method: str | None) -> dict:
    from engine.worker.worker import Worker

    config = _config(path, tp_size)
    worker = Worker(config, rank=rank, distributed_init_method=init_method)
    worker.init_device()
    worker.load_model()
    worker.initialize_cache(NUM_BLOCKS)
    scheduler = Scheduler(config.scheduler_config, config.cache_config, max_loras=2)
    for index, lora_id in enumerate(LORAS):
        lora = None if lora_id is None else LoRARequest(f"l{lora_id}", lora_id, adapters[lora_id - 1])
        prompt = [5 + (index * 37 + k * 11) % 500 for k in range(7 + index)]
        scheduler.add_request(Request(f"r{index}", prompt, GREEDY, eos_token_id=None, lora_request=lora))
    tokens, logprobs = defaultdict(list), defaultdict(list)
    while scheduler.has_unfinished_requests():
        scheduler_output = scheduler.schedule()
        output = worker.execute_model(scheduler_output)
        if tp_size > 1:
            shared = [output]
            dist.broadcast_object_list(shared, src=0)
            output = shared[0]
        for core_output in scheduler.update_from_output(scheduler_output, output):
            tokens[core_output.request_id].extend(core_output.new_token_ids)
            logprobs[core_output.request_id].extend(core_output.new_logprobs.logprobs)
    swaps = worker.model_runner.lora.num_slot_swaps
    worker.shutdown()
    return {"tokens": dict(tokens), "logprobs": dict(logprobs), "swaps": swaps}


def _run_rank(rank, path, adapters, init_method, results) -> None:
    torch.set_num_threads(1)
    try:
        results.put((rank, _generate(path, adapters, 2, rank, init_method), None))
    except BaseException:
        results.put((rank, None, traceback.format_exc()))


@pytest.mark.slow  # two spawned worker processes (gloo) plus a one-device run: ~35 s at load
def test_tp2_equals_one_device_with_adapters(tiny_checkpoint, tmp_path):
    path = tiny_checkpoint("llama")
    adapters = [
        str(make_lora_adapter(tmp_path / "a", path, rank=4, seed=1)),
        str(make_lora_adapter(tmp_path / "b", path, rank=8, use_rslora=True, seed=2)),
        str(make_lora_adapter(tmp_path / "c", path, rank=2, targets=("k", "o", "up"), seed=3)),
    ]
    expected = _generate(path, adapters, 1, 0, None)
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    init_method = f"tcp://127.0.0.1:{free_port()}"
    processes = [context.Process(target=_run_rank, args=(r, path, adapters, init_method, results)) for r in (0, 1)]
    for process in processes:
        process.start()
    try:
        outcomes = dict((rank, (outcome, error)) for rank, outcome, error in (results.get(timeout=180) for _ in (0, 1)))
    finally:
        for process in processes:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
    assert all(error is None for _, error in outcomes.values()), [e for _, e in outcomes.values()]
    got = outcomes[0][0]
    assert got["tokens"] == expected["tokens"] and expected["swaps"] > 0
    for req_id, rows in expected["logprobs"].items():
        for got_row, want_row in zip(got["logprobs"][req_id], rows):
            assert max(abs(g - w) for g, w in zip(got_row, want_row)) < 1e-4, req_id
