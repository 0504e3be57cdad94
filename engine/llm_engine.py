"""The engine front end: tokenize and validate requests for the core, detokenize what its steps give.

Its core runs wherever ``placement`` says (``engine.core.core_client``). ``LLM`` (offline) keeps the core
INLINE and turns it with ``step()``; serving (``AsyncLLM``) runs it on its own, and the front end on the
event loop (``engine.output_handler``) hands each ``CoreStep`` to ``process_core_step``: the one way a
step's results come in.
"""

from __future__ import annotations

import time

from engine.config import EngineConfig
from engine.core.core_client import CoreClient, CorePlacement
from engine.core.core_proc import CoreStep
from engine.core.make_client import make_core_client
from engine.engine_args import EngineArgs
from engine.executor.base import Executor
from engine.frontend.output_processor import OutputProcessor, OutputStream
from engine.frontend.processor import Processor
from engine.inputs import PLAIN_REQUEST, PromptType, RequestOptions
from engine.lora.loading import check_lora_supported
from engine.metrics import EngineStats, EngineTotals, IterationStats, StatLogger
from engine.model.architecture import Architecture
from engine.model.source import load_tokenizer, open_model_source
from engine.pooling_params import PoolingParams
from engine.request_output import EmbeddingRequestOutput, RequestOutput
from engine.sampling_params import SamplingParams
from engine.sched.kv_events import KVEventBatch


def resolve_eos_token_ids(model_path: str, arch: Architecture) -> list[int]:
    """EOS ids from the generation config when it has them (it may list several), else config.json's."""
    eos = open_model_source(model_path).generation_config.get("eos_token_id")
    if eos is not None:
        return [eos] if isinstance(eos, int) else list(eos)
    return list(arch.eos_token_ids)


