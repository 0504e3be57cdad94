"""The profiling forward: the largest step the scheduler can send, run once before the KV cache exists.

On a GPU its activation peak tells the worker how much memory is left for KV
blocks (``Worker.determine_num_available_blocks``). A CPU worker runs none: its
budget is a share of RAM, and the activations of a forward of the whole budget,
freed, stay in the process's heap (its resident memory) for good.
"""

from __future__ import annotations

import torch

from engine.attention.metadata import build_attention_metadata
from engine.config import SchedulerConfig
from engine.distributed.parallel_state import ParallelState


@torch.inference_mode()
def profile_forward(
    model: torch.nn.Module,
    scheduler_config: SchedulerConfig,
    parallel_state: ParallelState,
    block_size: int,
    hidden_size: int,
    dtype: torch.dtype,
    device: torch.device,
) -> None:
    """One forward of a full step's token budget through this rank's part of ``model``.

    The budget is split into prompts of at most ``max_model_len - 1`` tokens (at most
    ``max_num_seqs`` of them), and logits are computed for ``max_num_seqs`` rows, as the
    largest decode step does. With tp_size > 1 a collective: every rank of the stage must
    call it at once. Stages do not talk to each other here (a later stage runs on zeros).
    """
    lengths = split_budget(
        scheduler_config.max_num_batched_tokens, scheduler_config.max_model_len - 1, scheduler_config.max_num_seqs
    )
    num_tokens = sum(lengths)
    tables, next_block = [], 1  # per KV cache group, each request's own blocks
    for _ in model.kv_cache_groups:
        tables.append([])
        for length in lengths:
            num_blocks = -(-length // block_size)
            tables[-1].append(list(range(next_block, next_block + num_blocks)))
            next_block += num_blocks
    kv_caches = model.make_kv_caches(next_block, block_size)
    metadata, *views = [build_attention_metadata(lengths, lengths, t, block_size, device=device) for t in tables]
    metadata.group_views = tuple(views)
    input_ids = torch.zeros(num_tokens, dtype=torch.long, device=device)
    positions = torch.cat([torch.arange(length) for length in lengths]).to(device)
    intermediate = None
    if not parallel_state.is_first_stage:
        zeros = torch.zeros(num_tokens, hidden_size, dtype=dtype, device=device)
        intermediate = (zeros, zeros.clone())
    hidden = model(input_ids, positions, kv_caches, metadata, intermediate)
    if parallel_state.is_last_stage:
        num_rows = min(scheduler_config.max_num_seqs, num_tokens)
        model.compute_logits(hidden[:1].expand(num_rows, -1))
    del kv_caches, hidden


def split_budget(num_tokens: int, max_prompt_len: int, max_num_prompts: int) -> list[int]:
    """Prompt lengths that fill ``num_tokens``: each at most ``max_prompt_len``, at most ``max_num_prompts``."""
    lengths = []
    while num_tokens > 0 and len(lengths) < max_num_prompts:
        lengths.append(min(num_tokens, max_prompt_len))
        num_tokens -= lengths[-1]
    return lengths
