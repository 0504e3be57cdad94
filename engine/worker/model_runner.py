"""The model runner: turns a SchedulerOutput into tensors, runs the model, samples.

It is the only place that builds tensors from the scheduler's plain data.
Per step: drop finished/preempted requests, apply the deltas, flatten every
scheduled token into one batch, run one forward over the mixed batch of
prefill chunks and decodes, and sample one token for each request whose
prompt is fully computed.

With tensor/pipeline parallelism every rank runs this same code on the same
``SchedulerOutput`` and keeps the same per-request state; only the forward is
split. A pipeline stage after the first receives the previous stage's
(hidden, residual) instead of embedding tokens; a stage before the last sends
its own on and stops there. The last stage computes logits on every TP rank
(a collective), and only the output rank (last stage, TP rank 0) samples and
returns a ``ModelRunnerOutput``. The other ranks learn the sampled tokens from
the next step's deltas (``CachedRequestData.new_token_ids``), or, for a request
resumed after preemption, from ``NewRequestData.output_token_ids``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.attention.backend import resolve_backend_name
from engine.attention.metadata import AttentionMetadata, build_attention_metadata
from engine.config import EngineConfig
from engine.core.kv_connector import KVLoad, KVTransferOutput
from engine.core.outputs import LogprobsLists, ModelRunnerOutput, SchedulerOutput
from engine.distributed.parallel_state import get_parallel_state, recv_from_prev_stage, send_to_next_stage
from engine.kv_transfer import KVConnectorWorker
from engine.model import get_model
from engine.model.layers.cpu_prepack import prepack_linears
from engine.sample import Sampler, SamplingMetadata, make_generator
from engine.sample.logprobs import compute_prompt_logprobs
from engine.worker.cuda_graphs import DecodeGraphRunner, default_batch_sizes
from engine.worker.request_state import BlockTable, CachedRequestState


@dataclass
class StepInputs:
    """One step's flattened batch; rows of ``sample_indices`` are where logits are read."""

    req_ids: list[str]
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    attn_metadata: AttentionMetadata
    sampled_req_ids: list[str]  # requests that get a token this step, in logits-row order
    sample_indices: torch.Tensor  # [num_sampled] index of each one's last token in the batch
    token_offsets: list[int]  # where each request's tokens start in the batch (len num_reqs + 1)


