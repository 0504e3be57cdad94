"""LoRA adapters load off the step's path (``engine.lora.loading``): the engine core holds an adapter's first
requests while its worker reads the adapter on a thread of its own, and every other request keeps stepping.

The loading is held up for real: the adapter's ``adapter_config.json`` is a named pipe, so the worker's
read blocks until the test writes the config into it. The core is driven directly (requests built as the
front end builds them), one step at a time.
"""

from __future__ import annotations

import os
import shutil
import threading

import pytest

from engine.core.engine_core import EngineCore
from engine.engine_args import EngineArgs
from engine.lora_request import LoRARequest
from engine.sampling_params import SamplingParams
from engine.sched.request import Request
from serval.tools.make_adapter import make_lora_adapter
from tests.conftest import engine_kwargs

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPT = [11, 12, 13, 14, 15, 16, 17]


@pytest.fixture(scope="module")
def core(tiny_checkpoint):
    args = EngineArgs(
        model=tiny_checkpoint("llama"),
        **engine_kwargs(enable_lora=True, max_loras=2, max_lora_rank=8, max_cpu_loras=4, block_size=4),
    )
    core = EngineCore(args.create_engine_config())
    yield core
    core.shutdown()


def _request(request_id: str, lora: LoRARequest | None) -> Request:
    return Request(request_id, list(PROMPT), GREEDY.clone(), eos_token_id=None, lora_request=lora)


def _run(core: EngineCore, requests: list[Request], until=None) -> dict[str, list[int]]:
    """Steps (checking the KV cache each step) until ``until()`` holds, or every request has finished; the
    tokens each request got."""
    for request in requests:
        core.add_request(request)
    tokens: dict[str, list[int]] = {request.request_id: [] for request in requests}
    while core.has_unfinished_requests() and not (until and until()):
        for output in core.step():
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
        core.check_integrity()
    return tokens


def test_a_request_waits_for_its_adapter_while_the_others_step(core, tiny_checkpoint, tmp_path):
    base = tiny_checkpoint("llama")
    reference_path = make_lora_adapter(tmp_path / "reference", base, rank=4, seed=5)
    slow_path = tmp_path / "slow"
    shutil.copytree(reference_path, slow_path)
    config_text = (slow_path / "adapter_config.json").read_text()
    (slow_path / "adapter_config.json").unlink()
    os.mkfifo(slow_path / "adapter_config.json")  # the worker's read of the config blocks until it is written
    manager = core.executor.worker.model_runner.lora
    step_loads_before = manager.num_step_loads

    def release() -> None:  # opening the write end unblocks the loading thread, whatever the test's outcome
        with open(slow_path / "adapter_config.json", "w", encoding="utf-8") as pipe:
            pipe.write(config_text)

    # Had a step read the adapter itself, it would block on the pipe: a timer lets it go, and the test fails.
    safety_net = threading.Timer(30, release)
    safety_net.start()
    try:
        plain, slow = _request("plain", None), _request("slow", LoRARequest("slow", 7, str(slow_path)))
        first = _run(core, [plain, slow], until=lambda: plain.is_finished)
        assert len(first["plain"]) == GREEDY.max_tokens and first["slow"] == []
        assert core.lora_loading.num_waiting_requests() == 1 and core.get_stats().num_waiting_reqs == 1
        assert slow.num_computed_tokens == 0  # held before the scheduler: no KV taken
    finally:
        safety_net.cancel()
        writer = threading.Thread(target=release, daemon=True)
        writer.start()
    slow_tokens = _run(core, [])["slow"]  # the adapter is in: the held request runs
    writer.join(timeout=30)
    # The same adapter read from a plain file gives the same tokens, and no step ever read an adapter itself.
    expected = _run(core, [_request("reference", LoRARequest("reference", 8, str(reference_path)))])["reference"]
    assert len(expected) == GREEDY.max_tokens and slow_tokens == expected
    assert manager.num_step_loads == step_loads_before


def test_an_adapter_that_fails_to_load_ends_its_requests_and_nothing_else(core, tmp_path):
    missing = LoRARequest("gone", 9, str(tmp_path / "gone"))
    requests = [_request("gone-1", missing), _request("base", None), _request("gone-2", missing)]
    for request in requests:
        core.add_request(request)
    outputs = {}
    while core.has_unfinished_requests():
        for output in core.step():
            outputs.setdefault(output.request_id, []).append(output)
        core.check_integrity()
    for request_id in ("gone-1", "gone-2"):
        (output,) = outputs[request_id]
        assert output.finish_reason == "error" and "'gone' failed to load" in output.stop_reason
        assert "no adapter_config.json" in output.stop_reason
    assert sum(len(o.new_token_ids) for o in outputs["base"]) == GREEDY.max_tokens
    assert core.kv_block_counts()[1] == core.kv_block_counts()[0]  # every block free again
