"""The worker's persistent batch without a model: deltas, flattening, the one place num_computed_tokens moves,
and a failed KV load computed by ``KVConnectorWorker`` over exactly the tokens the load should have brought."""

from __future__ import annotations

import torch

from engine.config import KVTransferConfig
from engine.kv_transfer import worker as kv_transfer_worker
from engine.sampling_params import SamplingParams
from engine.sched.kv_transfer import KVConnectorMetadata, KVHandle, KVLoad, KVTransferOutput
from engine.sched.step_outputs import CachedRequestData, NewRequestData, SchedulerOutput
from engine.worker.input_batch import InputBatch

BLOCK_SIZE = 4


def _new_request_step(
    req_id: str, prompt: list[int], block_ids: list[int], num_computed: int, num_scheduled: int
) -> SchedulerOutput:
    new = NewRequestData(req_id, prompt, [], SamplingParams(temperature=0.0), (block_ids,), num_computed)
    return SchedulerOutput([new], CachedRequestData(), {req_id: num_scheduled}, num_scheduled, set(), set())


def _batch() -> InputBatch:
    return InputBatch(max_num_reqs=4, max_num_blocks_per_req=8, block_size=BLOCK_SIZE, device=torch.device("cpu"))


def test_flattening_changes_nothing_and_advance_moves_num_computed_tokens():
    batch = _batch()
    prompt = list(range(10, 20))
    batch.apply_deltas(_new_request_step("a", prompt, [3, 5, 7], num_computed=4, num_scheduled=6))
    first = batch.prepare_inputs({"a": 6})
    second = batch.prepare_inputs({"a": 6})
    assert batch.requests["a"].num_computed_tokens == 4  # flattening twice left the state alone
    for inputs in (first, second):
        assert inputs.input_ids.tolist() == prompt[4:]
        assert inputs.positions.tolist() == list(range(4, 10))
        # positions 4..7 are in block 5, 8..9 in block 7
        assert inputs.attn_metadata.slot_mapping.tolist() == [20, 21, 22, 23, 28, 29]
        assert inputs.sampled_req_ids == ["a"] and inputs.sample_indices.tolist() == [5]
    batch.advance(first)
    assert batch.requests["a"].num_computed_tokens == 10
    span = batch.prepare_inputs({"a": 4}, starts={"a": 0})  # an explicit start, as a failed load's recompute
    assert span.positions.tolist() == [0, 1, 2, 3] and span.sampled_req_ids == []
    assert span.attn_metadata.slot_mapping.tolist() == [12, 13, 14, 15]


def test_deltas_write_tokens_and_blocks_and_finished_requests_free_their_slot():
    batch = _batch()
    batch.apply_deltas(_new_request_step("a", [1, 2, 3], [2], num_computed=0, num_scheduled=3))
    batch.advance(batch.prepare_inputs({"a": 3}))
    batch.append_sampled_tokens(["a"], [9])
    cached = CachedRequestData(["a"], [[9]], [([6],)], [3])
    batch.apply_deltas(SchedulerOutput([], cached, {"a": 1}, 1, set(), set()))
    assert batch.requests["a"].token_ids == [1, 2, 3, 9]
    assert batch.block_table.table[0, batch.requests["a"].slot, :2].tolist() == [2, 6]  # group 0
    slot = batch.requests["a"].slot
    batch.apply_deltas(SchedulerOutput([], CachedRequestData(), {}, 0, set(), {"a"}))
    assert "a" not in batch.requests
    batch.apply_deltas(_new_request_step("b", [4, 5], [8], num_computed=0, num_scheduled=2))
    assert batch.requests["b"].slot == slot  # the freed slot is the next one taken


class _LostTransport:
    def __init__(self, config, device) -> None:
        pass

    def load(self, req_id, data, block_indices):
        raise ConnectionError("the prefill worker is gone")


class _RecordingModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.calls = []

    def forward(self, input_ids, positions, kv_caches, attn_metadata, intermediate):
        self.calls.append((input_ids.tolist(), positions.tolist(), attn_metadata.slot_mapping.tolist()))


def test_a_failed_load_is_computed_over_the_external_tokens_only(monkeypatch):
    monkeypatch.setattr(kv_transfer_worker, "get_transport_class", lambda config: _LostTransport)
    connector = kv_transfer_worker.KVConnectorWorker(
        KVTransferConfig(kv_role="kv_consumer"), BLOCK_SIZE, torch.device("cpu")
    )
    batch = _batch()
    prompt = list(range(100, 111))  # 11 tokens: 4 local hits (block 3), 6 loaded (blocks 5, 7), the last computed
    batch.apply_deltas(_new_request_step("a", prompt, [3, 5, 7], num_computed=10, num_scheduled=1))
    handle = KVHandle(data=None, num_tokens=11, num_blocks=3, block_size=BLOCK_SIZE, num_bytes=0)
    metadata = KVConnectorMetadata(loads=[KVLoad("a", handle, [1, 2], [5, 7])])
    output, model = KVTransferOutput(), _RecordingModel()
    connector.start_load_kv(metadata, [], output, batch, model)
    assert output.failed_load_req_ids == ["a"]
    assert model.calls == [(prompt[4:10], list(range(4, 10)), [20, 21, 22, 23, 28, 29])]
    assert batch.requests["a"].num_computed_tokens == 10  # the step's own tokens still start there