class LLMEngine:
    """``stat_loggers`` get every step's statistics (and ``log()`` every ``log_interval_s``); with none,
    no latency statistics are kept (the offline ``LLM``). ``totals`` are kept either way."""

    def __init__(
        self,
        config: EngineConfig,
        executor_class: type[Executor] | None = None,
        stat_loggers: list[StatLogger] | None = None,
        log_interval_s: float = 10.0,
        placement: CorePlacement = CorePlacement.INLINE,
        kv_events: bool = False,
    ) -> None:
        """``placement``: where the core runs (INLINE: ``step()`` turns it here). ``kv_events``: the prefix
        cache's changes are kept for ``take_kv_events`` (a KV-aware router's feed)."""
        check_lora_supported(config)  # before any process or model starts
        self.config = config
        self.stat_loggers = list(stat_loggers or [])
        self.log_interval_s = log_interval_s
        self._last_log_time = time.monotonic()
        model_dir = config.model_config.model
        arch = Architecture.from_model(model_dir)
        # A core in another process loads the model while this thread loads the tokenizer; one in this process
        # loads it after the tokenizer, whose parse of a GGUF file is then freed before the weights are read.
        model_config = config.model_config
        tokenizer = (
            load_tokenizer(model_config.tokenizer_path, model_config.chat_template)
            if placement.in_this_process
            else None
        )
        self.engine_core: CoreClient = make_core_client(config, placement, executor_class, kv_events)
        try:
            if tokenizer is None:
                tokenizer = load_tokenizer(model_config.tokenizer_path, model_config.chat_template)
            self.tokenizer = tokenizer
            self.engine_core.wait_ready()
        except BaseException:
            self.engine_core.shutdown()  # no core outlives a failed start
            raise
        self.processor = Processor(
            config, self.tokenizer, arch.vocab_size, resolve_eos_token_ids(model_dir, arch), arch=arch
        )
        self.output_processor = OutputProcessor(self.tokenizer, config.scheduler_config.stream_interval)
        self.totals = EngineTotals()

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLMEngine:
        return cls(args.create_engine_config())

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | PoolingParams,
        options: RequestOptions = PLAIN_REQUEST,
        stream: OutputStream | None = None,
    ) -> tuple[str | None, list[int]]:
        """Queues a request of ``params.kind`` (``n`` > 1 fans out into n core requests, each with ``options``;
        a pooling request is one); returns its (prompt text, prompt token ids). Raises ValueError on bad input
        (the adapter included) or an id in use, having queued nothing. ``stream``: where its outputs go (None:
        ``step``/``process_core_step`` return them)."""
        children = self._fan_out(request_id, params)
        self.output_processor.check_ids_free(request_id, [core_id for core_id, _ in children])
        prompt_text, prompt_token_ids = self.processor.tokenize_prompt(prompt)
        requests = [  # validates everything before queueing anything
            self.processor.make_request(core_id, prompt_token_ids, child_params, options)
            for core_id, child_params in children
        ]
        arrival_time = time.monotonic() if self.stat_loggers else None
        self.output_processor.add_request(request_id, prompt_text, prompt_token_ids, children, arrival_time, stream)
        for request in requests:
            self.engine_core.add_request(request)
        self.totals.num_prompt_tokens += len(prompt_token_ids)
        return prompt_text, prompt_token_ids

    @staticmethod
    def _fan_out(request_id: str, params: SamplingParams | PoolingParams) -> list[tuple[str, SamplingParams]]:
        """The request's (core id, params) children, in completion order."""
        if params.n == 1:
            return [(request_id, params)]
        # vLLM's convention: child i of a seeded request uses seed + i.
        return [
            (f"{i}_{request_id}", params.clone(n=1, seed=None if params.seed is None else params.seed + i))
            for i in range(params.n)
        ]

    def abort_request(self, request_ids: list[str]) -> list[OutputStream | None]:
        """Ends these requests at once, freeing their blocks; unknown or finished ids are skipped. Returns
        the streams of those it ended."""
        aborted = [request for request in map(self.output_processor.abort, request_ids) if request is not None]
        self.totals.num_aborted_reqs += len(aborted)
        self.engine_core.abort_requests([core_id for request in aborted for core_id in request.states])
        return [request.stream for request in aborted]

    def step(self) -> list[RequestOutput | EmbeddingRequestOutput]:
        """An INLINE core: turns its loop once here; returns the outputs its step gave."""
        return self.process_core_step(self.engine_core.step())

    def process_core_step(self, core_step: CoreStep) -> list[RequestOutput | EmbeddingRequestOutput]:
        """One step of the core: its outputs as RequestOutputs (those of requests with a stream put there),
        its state for the stats."""
        iteration_stats = IterationStats()  # latencies only with stat loggers; the token count always
        core_outputs = self.engine_core.take_step(core_step)
        outputs, stopped_by_string = self.output_processor.process_outputs(core_outputs, iteration_stats)
        self.totals.record_step(iteration_stats)
        if self.stat_loggers:
            self._record_stats(iteration_stats)
        if stopped_by_string:
            self.engine_core.abort_requests(stopped_by_string)
        return outputs

    def _record_stats(self, iteration_stats: IterationStats) -> None:
        scheduler_stats = self.engine_core.get_stats()
        iteration_stats.kv_load_latencies_s = self.engine_core.take_kv_load_latencies()
        for stat_logger in self.stat_loggers:
            stat_logger.record(scheduler_stats, iteration_stats)
        if iteration_stats.now - self._last_log_time >= self.log_interval_s:
            self._last_log_time = iteration_stats.now
            for stat_logger in self.stat_loggers:
                stat_logger.log()

    def take_kv_events(self) -> KVEventBatch:
        """The prefix cache's changes since the last call (``engine.sched.kv_events``); empty unless
        built with ``kv_events``."""
        return self.engine_core.take_kv_events()

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    def streams(self) -> dict[str, OutputStream | None]:
        """Each request in flight: its id -> its stream."""
        return self.output_processor.streams()

    def get_stats(self) -> EngineStats:
        """A snapshot of the scheduler's state, the KV pool and ``totals``; it shares nothing mutable."""
        num_total_blocks, num_free_blocks = self.engine_core.kv_block_counts()
        return EngineStats.derive(self.engine_core.get_stats(), self.totals, num_total_blocks, num_free_blocks)

    def check_health(self) -> None:
        """Raises the executor's error if a worker is gone (may block while it pings them)."""
        self.engine_core.check_health()

    @property
    def vocab_size(self) -> int:
        """Token ids in ``[0, vocab_size)`` are valid in a prompt."""
        return self.processor.vocab_size

    def get_tokenizer(self):
        return self.tokenizer

    def shutdown(self) -> None:
        self.engine_core.shutdown()
