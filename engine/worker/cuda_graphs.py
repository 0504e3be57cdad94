"""CUDA graphs for decode steps: captured once per batch size, replayed with the step padded.

A decode step of a small batch on a GPU is bound by kernel launches (an 8B model: hundreds of kernels
of a few microseconds each). Captured in a CUDA graph, the whole forward is one launch. A graph
replays fixed addresses and shapes, so the runner owns static input buffers of the largest captured
batch; a step of ``n`` requests copies its inputs into their first ``n`` rows and replays the graph
of the smallest captured size ``>= n``. The padded rows get slot -1 (their K/V are not written) and
sequence length 0 (their attention reads nothing and yields zeros), so they disturb no request.

Only decode-only steps (every request has one new token) of a single-rank model use graphs; mixed
steps, larger batches and ``enforce_eager`` run eagerly. With ``use_cuda_graphs=False`` the runner
does everything but the capture (the padded static-buffer forward, eagerly): tests use it on a CPU.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Mapping

import torch

from engine.attention.metadata import PAD_SLOT_ID, AttentionMetadata
from engine.config import EngineConfig
from engine.model.layers.cpu_prepack import NO_NATIVE_ROWS
from engine.worker.step_inputs import StepInputs

logger = logging.getLogger(__name__)

MAX_CAPTURED_BATCH = 512


def default_batch_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, then every 8, up to ``max_num_seqs`` (itself included) and at most 512, as vLLM does."""
    limit = min(max_num_seqs, MAX_CAPTURED_BATCH)
    sizes = [size for size in (1, 2, 4) if size <= limit] + list(range(8, limit + 1, 8))
    return sorted(set(sizes) | {limit})


def capture_decode_graphs(
    model, kv_caches: list[torch.Tensor], config: EngineConfig, max_num_blocks_per_req: int, device: torch.device
) -> DecodeGraphRunner | None:
    """A model runner's decode graphs, captured over its KV caches; None where graphs do not apply.

    They apply on CUDA, unless ``enforce_eager``, with an attention backend that supports them, and on
    one rank only: a stage boundary (PP) or a collective (TP) inside a graph is not supported yet.
    """
    if not (
        device.type == "cuda"
        and not config.model_config.enforce_eager
        and model.backend.supports_cuda_graphs
        and config.parallel_config.world_size == 1
    ):
        return None
    scheduler_config = config.scheduler_config
    sizes = config.model_config.cuda_graph_batch_sizes or default_batch_sizes(scheduler_config.max_num_seqs)
    graphs = DecodeGraphRunner(
        model, kv_caches, list(sizes), max_num_blocks_per_req, scheduler_config.max_model_len, device
    )
    graphs.capture()
    return graphs


