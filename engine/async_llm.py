"""The asyncio front end of the engine (vLLM's ``AsyncLLM``), for serving.

    llm = AsyncLLM.from_engine_args(EngineArgs(model="/path/to/checkpoint"))
    async for output in llm.generate("Hello", SamplingParams(output_kind=RequestOutputKind.DELTA), "req-1"):
        print(output.outputs[0].text, end="")

Two places work on a request: the server's event loop, where ``generate`` adds it (tokenize, validate,
send to the core) and the front end's ``output_handler`` (``engine.output_handler``, vLLM's
``output_handler`` task) turns each of the core's steps into outputs (detokenize, stop strings, stats) and
puts each straight into its request's ``RequestOutputCollector``, which merges what a slow consumer has not
read yet; and the engine core, which steps on its own where ``serving_placement`` puts it
(``engine.core.core_client``): by default another process (a child, or a Ray actor beside this process when
it drives Ray worker actors or moves KV blocks through Ray), so that it does not share this process's GIL
with the event loop; with ``engine_core_process=False`` a thread of this one. The core client's thread hands
each step to the loop (``StepBuffer``). Requests join and leave the running batch at step boundaries
(continuous batching).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
from collections.abc import AsyncGenerator

from engine.config import EngineConfig, ModelConfig
from engine.core.core_client import CorePlacement, serving_placement
from engine.engine_args import EngineArgs
from engine.engine_client import EngineClient, EngineDeadError, EngineOverloadedError
from engine.executor.base import Executor
from engine.frontend.output_collector import PoolingOutputCollector, RequestOutputCollector
from engine.inputs import PLAIN_REQUEST, PromptType, RequestOptions
from engine.llm_engine import LLMEngine
from engine.metrics import EngineStats, LoggingStatLogger, StatLogger
from engine.output_handler import OutputHandler
from engine.pooling_params import PoolingParams
from engine.request_output import EmbeddingRequestOutput, RequestOutput
from engine.sampling_params import SamplingParams
from engine.sched.kv_events import KVEventBatch

logger = logging.getLogger(__name__)

__all__ = ["AsyncLLM", "EngineDeadError", "EngineOverloadedError"]


def with_torch_threads(config: EngineConfig, num_cpus: int | None, placement: CorePlacement) -> EngineConfig:
    """``config`` with the in-process worker's torch threads set from the engine's ``num_cpus`` (default:
    the machine's) unless ``num_threads`` is set: one thread per CPU, whether the core runs here or in its own process.

    The front end (detokenizing, streaming) shares those CPUs with the forward: on a real model its work is
    a small fraction of a step's arithmetic and weight traffic, and a core left to it would idle most of the
    time (docs/benchmarks.md, "On a real model"). A model so small that the front end's work rivals the step
    runs better with ``num_threads`` one fewer than its CPUs.
    """
    device_config = config.device_config
    if device_config.num_threads is not None or (num_cpus is None and placement.in_this_process):
        return config
    if config.parallel_config.executor_backend != "uni":
        return config  # the forward runs in Ray worker actors, each with threads for its own CPUs
    num_threads = num_cpus or os.cpu_count() or 1
    return dataclasses.replace(config, device_config=device_config.model_copy(update={"num_threads": num_threads}))


class AsyncLLM(EngineClient):
    """The engine behind an asyncio server: ``generate`` streams, ``abort`` stops, ``get_stats`` observes.

    Use it from one event loop at a time (the HTTP server's). Its front end runs on the loop that calls
    ``generate`` (or ``abort``), taken lazily; a call from a new loop once the old one has stopped moves it
    there (requests left on the old loop are aborted), and a call from a second loop while the first still
    runs raises RuntimeError. Construction loads the model and starts the core; ``shutdown`` stops it.
    """

    def __init__(
        self,
        config: EngineConfig,
        executor_class: type[Executor] | None = None,
        stat_loggers: list[StatLogger] | None = None,
        num_cpus: int | None = None,
        kv_events: bool = False,
    ) -> None:
        """``num_cpus``: the CPUs this engine may use, front end included (default: the machine's).
        ``kv_events``: keep the prefix cache's changes for ``take_kv_events`` (a KV-aware router's feed)."""
        placement = serving_placement(config)
        config = with_torch_threads(config, num_cpus, placement)
        self.config = config
        engine = LLMEngine(config, executor_class, stat_loggers=stat_loggers, placement=placement, kv_events=kv_events)
        # One tokenizer per replica, shared by the server (chat templates, /tokenize, possibly off the loop)
        # and the front end. Safe: all only read it (encode, decode, DecodeStream, chat templates). A fast
        # tokenizer changes its Rust state only to turn truncation or padding on or off, which nothing here
        # asks for; the one encode below settles a tokenizer file that comes with either on.
        self.tokenizer = engine.tokenizer
        self.tokenizer.encode("")
        self._vocab_size = engine.vocab_size
        self._core = engine.engine_core  # only its any-thread members (engine.core.core_client): health, pid
        self._frontend = OutputHandler(engine)

    @classmethod
    def from_engine_args(
        cls,
        args: EngineArgs,
        stat_loggers: list[StatLogger] | None = None,
        num_cpus: int | None = None,
        kv_events: bool = False,
    ) -> AsyncLLM:
        """``stat_loggers`` join vLLM's periodic throughput log line; ``disable_log_stats`` turns all off."""
        loggers = [] if args.disable_log_stats else [LoggingStatLogger(), *(stat_loggers or [])]
        config = args.create_engine_config()
        return cls(config, stat_loggers=loggers, num_cpus=num_cpus, kv_events=kv_events)

    @property
    def max_model_len(self) -> int:
        return self.config.scheduler_config.max_model_len

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def model_config(self) -> ModelConfig:
        return self.config.model_config

    @property
    def engine_core_pid(self) -> int | None:
        """The engine-core process's id, or None when the core runs in this process."""
        return self._core.pid

    def get_tokenizer(self):
        return self.tokenizer

    async def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams,
        request_id: str,
        options: RequestOptions = PLAIN_REQUEST,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Streams the request's outputs as ``sampling_params.output_kind`` says; the last has finished=True.

        Bad input or a request id in use (ValueError), EngineOverloadedError and
        EngineDeadError are raised by the first ``__anext__``, before any output.
        Closing or cancelling the generator early aborts the request (its KV
        blocks are freed); ``abort(request_id)`` ends it with finish_reason "abort".
        ``options``: the request's priority, cache salt, KV transfer (disaggregated prefill,
        ``engine.sched.kv_transfer``) and adapter (multi-LoRA, ``enable_lora``), checked like the rest of the input.
        """
        collector = RequestOutputCollector(request_id, sampling_params)
        added = self._frontend.add(request_id, prompt, sampling_params, options, collector)
        collector.prompt, collector.prompt_token_ids = added
        is_finished = False
        try:
            while not is_finished:
                output = await collector.get()
                is_finished = output.finished
                yield output
        finally:
            if not is_finished:  # the consumer left early: the request stops and frees its KV blocks
                self._frontend.abort(request_id)

    async def encode(
        self,
        prompt: PromptType,
        pooling_params: PoolingParams,
        request_id: str,
        options: RequestOptions = PLAIN_REQUEST,
    ) -> AsyncGenerator[EmbeddingRequestOutput, None]:
        """vLLM's ``encode``: yields the prompt's one ``EmbeddingRequestOutput`` once it is pooled (nothing if
        the request is aborted first). Errors, closing and ``abort`` as for ``generate``."""
        collector = PoolingOutputCollector()
        self._frontend.add(request_id, prompt, pooling_params, options, collector)
        output = None
        try:
            output = await collector.get()
            if output is not None:
                yield output
        finally:
            if output is None:  # the consumer left early: the request stops and frees its KV blocks
                self._frontend.abort(request_id)

    async def abort(self, request_id: str) -> None:
        """Stops a request before the next step; its stream ends with finish_reason "abort". No-op if unknown."""
        self._frontend.abort(request_id)

    async def check_health(self) -> None:
        """Raises EngineDeadError if the engine died (its core included) or was shut down, or the
        executor's error if a worker is gone (pinging workers may block: done off the event loop)."""
        self._frontend.check_alive()
        await asyncio.to_thread(self._core.check_health)

    async def check_integrity(self) -> None:
        """Raises AssertionError unless the engine's KV cache accounts for every block exactly once (free list,
        reference counts, prefix-cache index: ``KVCacheManager.check_integrity``), checked between steps."""
        await asyncio.to_thread(self._core.check_integrity)

    def take_kv_events(self) -> KVEventBatch:
        """The prefix cache's changes since the last call (``engine.sched.kv_events``); cheap, any thread."""
        return self._frontend.take_kv_events()

    def get_stats(self) -> EngineStats:
        """The snapshot published after the latest step (or command); cheap, from any thread."""
        return self._frontend.latest_stats()

    def shutdown(self) -> None:
        """Stops the engine and its core, releasing them before it returns; open streams raise EngineDeadError.
        From any thread: while the served loop runs elsewhere, the stop runs there (this call waits)."""
        self._frontend.stop()