class ModelRunner:
    def __init__(self, config: EngineConfig, device: torch.device, dtype: torch.dtype) -> None:
        self.config = config
        self.device = device
        self.dtype = dtype
        # This rank's place in the TP/PP groups, read again in load_model (after init_distributed).
        self.parallel_state = get_parallel_state()
        self.block_size = config.cache_config.block_size
        scheduler_config = config.scheduler_config
        self.max_num_blocks_per_req = -(-scheduler_config.max_model_len // self.block_size)
        self.block_table = BlockTable(scheduler_config.max_num_seqs, self.max_num_blocks_per_req)
        self.requests: dict[str, CachedRequestState] = {}
        # Generators of preempted requests survive until the request finishes, so a seeded
        # request draws the same tokens whether or not it was preempted.
        self._parked_generators: dict[str, torch.Generator] = {}
        # Prompt positions whose logprobs went out, per request; kept across a preemption (the
        # recompute would otherwise send them again) and dropped when the request finishes.
        self._num_prompt_logprobs_sent: dict[str, int] = {}
        self.sampler = Sampler()
        self.model = None
        self.kv_caches: list[torch.Tensor] = []
        self.decode_graphs: DecodeGraphRunner | None = None  # CUDA only, set up with the caches
        self._tokenizer = None
        # Disaggregated prefill: loads remote KV before a step's forward, saves finished prompts after it.
        self.kv_connector = None if config.kv_transfer_config is None else \
            KVConnectorWorker(config.kv_transfer_config, self.block_size, device)

    # ------------------------------------------------------------------ set-up

    def load_model(self) -> None:
        """Loads this rank's part of the model: its pipeline stage, its tensor-parallel slice."""
        parallel = self.parallel_state = get_parallel_state()
        self.model = get_model(self.config.model_config.model, dtype=self.dtype, device=self.device,
                               attn_backend=resolve_backend_name(self.config.model_config.attention_backend,
                                                                 self.device),
                               tp_rank=parallel.tp_rank, tp_size=parallel.tp_size,
                               pp_rank=parallel.pp_rank, pp_size=parallel.pp_size)
        prepack_linears(self.model)  # bf16 on CPU: oneDNN layouts once, not per call
        self.vocab_size = self.model.arch_config.vocab_size
        self.hidden_size = self.model.arch_config.hidden_size
        self.eos_token_ids = list(self.model.arch_config.eos_token_ids)

    def get_kv_cache_block_bytes(self) -> int:
        """Bytes one block takes across the layers of this rank (its stage, its KV heads)."""
        shape = self.model.get_kv_cache_shape(1, self.block_size)
        num_elements = 1
        for dim in shape:
            num_elements *= dim
        return num_elements * self.model.num_local_layers * self.dtype.itemsize

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocates the caches, then (CUDA, unless ``enforce_eager``) captures the decode graphs over them."""
        self.kv_caches = self.model.make_kv_caches(num_blocks, self.block_size)
        if self._uses_cuda_graphs():
            model_config = self.config.model_config
            sizes = model_config.cuda_graph_batch_sizes or \
                default_batch_sizes(self.config.scheduler_config.max_num_seqs)
            self.decode_graphs = DecodeGraphRunner(self.model, self.kv_caches, list(sizes), self.max_num_blocks_per_req,
                                                   model_config.max_model_len, self.device)
            self.decode_graphs.capture()

    def _uses_cuda_graphs(self) -> bool:
        # One rank only: a stage boundary (PP) or a collective (TP) inside a graph is not supported yet.
        return (self.device.type == "cuda" and not self.config.model_config.enforce_eager
                and self.model.backend.supports_cuda_graphs and self.config.parallel_config.world_size == 1)

    @torch.inference_mode()
    def profile_run(self) -> None:
        """One forward of a full step's token budget, to find (on GPU) the activation peak.

        The budget is split into prompts of at most ``max_model_len - 1`` tokens (at most
        ``max_num_seqs`` of them), and logits are computed for ``max_num_seqs`` rows, as the
        largest decode step does. With tp_size > 1 a collective: every rank of the stage must
        call it at once. Stages do not talk to each other here (a later stage runs on zeros).
        """
        scheduler_config = self.config.scheduler_config
        lengths = _split_budget(scheduler_config.max_num_batched_tokens, scheduler_config.max_model_len - 1,
                                scheduler_config.max_num_seqs)
        num_tokens = sum(lengths)
        tables, next_block = [], 1
        for length in lengths:
            num_blocks = -(-length // self.block_size)
            tables.append(list(range(next_block, next_block + num_blocks)))
            next_block += num_blocks
        kv_caches = self.model.make_kv_caches(next_block, self.block_size)
        metadata = build_attention_metadata(lengths, lengths, tables, self.block_size, device=self.device)
        input_ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        positions = torch.cat([torch.arange(length) for length in lengths]).to(self.device)
        intermediate = None
        if not self.parallel_state.is_first_stage:
            zeros = torch.zeros(num_tokens, self.hidden_size, dtype=self.dtype, device=self.device)
            intermediate = (zeros, zeros.clone())
        hidden = self.model(input_ids, positions, kv_caches, metadata, intermediate)
        if self.parallel_state.is_last_stage:
            num_rows = min(scheduler_config.max_num_seqs, num_tokens)
            self.model.compute_logits(hidden[:1].expand(num_rows, -1))
        del kv_caches, hidden

    # -------------------------------------------------------------------- step

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        """Runs one step: the sampled tokens on the output rank, None on every other rank.

        With several ranks, every rank must be given every step (collectives
        and stage-to-stage transfers inside), in the same order.
        """
        self._update_states(scheduler_output)
        parallel = self.parallel_state
        kv_meta = scheduler_output.kv_connector_metadata
        kv_output = KVTransferOutput() if kv_meta else None
        if kv_meta and kv_meta.loads:
            for failed_load in self.kv_connector.start_load_kv(kv_meta, self.kv_caches, kv_output):
                self._compute_failed_load(failed_load)
        if scheduler_output.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[]) if parallel.is_output_rank else None
        inputs = self._prepare_inputs(scheduler_output.num_scheduled_tokens)
        intermediate = None
        if not parallel.is_first_stage:
            intermediate = recv_from_prev_stage(inputs.attn_metadata.num_actual_tokens, self.hidden_size,
                                                self.dtype, self.device)
        output = self._forward(inputs, intermediate)
        if not parallel.is_last_stage:
            send_to_next_stage(*output)  # (hidden, residual)
            return None
        hidden = output  # [num_tokens, hidden_size]
        if kv_meta and kv_meta.saves:
            self.kv_connector.save_kv(kv_meta, self.kv_caches, kv_output)
        prompt_logprobs = self._compute_prompt_logprobs(scheduler_output, inputs, hidden)
        logits = None
        if inputs.sampled_req_ids:  # with tp_size > 1 a collective: every rank of the last stage computes them
            logits = self.model.compute_logits(hidden[inputs.sample_indices])  # [num_sampled, vocab]
        if not parallel.is_output_rank:
            return None
        sampled_tokens: dict[str, list[int]] = {}
        logprobs = None
        if logits is not None:
            sampled_tokens, logprobs = self._sample(inputs.sampled_req_ids, logits)
        return ModelRunnerOutput(
            req_ids=inputs.req_ids, sampled_token_ids=[sampled_tokens.get(r, []) for r in inputs.req_ids],
            logprobs=logprobs, prompt_logprobs=prompt_logprobs, kv_transfer_output=kv_output)

    def _forward(self, inputs: StepInputs, intermediate: tuple[torch.Tensor, torch.Tensor] | None):
        """The model on the step's batch: a replayed CUDA graph for a small decode-only step, else eagerly."""
        if self.decode_graphs is not None and self.decode_graphs.can_run(inputs.attn_metadata):
            return self.decode_graphs.run(inputs.input_ids, inputs.positions, inputs.attn_metadata)
        return self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.attn_metadata, intermediate)

    def _compute_failed_load(self, load: KVLoad) -> None:
        """Computes the KV a failed load should have brought: one forward over those tokens alone."""
        state = self.requests[load.req_id]
        end = state.num_computed_tokens  # local hits + the external tokens; this step's tokens start here
        state.num_computed_tokens = load.src_block_indices[0] * self.block_size  # the local hits
        inputs = self._prepare_inputs({load.req_id: end - state.num_computed_tokens})  # moves it back to end
        self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.attn_metadata, None)

    def _update_states(self, scheduler_output: SchedulerOutput) -> None:
        for req_id in scheduler_output.finished_req_ids:
            self._remove_request(req_id)
            self._parked_generators.pop(req_id, None)
            self._num_prompt_logprobs_sent.pop(req_id, None)
        for req_id in scheduler_output.preempted_req_ids:
            state = self._remove_request(req_id)
            if state is not None and state.generator is not None:
                self._parked_generators[req_id] = state.generator
        for new in scheduler_output.scheduled_new_reqs:
            params = new.sampling_params
            generator = self._parked_generators.pop(new.req_id, None)
            if generator is None and params.seed is not None and not params.is_greedy:
                generator = make_generator(params.seed, self.device)
            self.requests[new.req_id] = CachedRequestState(
                req_id=new.req_id, prompt_token_ids=new.prompt_token_ids, sampling_params=params,
                token_ids=list(new.prompt_token_ids) + list(new.output_token_ids),
                num_computed_tokens=new.num_computed_tokens, slot=self.block_table.add_request(new.block_ids),
                generator=generator, bad_words_token_ids=self._tokenize_bad_words(params))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self.requests[req_id]
            state.num_computed_tokens = cached.num_computed_tokens[i]
            state.write_tokens(state.num_computed_tokens, cached.new_token_ids[i])
            self.block_table.append(state.slot, cached.new_block_ids[i])

    def _remove_request(self, req_id: str) -> CachedRequestState | None:
        state = self.requests.pop(req_id, None)
        if state is not None:
            self.block_table.remove_request(state.slot)
        return state

    def _prepare_inputs(self, num_scheduled_tokens: dict[str, int]) -> StepInputs:
        """Flattens the step's tokens into one batch; advances each request's num_computed_tokens."""
        req_ids = list(num_scheduled_tokens)
        input_ids: list[int] = []
        positions: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        slots: list[int] = []
        token_offsets = [0]
        sampled_req_ids: list[str] = []
        sample_indices: list[int] = []
        for req_id in req_ids:
            state = self.requests[req_id]
            num_new = num_scheduled_tokens[req_id]
            start = state.num_computed_tokens
            end = start + num_new
            input_ids.extend(state.token_ids[start:end])
            positions.extend(range(start, end))
            query_lens.append(num_new)
            seq_lens.append(end)
            slots.append(state.slot)
            token_offsets.append(token_offsets[-1] + num_new)
            if end == len(state.token_ids):  # the prompt is done: this request gets a token
                sampled_req_ids.append(req_id)
                sample_indices.append(token_offsets[-1] - 1)
            state.num_computed_tokens = end
        device = self.device
        # numpy for the index arithmetic: a few microseconds per op instead of torch's tens, and the
        # tensors below share its memory (no copies on CPU).
        positions_np = np.array(positions, dtype=np.int64)
        slots_np = np.array(slots, dtype=np.int64)
        max_num_blocks = -(-max(seq_lens) // self.block_size)
        block_tables = self.block_table.table.numpy()[slots_np, :max_num_blocks]  # [num_reqs, max_num_blocks]
        # Each token's KV slot: its request's block for that position, offset within the block.
        token_rows = np.repeat(np.arange(len(req_ids)), query_lens)  # [num_tokens]
        token_blocks = block_tables[token_rows, positions_np // self.block_size].astype(np.int64)
        slot_mapping = token_blocks * self.block_size + positions_np % self.block_size
        metadata = AttentionMetadata(
            num_actual_tokens=len(input_ids),
            query_start_loc=torch.tensor(token_offsets, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_tables=torch.from_numpy(block_tables).to(device),
            slot_mapping=torch.from_numpy(slot_mapping).to(device),
            max_query_len=max(query_lens), max_seq_len=max(seq_lens),
            query_lens_cpu=query_lens, seq_lens_cpu=seq_lens)
        return StepInputs(
            req_ids=req_ids, input_ids=torch.tensor(input_ids, dtype=torch.long, device=device),
            positions=torch.from_numpy(positions_np).to(device), attn_metadata=metadata,
            sampled_req_ids=sampled_req_ids,
            sample_indices=torch.tensor(sample_indices, dtype=torch.long, device=device),
            token_offsets=token_offsets)

    def _sample(self, req_ids: list[str], logits: torch.Tensor
                ) -> tuple[dict[str, list[int]], dict[str, LogprobsLists] | None]:
        states = [self.requests[req_id] for req_id in req_ids]
        metadata = SamplingMetadata.from_requests(
            [(s.sampling_params, s.prompt_token_ids, s.output_token_ids, s.generator) for s in states],
            self.vocab_size, self.eos_token_ids, device=self.device,
            bad_words_token_ids=[s.bad_words_token_ids for s in states])
        output = self.sampler(logits, metadata)
        token_ids = output.sampled_token_ids.tolist()
        for state, token_id in zip(states, token_ids):
            state.token_ids.append(token_id)
        sampled = {req_id: [token_id] for req_id, token_id in zip(req_ids, token_ids)}
        if output.logprobs is None:
            return sampled, None
        ids, values, ranks = output.logprob_token_ids.tolist(), output.logprobs.tolist(), output.sampled_token_ranks.tolist()
        logprobs = {}
        for row, state in enumerate(states):
            num = state.sampling_params.logprobs
            if num is None:
                continue
            width = len(ids[row]) if num == -1 else num + 1
            logprobs[state.req_id] = LogprobsLists([ids[row][:width]], [values[row][:width]], [ranks[row]])
        return sampled, logprobs

    def _compute_prompt_logprobs(self, scheduler_output: SchedulerOutput, inputs: StepInputs,
                                 hidden: torch.Tensor) -> dict[str, LogprobsLists] | None:
        """Logprobs of each prompt token given the ones before it, for this step's prompt positions."""
        result = {}
        for index, req_id in enumerate(inputs.req_ids):
            state = self.requests[req_id]
            num = state.sampling_params.prompt_logprobs
            if num is None:
                continue
            chunk_start = state.num_computed_tokens - scheduler_output.num_scheduled_tokens[req_id]
            # After a preemption the prompt is recomputed from position 0: skip what was sent.
            start = max(chunk_start, self._num_prompt_logprobs_sent.get(req_id, 0))
            # Positions start..last predict prompt tokens start+1..last+1 (the last prompt
            # position predicts the first output token, which is not a prompt logprob).
            last = min(state.num_computed_tokens, state.num_prompt_tokens - 1) - 1
            if start > last:
                continue
            offset = inputs.token_offsets[index] + start - chunk_start
            rows = hidden[offset:offset + last - start + 1]
            logits = self.model.compute_logits(rows)  # every TP rank of the last stage: a collective
            self._num_prompt_logprobs_sent[req_id] = last + 1
            if not self.parallel_state.is_output_rank:
                continue
            next_ids = torch.tensor(state.prompt_token_ids[start + 1:last + 2], device=self.device)
            tensors = compute_prompt_logprobs(logits, next_ids, num)
            result[req_id] = LogprobsLists(tensors.token_ids.tolist(), tensors.logprobs.tolist(),
                                           tensors.ranks.tolist())
        return result or None

    def _tokenize_bad_words(self, params) -> list[list[int]] | None:
        if not params.bad_words or not self.parallel_state.is_output_rank:  # only the output rank samples
            return None
        if self._tokenizer is None:
            from transformers import AutoTokenizer
            self._tokenizer = AutoTokenizer.from_pretrained(self.config.model_config.tokenizer_path)
        from engine.sample.masks import tokenize_bad_words
        return tokenize_bad_words(params.bad_words, self._tokenizer)


def _split_budget(num_tokens: int, max_prompt_len: int, max_num_prompts: int) -> list[int]:
    """Prompt lengths that fill ``num_tokens``: each at most ``max_prompt_len``, at most ``max_num_prompts``."""
    lengths = []
    while num_tokens > 0 and len(lengths) < max_num_prompts:
        lengths.append(min(num_tokens, max_prompt_len))
        num_tokens -= lengths[-1]
    return lengths
