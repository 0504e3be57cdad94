"""``StructuredOutputManager``: the engine core's side of structured outputs (vLLM's manager of that name).

A request with ``structured_outputs`` does not reach the scheduler until its grammar is compiled:
``add_request`` starts the compile on a thread pool (keyed by the constraint, so ``n`` > 1 and
repeated schemas compile once) and holds the request; ``take_ready`` hands over those whose
grammar is ready, each with a fresh matcher (``Request.grammar``), and finishes those whose
grammar failed (``FINISHED_ERROR``, xgrammar's reason in ``stop_reason``) before they take any KV.
Every other request keeps stepping meanwhile: compiling never runs on the step's path.

Each step, ``attach_bitmask`` writes the allowed tokens of every grammar request the step samples
into the ``SchedulerOutput`` (one bitmask row each, and one more per draft token it verifies: the
grammar state each draft position would reach), which the output rank's sampler applies.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import threading
from collections import OrderedDict

from engine.config import EngineConfig
from engine.sched.request import Request, RequestStatus
from engine.sched.request_hold import RequestHold
from engine.sched.step_outputs import SchedulerOutput

logger = logging.getLogger(__name__)

# Compiled grammars kept for reuse, most recently used last (xgrammar keeps its own byte-bounded cache too).
MAX_CACHED_GRAMMARS = 512
# The compile threads' nice value where SCHED_IDLE is not available: they run on what the step leaves.
COMPILE_THREAD_NICE = 19


class StructuredOutputManager(RequestHold):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__()
        self.config = config.structured_outputs_config
        self._model_config = config.model_config
        self._backend = None  # XgrammarBackend, built by the first compile (it loads the tokenizer)
        self._backend_lock = threading.Lock()
        # No thread starts until the first structured request.
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=self.config.num_compile_threads,
            thread_name_prefix="grammar-compile",
            initializer=_lower_thread_priority,
        )
        self._compiled: OrderedDict[tuple, concurrent.futures.Future] = OrderedDict()
        # self._waiting (RequestHold): request id -> (the request, its grammar's compile)
        self._live: set[str] = set()  # ids of grammar requests handed to the scheduler, until they are gone

    # -------------------------------------------------------------- requests

    def hold(self, request: Request) -> bool:
        """Starts compiling ``request``'s grammar (or finds it compiled) and holds the request meanwhile;
        False for a request without structured outputs."""
        constraint = request.sampling_params.structured_outputs
        if constraint is None:
            return False
        self._waiting[request.request_id] = (request, self._compile(constraint))
        return True

    def take_ready(self) -> tuple[list[Request], list[Request]]:
        """(requests whose grammar is ready, each with its matcher; requests whose compile failed, finished)."""
        ready, failed = [], []
        for request_id, (request, future) in list(self._waiting.items()):
            if not future.done():
                continue
            del self._waiting[request_id]
            error = future.exception()
            if error is None:
                request.grammar = self._backend.make_grammar(
                    future.result(), _stop_token_ids(request), request.prompt_token_ids
                )
                self._live.add(request_id)
                ready.append(request)
            else:
                request.status = RequestStatus.FINISHED_ERROR
                request.stop_reason = str(error)
                failed.append(request)
        return ready, failed

    def wait(self, timeout_s: float) -> None:
        """Blocks until a waiting request's compile ends or ``timeout_s`` passes (when nothing else can run)."""
        futures = [future for _, future in self._waiting.values()]
        concurrent.futures.wait(futures, timeout=timeout_s, return_when=concurrent.futures.FIRST_COMPLETED)

    # ------------------------------------------------------------------ step

    def attach_bitmask(self, output: SchedulerOutput, requests: dict[str, Request]) -> None:
        """Sets ``output``'s bitmask for the grammar requests it samples (those computing their last token)."""
        if not self._live:
            return
        self._live = {request_id for request_id in self._live if request_id in requests}
        sampled = []
        for request_id in self._live:
            request = requests[request_id]
            if request_id in output.num_scheduled_tokens and request.num_computed_tokens >= request.num_tokens:
                sampled.append(request)
        if not sampled:
            return
        import xgrammar as xgr

        drafts = output.scheduled_spec_decode_tokens
        num_rows = len(sampled) + sum(len(drafts.get(request.request_id, ())) for request in sampled)
        bitmask = xgr.allocate_token_bitmask(num_rows, self._backend.vocab_size)  # [rows, ceil(vocab / 32)]
        row = 0
        for request in sampled:
            request_drafts = drafts.get(request.request_id, [])
            _fill_draft_rows(request.grammar, request_drafts, bitmask, row)
            row += 1 + len(request_drafts)
        output.structured_output_req_ids = [request.request_id for request in sampled]
        output.grammar_bitmask = bitmask

    # --------------------------------------------------------------- compile

    def _compile(self, params) -> concurrent.futures.Future:
        from engine.structured_output.backend import compact_json

        key = (params.kind, params.spec, compact_json(params, self.config))
        future = self._compiled.get(key)
        if future is not None:
            self._compiled.move_to_end(key)
            return future
        future = self._pool.submit(self._compile_in_pool, params)
        self._compiled[key] = future
        while len(self._compiled) > MAX_CACHED_GRAMMARS:
            self._compiled.popitem(last=False)
        return future

    def _compile_in_pool(self, params):
        with self._backend_lock:  # the first compile builds the backend (loads the tokenizer): off the core's loop too
            if self._backend is None:
                self._backend = self._make_backend()
        return self._backend.compile(params)

    def _make_backend(self):
        from engine.model.architecture import Architecture
        from engine.model.source import load_tokenizer
        from engine.reasoning import reasoning_parser
        from engine.structured_output.backend import XgrammarBackend

        tokenizer = load_tokenizer(self._model_config.tokenizer_path)
        vocab_size = Architecture.from_model(self._model_config.model).vocab_size
        logger.info("Structured outputs: xgrammar over a vocabulary of %d tokens.", vocab_size)
        # With a reasoning parser a constraint starts after the reasoning, unless told to cover it too.
        reasoning = None if self.config.enable_in_reasoning else reasoning_parser(self._model_config.reasoning_parser)
        return XgrammarBackend(tokenizer, vocab_size, self.config, reasoning)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _lower_thread_priority() -> None:
    """The compile threads yield the CPU to the core's loop: on a node whose cores the forward already uses,
    a compile at the same priority slows every step it overlaps (the inter-token latency's tail grows). Linux
    schedules threads one by one, so this thread alone becomes SCHED_IDLE (or, failing that, nice 19)."""
    try:
        # SCHED_IDLE (Linux, per thread with pid 0): runs only on a core nothing else wants.
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), COMPILE_THREAD_NICE)
        except (AttributeError, OSError):  # not Linux, or not allowed: compile at the process's priority
            pass


def _fill_draft_rows(grammar, draft_token_ids: list[int], bitmask, row: int) -> None:
    """Rows ``row ..`` of ``bitmask``: the tokens allowed after each prefix of the drafts (speculative decoding).

    The grammar advances through the drafts it allows, then rolls back to where it was. Past a draft it
    refuses (or once it has terminated) the rows allow everything: the target rejects that draft (its
    row masks it), so no later row is ever sampled from."""
    grammar.fill_bitmask(bitmask, row)
    num_accepted = 0
    for token_id in draft_token_ids:
        if not grammar.accept_token(token_id):
            break
        num_accepted += 1
        if grammar.is_terminated():
            break
        grammar.fill_bitmask(bitmask, row + num_accepted)
    grammar.rollback(num_accepted)


def _stop_token_ids(request: Request) -> list[int]:
    """The tokens that may end the grammar: EOS (the grammar's end overrides ``ignore_eos``) and stop tokens."""
    eos = [] if request.eos_token_id is None else [request.eos_token_id]
    return eos + [t for t in request.sampling_params.stop_token_ids if t != request.eos_token_id]
