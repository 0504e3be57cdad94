"""Per-request output collectors of the async front end (vLLM's ``RequestOutputCollector``; a pooling request's
``PoolingOutputCollector``).

The front end (``engine.output_handler``, on the event loop) puts each step's outputs into their
requests' collectors, the ``OutputStream`` of each request; a collector keeps at most one undelivered
output, merging what a slow consumer has not read yet.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

from engine.request_output import CompletionOutput, EmbeddingRequestOutput, RequestOutput
from engine.sampling_params import RequestOutputKind, SamplingParams


class RequestOutputCollector:
    """One request's undelivered output (vLLM's ``RequestOutputCollector``); event-loop thread only.

    It holds at most one ``RequestOutput``: what arrives before the consumer
    reads is merged into it (DELTA: text, token ids and logprobs concatenated
    per completion; CUMULATIVE / FINAL_ONLY: the newest completion per index
    wins), so a slow consumer never builds a queue.
    """

    def __init__(self, request_id: str, params: SamplingParams) -> None:
        self.request_id = request_id
        self.output_kind = params.output_kind
        self.num_completions = params.n
        self.is_logprobs_wanted = params.logprobs is not None
        self.prompt: str | None = None
        self.prompt_token_ids: list[int] = []
        self.is_finished = False  # a finished output has been put: nothing more comes
        self._latest: dict[int, CompletionOutput] = {}  # last completion seen per index
        self._pending: RequestOutput | None = None
        self._error: BaseException | None = None
        self._ready = asyncio.Event()

    def put(self, output: RequestOutput) -> None:
        """Takes the request's next output. A completion the core finished with "error" (its grammar did not
        compile) ends the stream with a ValueError carrying the core's reason instead (a 400 over HTTP)."""
        if self.is_finished or self._error is not None:
            return
        failed = next((c for c in output.outputs if c.finish_reason == "error"), None)
        if failed is not None:
            self.put_error(ValueError(str(failed.stop_reason)))
            return
        _copy_shared_lists(output)
        for completion in output.outputs:
            self._latest[completion.index] = completion
        is_delta = self.output_kind == RequestOutputKind.DELTA
        self._pending = output if self._pending is None else merge_outputs(self._pending, output, is_delta)
        self.is_finished = output.finished
        self._ready.set()

    def put_abort(self) -> None:
        """Ends the stream with a final output: unfinished completions get finish_reason "abort"."""
        if not self.is_finished and self._error is None:
            self.put(self._make_abort_output())

    def put_error(self, error: BaseException) -> None:
        """Ends the stream with ``error`` (raised by the next ``get``) unless it already finished."""
        if not self.is_finished:
            self._error = error
            self._ready.set()

    async def get(self) -> RequestOutput:
        while self._pending is None and self._error is None:
            self._ready.clear()
            await self._ready.wait()
        if self._error is not None:
            raise self._error
        output, self._pending = self._pending, None
        return output

    def _make_abort_output(self) -> RequestOutput:
        completions = []
        for index in range(self.num_completions):
            latest = self._latest.get(index)
            if latest is not None and latest.finish_reason is not None:
                continue  # that completion already ended on its own
            if latest is not None and self.output_kind == RequestOutputKind.CUMULATIVE:
                completions.append(replace(latest, finish_reason="abort", stop_reason=None))
            else:  # DELTA: nothing new; FINAL_ONLY: nothing was produced
                completions.append(
                    CompletionOutput(
                        index=index,
                        text="",
                        token_ids=[],
                        finish_reason="abort",
                        cumulative_logprob=latest.cumulative_logprob if latest is not None else None,
                        logprobs=[] if self.is_logprobs_wanted else None,
                    )
                )
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=completions,
            finished=True,
        )


class PoolingOutputCollector:
    """A pooling request's one output (``AsyncLLM.encode``); event-loop thread only. ``get`` returns it, or
    None once the request was aborted (it has no partial output to end with)."""

    def __init__(self) -> None:
        self.is_finished = False
        self._output: EmbeddingRequestOutput | None = None
        self._error: BaseException | None = None
        self._ready = asyncio.Event()

    def put(self, output: EmbeddingRequestOutput) -> None:
        if not self.is_finished:
            self._output, self.is_finished = output, True
            self._ready.set()

    def put_abort(self) -> None:
        if not self.is_finished:
            self.is_finished = True
            self._ready.set()

    def put_error(self, error: BaseException) -> None:
        if not self.is_finished:
            self._error, self.is_finished = error, True
            self._ready.set()

    async def get(self) -> EmbeddingRequestOutput | None:
        await self._ready.wait()
        if self._error is not None:
            raise self._error
        return self._output


def _copy_shared_lists(output: RequestOutput) -> None:
    """The output processor hands out lists it keeps extending (prompt logprobs, cumulative logprobs), and
    a consumer may read an output after later steps: it gets copies."""
    if output.prompt_logprobs is not None:
        output.prompt_logprobs = list(output.prompt_logprobs)
    for completion in output.outputs:
        if completion.logprobs is not None:
            completion.logprobs = list(completion.logprobs)


def merge_outputs(pending: RequestOutput, new: RequestOutput, is_delta: bool) -> RequestOutput:
    """``new`` folded into the not yet delivered ``pending`` (same request); completions stay sorted by index."""
    by_index = {completion.index: completion for completion in pending.outputs}
    for completion in new.outputs:
        old = by_index.get(completion.index)
        by_index[completion.index] = _concat(old, completion) if is_delta and old is not None else completion
    prompt_logprobs = new.prompt_logprobs if new.prompt_logprobs is not None else pending.prompt_logprobs
    return replace(
        new,
        outputs=[by_index[index] for index in sorted(by_index)],
        finished=pending.finished or new.finished,
        prompt_logprobs=prompt_logprobs,
    )


def _concat(old: CompletionOutput, new: CompletionOutput) -> CompletionOutput:
    logprobs = new.logprobs if old.logprobs is None or new.logprobs is None else old.logprobs + new.logprobs
    return replace(new, text=old.text + new.text, token_ids=old.token_ids + new.token_ids, logprobs=logprobs)