class DecodeGraphRunner:
    """Runs decode-only forwards of up to ``max(batch_sizes)`` requests from captured graphs.

    ``model`` is called as ``model(input_ids, positions, kv_caches, attn_metadata)`` and returns the
    last hidden states ``[T, hidden]``; its attention backend must support CUDA graphs
    (``AttentionBackend.supports_cuda_graphs``). ``max_seq_len`` of the captured metadata is
    ``max_model_len``: whatever a backend plans from it must hold for every step. Each KV cache group of the
    model (``model.kv_cache_groups``) has its own slot mapping and block tables in the static buffers.
    """

    def __init__(
        self,
        model,
        kv_caches: list[torch.Tensor],
        batch_sizes: list[int],
        max_num_blocks_per_req: int,
        max_model_len: int,
        device: torch.device,
        use_cuda_graphs: bool = True,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.batch_sizes = sorted(set(batch_sizes))
        self.max_model_len = max_model_len
        self.use_cuda_graphs = use_cuda_graphs
        max_batch = self.batch_sizes[-1]
        self.input_ids = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_batch, dtype=torch.long, device=device)
        num_groups = len(model.kv_cache_groups)
        self.slot_mapping = torch.full((num_groups, max_batch), PAD_SLOT_ID, dtype=torch.long, device=device)
        self.seq_lens = torch.zeros(max_batch, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(num_groups, max_batch, max_num_blocks_per_req, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(max_batch + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}  # each graph's output buffer [size, hidden]

    @property
    def max_batch_size(self) -> int:
        return self.batch_sizes[-1]

    def fits(self, attn_metadata: AttentionMetadata) -> bool:
        """Whether the step is decode-only and small enough for a captured size."""
        return attn_metadata.max_query_len == 1 and 0 < attn_metadata.num_actual_tokens <= self.max_batch_size

    # A ``decode_step.DecodeStep``: the model runner's choice for decode steps on CUDA.
    logits_rows = NO_NATIVE_ROWS  # the LM head takes the product it would in an eager step

    def can_run(self, inputs: StepInputs, requests: Mapping) -> bool:
        return self.fits(inputs.attn_metadata)

    def run(self, inputs: StepInputs, kv_caches: list[torch.Tensor]) -> torch.Tensor:
        """A view of the graph's output (use before the next step); ``kv_caches`` are the captured ones."""
        return self.replay(inputs.input_ids, inputs.positions, inputs.attn_metadata)

    def padded_size(self, num_tokens: int) -> int:
        return self.batch_sizes[bisect.bisect_left(self.batch_sizes, num_tokens)]

    @torch.inference_mode()
    def capture(self) -> None:
        """Captures one graph per batch size, largest first, all in one memory pool (with ``use_cuda_graphs``)."""
        if not self.use_cuda_graphs:
            return
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.batch_sizes):
            self._forward(size)  # compiles the kernels and settles the allocator before capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self._forward(size)
            self.graphs[size] = graph
        torch.cuda.synchronize()
        logger.info("Captured CUDA graphs for decode batch sizes %s", self.batch_sizes)

    def replay(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: AttentionMetadata
    ) -> torch.Tensor:
        """The step's last hidden states [n, hidden] (a view of the graph's output: use before the next step)."""
        n = attn_metadata.num_actual_tokens
        size = self.padded_size(n)
        self.input_ids[:n].copy_(input_ids[:n])
        self.positions[:n].copy_(positions[:n])
        self.seq_lens[:n].copy_(attn_metadata.seq_lens[:n])
        self.seq_lens[n:size].zero_()
        for g in range(self.slot_mapping.shape[0]):
            group = attn_metadata.for_group(g)
            self.slot_mapping[g, :n].copy_(group.slot_mapping[:n])
            self.slot_mapping[g, n:size].fill_(PAD_SLOT_ID)
            # Columns past the step's width keep older entries: never read, a row reads only its seq_len's blocks.
            width = group.block_tables.shape[1]
            self.block_tables[g, :n, :width].copy_(group.block_tables[:n])
        if self.use_cuda_graphs:
            self.graphs[size].replay()
            return self.outputs[size][:n]
        return self._forward(size)[:n]

    def _forward(self, size: int) -> torch.Tensor:
        return self.model(self.input_ids[:size], self.positions[:size], self.kv_caches, self._metadata(size))

    def _metadata(self, size: int) -> AttentionMetadata:
        """Metadata over the first ``size`` rows of the static buffers (what a graph of that size reads)."""
        metadata, *views = [
            AttentionMetadata(
                num_actual_tokens=size,
                query_start_loc=self.query_start_loc[: size + 1],
                seq_lens=self.seq_lens[:size],
                block_tables=self.block_tables[g, :size],
                slot_mapping=self.slot_mapping[g, :size],
                max_query_len=1,
                max_seq_len=self.max_model_len,
                query_lens_cpu=[1] * size,
                seq_lens_cpu=[self.max_model_len] * size,
                num_decodes=size,
            )
            for g in range(self.slot_mapping.shape[0])
        ]
        metadata.group_views = tuple(views)
        return metadata
