"""The model runner: turns a SchedulerOutput into tensors, runs the model, samples.

It is the only place that builds tensors from the scheduler's plain data.
Per step: drop finished/preempted requests, apply the deltas, flatten every
scheduled token into one batch, run one forward over the mixed batch of
prefill chunks and decodes, and sample one token for each request whose
prompt is fully computed (a pooling request's prompt is pooled into its vector instead).

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

import torch

from engine.attention.backend import resolve_backend_name, resolve_kv_cache_dtype
from engine.config import EngineConfig
from engine.distributed.parallel_state import get_parallel_state, recv_from_prev_stage, send_to_next_stage
from engine.kv_transfer import KVConnectorWorker
from engine.lora.manager import LoRAManager
from engine.model import get_model
from engine.model.architecture import Architecture
from engine.model.layers.cpu_prepack import NO_NATIVE_ROWS
from engine.model.layers.linear_method import process_weights_after_loading
from engine.sample import Sampler
from engine.sample.grammar_bitmask import apply_grammar_bitmask_rows, grammar_rows
from engine.sample.prompt_logprobs import PromptLogprobs
from engine.sched.kv_transfer import KVTransferOutput
from engine.sched.step_outputs import LogprobsLists, ModelRunnerOutput, SchedulerOutput
from engine.worker.cuda_graphs import capture_decode_graphs
from engine.worker.decode_step import DecodeStep
from engine.worker.input_batch import InputBatch
from engine.worker.native_decode import native_decode_step
from engine.worker.pooler import Pooler
from engine.worker.profiling import profile_forward
from engine.worker.request_state import CachedRequestState
from engine.worker.sampling_inputs import SamplingMetadataCache, prompt_chunks
from engine.worker.spec_decode_runner import SpecDecodeRunner
from engine.worker.step_inputs import StepInputs


class ModelRunner:
    """One rank's model: its set-up (weights, KV caches, decode graphs) and ``execute_model``, one step.

    A step goes through fixed stages, each owned by its own unit: the deltas
    and the flattened batch (``InputBatch``), KV loads before the forward and
    saves after it (``KVConnectorWorker``), the forward (eager, or a replayed
    ``DecodeGraphRunner`` graph on CUDA, or the ``NativeDecodeStep`` on CPU:
    the runner's one ``decode_step``), prompt logprobs (``PromptLogprobs``), logits at
    each sampled request's last token, the grammar bitmask of
    structured-output requests (``apply_grammar_bitmask``), then the
    ``Sampler`` (or, in a step where requests verify drafts, the
    ``DraftVerifier``); a pooling request's rows go to the ``Pooler`` instead.
    With speculative decoding a proposer follows ``_sample``: it reads the
    step's sampled tokens (and may read its hidden states) and proposes
    draft tokens for the next step, carried back in the
    ``ModelRunnerOutput`` (``SpecDecodeRunner``).
    """

    def __init__(self, config: EngineConfig, device: torch.device, dtype: torch.dtype) -> None:
        self.config = config
        self.device = device
        self.dtype = dtype
        backend_name = resolve_backend_name(config.model_config.attention_backend, device)
        self.kv_cache_dtype = resolve_kv_cache_dtype(config.cache_config.kv_cache_dtype, backend_name, dtype)
        # This rank's place in the TP/PP groups, read again in load_model (after init_distributed).
        self.parallel_state = get_parallel_state()
        self.block_size = config.cache_config.block_size
        scheduler_config = config.scheduler_config
        self.max_num_blocks_per_req = -(-scheduler_config.max_model_len // self.block_size)
        # The layers grouped by attention window, each group with its own blocks (engine.sched.kv_cache_groups).
        self.kv_cache_groups = Architecture.from_model(config.model_config.model).kv_cache_groups()
        self.input_batch = InputBatch(
            scheduler_config.max_num_seqs, self.max_num_blocks_per_req, self.block_size, device, self.kv_cache_groups
        )
        self.requests: dict[str, CachedRequestState] = self.input_batch.requests  # read-only view
        self.prompt_logprobs = PromptLogprobs()
        self.pooler = Pooler(config.pooler_config)
        self.sampler = Sampler()
        self.model = None
        self.kv_caches: list[torch.Tensor] = []
        self.spec_decode: SpecDecodeRunner | None = None  # speculative decoding, on the output rank only
        self.lora: LoRAManager | None = None  # multi-LoRA (enable_lora) only
        # Decode steps run another way than the eager forward, where one fits (decode_step.py): chosen once.
        self.decode_step: DecodeStep | None = None
        # Disaggregated prefill: loads remote KV before a step's forward, saves finished prompts after it.
        self.kv_connector = (
            None
            if config.kv_transfer_config is None
            else KVConnectorWorker(config.kv_transfer_config, self.block_size, device)
        )

    # ------------------------------------------------------------------ set-up

    def load_model(self) -> None:
        """Loads this rank's part of the model: its pipeline stage, its tensor-parallel slice."""
        parallel = self.parallel_state = get_parallel_state()
        self.model = get_model(
            self.config.model_config.model,
            dtype=self.dtype,
            device=self.device,
            attn_backend=resolve_backend_name(self.config.model_config.attention_backend, self.device),
            tp_rank=parallel.tp_rank,
            tp_size=parallel.tp_size,
            pp_rank=parallel.pp_rank,
            pp_size=parallel.pp_size,
            quantization=self.config.model_config.quantization,
        )
        process_weights_after_loading(self.model)  # each layer's product chosen once, its layouts made
        enable_lora = self.config.lora_config.enable_lora
        self.decode_step = native_decode_step(self.model, enable_lora)  # CPU; logs why not
        if enable_lora:
            self.lora = LoRAManager(self.model, self.config.lora_config, self.dtype, self.device)
        self.vocab_size = self.model.arch_config.vocab_size
        self.hidden_size = self.model.arch_config.hidden_size
        self.eos_token_ids = list(self.model.arch_config.eos_token_ids)
        self.sampling_metadata = SamplingMetadataCache(self.vocab_size, self.eos_token_ids, self.device)
        if self.config.speculative_config is not None and parallel.is_output_rank:
            self.spec_decode = SpecDecodeRunner(self.config, self.input_batch, self.vocab_size, self.eos_token_ids)
            self.spec_decode.load_model(self.dtype, self.device)

    def get_kv_cache_block_bytes(self) -> int:
        """Bytes one block takes across the layers of this rank (its stage, its KV heads)."""
        shape = self.model.get_kv_cache_shape(1, self.block_size)
        num_elements = 1
        for dim in shape:
            num_elements *= dim
        draft_bytes = 0 if self.spec_decode is None else self.spec_decode.kv_cache_block_bytes()
        return num_elements * self.model.num_kv_cache_tensors * self.kv_cache_dtype.itemsize + draft_bytes

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocates the caches, then (CUDA, unless ``enforce_eager``) captures the decode graphs over them."""
        self.kv_caches = self.model.make_kv_caches(num_blocks, self.block_size, self.kv_cache_dtype)
        if self.spec_decode is not None:
            self.spec_decode.initialize_kv_cache(num_blocks)
        # LoRA's per-step grouping is host-side control flow a graph cannot replay: eager with adapters.
        if self.decode_step is None and self.lora is None:
            self.decode_step = capture_decode_graphs(
                self.model, self.kv_caches, self.config, self.max_num_blocks_per_req, self.device
            )

    def profile_run(self) -> None:
        """One forward of a full step's token budget, to find the GPU's activation peak (``profile_forward``)."""
        profile_forward(
            self.model,
            self.config.scheduler_config,
            self.parallel_state,
            self.block_size,
            self.hidden_size,
            self.dtype,
            self.device,
        )

    # -------------------------------------------------------------------- step

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        """Runs one step: the sampled tokens (and pooled vectors) on the output rank, None on every other rank.

        With several ranks, every rank must be given every step (collectives
        and stage-to-stage transfers inside), in the same order.
        """
        self.input_batch.apply_deltas(scheduler_output)
        for req_id in scheduler_output.finished_req_ids:
            self.prompt_logprobs.forget(req_id)
            self.pooler.forget(req_id)
        parallel = self.parallel_state
        kv_meta = scheduler_output.kv_connector_metadata
        kv_output = self._start_kv_loads(kv_meta)
        if scheduler_output.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[]) if parallel.is_output_rank else None
        inputs = self.input_batch.prepare_inputs(scheduler_output.num_scheduled_tokens)
        fused = self.decode_step is not None and self.decode_step.can_run(inputs, self.requests)
        output = self._forward(inputs, fused)
        self.input_batch.advance(inputs)  # the step's KV is in the cache now
        if not parallel.is_last_stage:
            send_to_next_stage(*output)  # (hidden, residual)
            return None
        hidden = output  # [num_tokens, hidden_size]
        if kv_meta and kv_meta.saves:
            self.kv_connector.save_kv(kv_meta, self.kv_caches, kv_output)
        prompt_logprobs = self.prompt_logprobs.compute(
            prompt_chunks(self.requests, inputs), hidden, self.model.compute_logits, parallel.is_output_rank
        )
        logits = self._logits(inputs, hidden, fused)
        if not parallel.is_output_rank:
            return None
        return self._step_output(inputs, hidden, logits, scheduler_output, prompt_logprobs, kv_output)

    def _step_output(
        self,
        inputs: StepInputs,
        hidden: torch.Tensor,
        logits,
        scheduler_output: SchedulerOutput,
        prompt_logprobs,
        kv_output,
    ) -> ModelRunnerOutput:
        """The output rank's results: each sampled request's tokens (their logprobs, the next step's drafts),
        each pooling request's vector once its prompt is done, the prompt logprobs and KV saves computed."""
        pooling_req_ids = self.input_batch.pooling_req_ids
        pooled = self.pooler.pool(self.requests, pooling_req_ids, inputs, hidden) if pooling_req_ids else None
        sampled_tokens: dict[str, list[int]] = {}
        logprobs = draft_token_ids = None
        if logits is not None:
            sampled_tokens, logprobs = self._sample(inputs, logits, scheduler_output)
            if self.spec_decode is not None:  # the next step's drafts
                draft_token_ids = self.spec_decode.propose(inputs.sampled_req_ids, hidden[inputs.sample_indices])
        return ModelRunnerOutput(
            req_ids=inputs.req_ids,
            sampled_token_ids=[sampled_tokens.get(r, []) for r in inputs.req_ids],
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            kv_transfer_output=kv_output,
            draft_token_ids=draft_token_ids,
            lora_counts=None if self.lora is None else self.lora.counts(),
            pooler_output=pooled,
        )

    def _start_kv_loads(self, kv_meta) -> KVTransferOutput | None:
        """Disaggregated prefill: the step's planned KV loads fill their blocks before the forward."""
        kv_output = KVTransferOutput() if kv_meta else None
        if kv_meta and kv_meta.loads:
            self.kv_connector.start_load_kv(kv_meta, self.kv_caches, kv_output, self.input_batch, self.model)
        return kv_output

    def _forward(self, inputs: StepInputs, fused: bool = False):
        """This rank's stage on the step's batch: the ``decode_step`` where it runs the step (``fused``), else
        eagerly (a verify step's products learn it from ``attn_metadata.max_verify_query_len``:
        ``cpu_prepack.native_rows_of_step``).

        A stage after the first takes (hidden, residual) from the one before it.
        """
        if fused:
            return self.decode_step.run(inputs, self.kv_caches)
        intermediate = None
        if not self.parallel_state.is_first_stage:
            intermediate = recv_from_prev_stage(
                inputs.attn_metadata.num_actual_tokens, self.hidden_size, self.dtype, self.device
            )
        if self.lora is not None:  # which adapter slot each token's rows go through
            self.lora.prepare([self.requests[r].lora_request for r in inputs.req_ids], inputs.query_lens)
        return self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.attn_metadata, intermediate)

    def _logits(self, inputs: StepInputs, hidden: torch.Tensor, fused: bool) -> torch.Tensor | None:
        """Logits at the sampled rows [num_sampled, vocab], None when nothing is sampled. With tp_size > 1 a
        collective: every rank of the last stage computes them. A ``fused`` step's few rows take the native
        product, as its layers did."""
        if not inputs.sampled_req_ids:
            return None
        native_rows = self.decode_step.logits_rows if fused else NO_NATIVE_ROWS
        return self.model.compute_logits(hidden[inputs.sample_indices], native_rows)

    def _sample(
        self, inputs: StepInputs, logits: torch.Tensor, scheduler_output: SchedulerOutput
    ) -> tuple[dict[str, list[int]], dict[str, LogprobsLists] | None]:
        """The tokens of each sampled request (logits rows in ``inputs``' order, grammar rows masked
        first): one each, or the accepted drafts and one more where it verifies drafts; and the
        logprobs they asked for."""
        req_ids = inputs.sampled_req_ids
        if scheduler_output.structured_output_req_ids:
            rows = grammar_rows(req_ids, inputs.num_draft_tokens, scheduler_output.structured_output_req_ids)
            apply_grammar_bitmask_rows(logits, rows, scheduler_output.grammar_bitmask)
        states = [self.requests[req_id] for req_id in req_ids]
        if any(inputs.num_draft_tokens):
            verified, logprobs = self.spec_decode.verifier(states, inputs.num_draft_tokens, logits)
            self.input_batch.append_verified_tokens(req_ids, verified)
            return dict(zip(req_ids, verified)), logprobs
        output = self.sampler(logits, self.sampling_metadata.get(states))
        token_ids = output.sampled_token_ids.tolist()
        self.input_batch.append_sampled_tokens(req_ids, token_ids)
        sampled = {req_id: [token_id] for req_id, token_id in zip(req_ids, token_ids)}
        if output.logprobs is None:
            return sampled, None
        lists = output.logprobs_lists([s.sampling_params.logprobs for s in states])
        return sampled, {req_id: row for req_id, row in zip(req_ids, lists) if row is not None}
