"""The worker side of the KV connector: copies blocks between the paged cache and a transport.

The model runner calls ``start_load_kv`` before a step's forward (the loaded
blocks must be in place before attention reads them) and ``save_kv`` after it
(the prompt's KV has just been written). Loads that fail are not raised:
``start_load_kv`` computes those tokens itself, one extra forward each in the
same step, so a lost prefill costs time, never a wrong token or a dead engine.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch

from engine.config import KVTransferConfig
from engine.kv_transfer.transport import get_transport_class
from engine.sched.kv_transfer import KVConnectorMetadata, KVHandle, KVLoad, KVTransferOutput

if TYPE_CHECKING:
    from engine.worker.input_batch import InputBatch

logger = logging.getLogger(__name__)


def gather_blocks(kv_caches: list[torch.Tensor], block_ids: list[int]) -> list[torch.Tensor]:
    """Copies of the given blocks, one ``[num_layers, 2, block_size, H, D]`` tensor each."""
    index = torch.tensor(block_ids, dtype=torch.long, device=kv_caches[0].device)
    # Each cache is [2, num_blocks, block_size, H, D]: stack the layers, then put the block dim first.
    stacked = torch.stack([cache.index_select(1, index) for cache in kv_caches])  # [L, 2, n, B, H, D]
    per_block = stacked.permute(2, 0, 1, 3, 4, 5).contiguous()  # [n, L, 2, B, H, D]
    return [block.clone() for block in per_block]  # own storage each: a view would ship the whole batch


def scatter_blocks(kv_caches: list[torch.Tensor], block_ids: list[int], blocks: list[torch.Tensor]) -> None:
    """Writes ``blocks`` (as ``gather_blocks`` returns them) into the cache blocks ``block_ids``."""
    device = kv_caches[0].device
    index = torch.tensor(block_ids, dtype=torch.long, device=device)
    stacked = torch.stack([block.to(device, non_blocking=True) for block in blocks])  # [n, L, 2, B, H, D]
    for layer, cache in enumerate(kv_caches):
        cache.index_copy_(1, index, stacked[:, layer].transpose(0, 1).to(cache.dtype))  # [2, n, B, H, D]


class KVConnectorWorker:
    def __init__(self, config: KVTransferConfig, block_size: int, device: torch.device) -> None:
        self.block_size = block_size
        self.transport = get_transport_class(config)(config, device)

    def start_load_kv(
        self,
        metadata: KVConnectorMetadata,
        kv_caches: list[torch.Tensor],
        output: KVTransferOutput,
        input_batch: InputBatch,
        model: torch.nn.Module,
    ) -> None:
        """Loads every planned block into the cache; computes the KV of each load that failed instead.

        Call after ``input_batch.apply_deltas`` and before the step's forward. The
        failed loads are named in ``output.failed_load_req_ids``; either way, on return
        every planned block holds its KV and ``input_batch`` has not changed.
        """
        for load in self._load_blocks(metadata, kv_caches, output):
            self._compute_failed_load(load, kv_caches, input_batch, model)

    def _load_blocks(
        self, metadata: KVConnectorMetadata, kv_caches: list[torch.Tensor], output: KVTransferOutput
    ) -> list[KVLoad]:
        """Loads every planned block into the cache; returns the loads that failed (nothing written)."""
        failed = []
        for load in metadata.loads:
            start = time.perf_counter()
            try:
                blocks = self.transport.load(load.req_id, load.handle.data, load.src_block_indices)
                scatter_blocks(kv_caches, load.dst_block_ids, blocks)
            except Exception as error:  # noqa: BLE001 - any transport failure: compute the KV here instead
                logger.warning("Loading the KV of %s failed (%r); computing it locally.", load.req_id, error)
                failed.append(load)
                output.failed_load_req_ids.append(load.req_id)
                continue
            output.load_latencies_s.append(time.perf_counter() - start)
            output.num_loaded_bytes += sum(block.numel() * block.element_size() for block in blocks)
        return failed

    def _compute_failed_load(
        self, load: KVLoad, kv_caches: list[torch.Tensor], input_batch: InputBatch, model: torch.nn.Module
    ) -> None:
        """Computes the KV a failed load should have brought: one forward over those tokens alone."""
        end = input_batch.requests[load.req_id].num_computed_tokens  # local hits + the external tokens
        start = load.src_block_indices[0] * self.block_size  # the local hits
        inputs = input_batch.prepare_inputs({load.req_id: end - start}, starts={load.req_id: start})
        model(inputs.input_ids, inputs.positions, kv_caches, inputs.attn_metadata, None)

    def save_kv(self, metadata: KVConnectorMetadata, kv_caches: list[torch.Tensor], output: KVTransferOutput) -> None:
        """Publishes each finished prompt's blocks; their handles go back to the scheduler."""
        for save in metadata.saves:
            blocks = gather_blocks(kv_caches, save.block_ids)
            num_bytes = sum(block.numel() * block.element_size() for block in blocks)
            data = self.transport.save(save.req_id, blocks)
            output.saved[save.req_id] = KVHandle(
                data=data,
                num_tokens=save.num_tokens,
                num_blocks=len(blocks),
                block_size=self.block_size,
                num_bytes=num_bytes,
            )
