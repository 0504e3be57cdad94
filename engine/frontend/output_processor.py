"""Turns the core's token-level outputs into user-facing RequestOutputs.

It holds the front end's one map of requests in flight (``requests``), keyed by every id a request holds:
the caller's, and for ``n`` > 1 its children's core ids ("i_<id>"). Per request it keeps the detokenizer
(text, stop strings), the logprobs gathered so far, the join of the ``n`` completions and the stream its
outputs go to. A stop string ends a request here, in the front end: its id is returned so the caller aborts
it in the core and the blocks are freed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from engine.frontend.detokenizer import IncrementalDetokenizer
from engine.metrics.stats import IterationStats, RequestTimes
from engine.pooling_params import PoolingParams
from engine.request_output import (
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    Logprob,
    PositionLogprobs,
    RequestOutput,
)
from engine.sampling_params import RequestKind, RequestOutputKind, SamplingParams
from engine.sched.step_outputs import EngineCoreOutput, LogprobsLists


class OutputStream(Protocol):
    """Where a request's outputs go as they are made (on the front end's event loop), instead of being returned."""

    def put(self, output: RequestOutput | EmbeddingRequestOutput) -> None: ...


@dataclass
class UserRequest:
    """One request as its caller made it: ``n`` completions, one core request (``RequestState``) each."""

    request_id: str
    num_children: int
    stream: OutputStream | None  # None: outputs are returned by ``process_outputs``
    states: dict[str, RequestState] = field(default_factory=dict)  # unfinished children by core id
    completions: dict[int, CompletionOutput] = field(default_factory=dict)
    num_finished: int = 0


@dataclass
class RequestState:
    request_id: str  # the core's id (a child's id for n > 1)
    request: UserRequest
    index: int  # which of the n completions
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams | PoolingParams  # a pooling request (kind EMBED) gets one output: its vector
    detokenizer: IncrementalDetokenizer | None
    token_ids: list[int] = field(default_factory=list)
    num_sent_tokens: int = 0  # DELTA: tokens already handed out
    num_streamed_tokens: int = 0  # tokens in the latest output handed out (any kind)
    num_detokenized_tokens: int = 0  # tokens of token_ids the detokenizer has seen
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float | None = None
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    kv_transfer_params: dict | None = None  # a prefill engine's finished request: where its KV went
    times: RequestTimes | None = None  # when the engine keeps latency statistics
    pooling_output: list[float] | None = None  # a pooling request's vector, once it finished


class OutputProcessor:
    def __init__(self, tokenizer, stream_interval: int = 1) -> None:
        self.tokenizer = tokenizer
        # vLLM's stream_interval: a streamed (DELTA / CUMULATIVE) request gets an output for its first token,
        # then once per stream_interval new tokens, and at its end. Fewer, larger outputs cost the serving
        # path (detokenizing, SSE, every hop to the client) less per token.
        self.stream_interval = stream_interval
        # Every id a request in flight holds -> that request: its own id, and its unfinished children's.
        self.requests: dict[str, UserRequest] = {}

    def check_ids_free(self, request_id: str, core_ids: list[str]) -> None:
        """Raises ValueError unless a new request ``request_id`` with children ``core_ids`` takes no id a
        request in flight holds (the front end's one uniqueness check)."""
        holder = self.requests.get(request_id)
        if holder is not None and holder.request_id == request_id:
            raise ValueError(f"Request id {request_id!r} is already in use.")
        for core_id in core_ids:
            if core_id in self.requests:
                raise ValueError(f"Request id {request_id!r} would reuse the in-flight request id {core_id!r}.")

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        children: list[tuple[str, SamplingParams]],
        arrival_time: float | None = None,
        stream: OutputStream | None = None,
    ) -> None:
        """A request of ``children`` (core id, params), in completion order; after ``check_ids_free``.
        ``arrival_time`` (time.monotonic()) turns on latency statistics for it; ``stream``: where its
        outputs go (None: ``process_outputs`` returns them)."""
        request = UserRequest(request_id, len(children), stream)
        for index, (core_id, params) in enumerate(children):
            request.states[core_id] = self._make_state(request, core_id, index, prompt, prompt_token_ids, params)
            if arrival_time is not None:
                request.states[core_id].times = RequestTimes(arrival_time, len(prompt_token_ids))
            self.requests[core_id] = request
        self.requests[request_id] = request

    def _make_state(
        self, request: UserRequest, core_id: str, index: int, prompt, prompt_token_ids: list[int], params
    ) -> RequestState:
        if params.kind is RequestKind.EMBED:  # no text, no logprobs: a vector
            return RequestState(core_id, request, index, prompt, prompt_token_ids, params, None)
        detokenizer = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params) if params.detokenize else None
        state = RequestState(core_id, request, index, prompt, prompt_token_ids, params, detokenizer)
        if params.logprobs is not None:
            state.logprobs, state.cumulative_logprob = [], 0.0
        if params.prompt_logprobs is not None:
            state.prompt_logprobs = [None]  # the first prompt token has no context
        return state

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def streams(self) -> dict[str, OutputStream | None]:
        """Each request in flight: its id -> its stream."""
        return {key: request.stream for key, request in self.requests.items() if key == request.request_id}

    def abort(self, request_id: str) -> UserRequest | None:
        """Forgets the request of this id (None if none is in flight); its ``states`` name the core requests
        still running."""
        request = self.requests.get(request_id)
        if request is None or request.request_id != request_id:
            return None
        for core_id in [request_id, *request.states]:
            self.requests.pop(core_id, None)
        return request

    def _finish(self, state: RequestState) -> None:
        request = state.request
        del request.states[state.request_id]
        if state.request_id != request.request_id:
            del self.requests[state.request_id]
        if not request.states:
            del self.requests[request.request_id]

    def process_outputs(
        self, core_outputs: list[EngineCoreOutput], iteration_stats: IterationStats | None = None
    ) -> tuple[list[RequestOutput], list[str]]:
        """(outputs of the requests without a stream, ids the core must abort because a stop string ended
        them); a request with a stream has its outputs put there, in order.

        With ``iteration_stats``, every request's new tokens and every finished request are counted there,
        and the step's latencies of requests that keep statistics go there.
        """
        request_outputs: list[RequestOutput] = []
        to_abort: list[str] = []
        for core_output in core_outputs:
            request = self.requests.get(core_output.request_id)
            state = request.states.get(core_output.request_id) if request is not None else None
            if state is None:  # aborted by the user meanwhile
                continue
            if self._update(state, core_output):
                to_abort.append(state.request_id)
            if iteration_stats is not None:
                iteration_stats.record_tokens(
                    state.times,
                    len(core_output.new_token_ids),
                    core_output.first_scheduled_time,
                    pooled=core_output.pooling_output is not None,
                )
                if state.finish_reason is not None and state.times is not None:
                    iteration_stats.record_finished(state.times, state.finish_reason)
            if state.finish_reason is not None:
                self._finish(state)
            request_output = self._make_output(state)
            if request_output is None:
                continue
            if iteration_stats is not None:
                iteration_stats.num_finished_reqs += request_output.finished
            if state.request.stream is None:
                request_outputs.append(request_output)
            else:
                state.request.stream.put(request_output)
        return request_outputs, to_abort

    def _update(self, state: RequestState, core_output: EngineCoreOutput) -> bool:
        """Applies one step's tokens; True if a stop string ended the request here."""
        state.num_cached_tokens = core_output.num_cached_tokens
        if core_output.new_prompt_logprobs is not None and state.prompt_logprobs is not None:
            state.prompt_logprobs.extend(self._to_positions(core_output.new_prompt_logprobs))
        new_token_ids = core_output.new_token_ids
        state.token_ids.extend(new_token_ids)
        if core_output.new_logprobs is not None and state.logprobs is not None:
            positions = self._to_positions(core_output.new_logprobs)
            state.logprobs.extend(positions)
            for token_id, position in zip(new_token_ids, positions):
                state.cumulative_logprob += position[token_id].logprob
        finish_reason = core_output.finish_reason
        stop_string = None
        detokenizer = state.detokenizer
        # Without stop strings the text is needed only when an output is made: the tokens wait
        # (``_detokenize``), so a FINAL_ONLY request is detokenized once, at its end.
        if detokenizer is not None and (detokenizer.stop or finish_reason is not None):
            stop_string = self._detokenize(state, finish_reason if new_token_ids else None)
        if stop_string is not None:
            # A matched stop string ends the request as "stop" even when the core finished it in
            # the same step (e.g. on its last allowed token, which would otherwise say "length").
            state.finish_reason, state.stop_reason = "stop", stop_string
            self._drop_tokens_after_stop(state, detokenizer.num_output_tokens)
            return finish_reason is None  # still running in the core: the caller aborts it there
        if finish_reason is not None:
            state.finish_reason = finish_reason
            state.stop_reason = core_output.stop_reason
            state.kv_transfer_params = core_output.kv_transfer_params
            state.pooling_output = core_output.pooling_output
        return False

    @staticmethod
    def _drop_tokens_after_stop(state: RequestState, num_kept: int) -> None:
        """Drops the tokens a step brought past the one that completed a stop string (several come at once
        with speculative decoding), with their logprobs."""
        if state.logprobs is not None:
            for token_id, position in zip(state.token_ids[num_kept:], state.logprobs[num_kept:]):
                state.cumulative_logprob -= position[token_id].logprob
            del state.logprobs[num_kept:]
        del state.token_ids[num_kept:]
        state.num_detokenized_tokens = min(state.num_detokenized_tokens, num_kept)

    @staticmethod
    def _detokenize(state: RequestState, finish_reason: str | None = None) -> str | None:
        """Feeds the detokenizer the tokens it has not seen; returns a matched stop string.

        ``finish_reason``: the core finished the request with this step's tokens (flush, and a
        "stop" token is kept out of the text). Feeding the tokens of several steps at once gives
        the text that feeding them step by step gives: the detokenizer works token by token and
        flushes only at the end.
        """
        pending = state.token_ids[state.num_detokenized_tokens :]
        if not pending:
            return None
        state.num_detokenized_tokens = len(state.token_ids)
        return state.detokenizer.update(
            pending, is_finished=finish_reason is not None, is_stop_token=finish_reason == "stop"
        )

    def _to_positions(self, lists: LogprobsLists) -> list[PositionLogprobs]:
        positions = []
        for ids, values, rank in zip(lists.token_ids, lists.logprobs, lists.ranks):
            # Column 0 is the chosen token (its rank given), columns 1.. the top-N in rank order.
            position = {ids[0]: Logprob(values[0], rank, self.tokenizer.decode([ids[0]]))}
            for top_rank, (token_id, value) in enumerate(zip(ids[1:], values[1:]), start=1):
                position.setdefault(token_id, Logprob(value, top_rank, self.tokenizer.decode([token_id])))
            positions.append(position)
        return positions

    def _make_output(self, state: RequestState) -> RequestOutput | EmbeddingRequestOutput | None:
        if state.params.kind is RequestKind.EMBED:
            if state.finish_reason is None:
                return None
            embedding = EmbeddingOutput(state.pooling_output)
            return EmbeddingRequestOutput(state.request.request_id, state.prompt_token_ids, embedding)
        kind = state.params.output_kind
        finished = state.finish_reason is not None
        if not finished and (kind == RequestOutputKind.FINAL_ONLY or not self._is_stream_due(state)):
            return None
        state.num_streamed_tokens = len(state.token_ids)
        completion = self._make_completion(state, delta=kind == RequestOutputKind.DELTA)
        request = state.request
        request.completions[state.index] = completion
        request.num_finished += finished
        all_finished = request.num_finished == request.num_children
        if kind != RequestOutputKind.FINAL_ONLY:
            outputs = [completion]
        elif all_finished:
            outputs = [request.completions[i] for i in sorted(request.completions)]
        else:
            return None
        return RequestOutput(
            request_id=state.request.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            outputs=outputs,
            finished=all_finished,
            prompt_logprobs=state.prompt_logprobs,
            num_cached_tokens=state.num_cached_tokens,
            kv_transfer_params=state.kv_transfer_params,
        )

    def _is_stream_due(self, state: RequestState) -> bool:
        if self.stream_interval == 1:
            return True  # every step's output, token-less ones (prompt logprobs of a chunk) included
        num_new_tokens = len(state.token_ids) - state.num_streamed_tokens
        is_first_token = state.num_streamed_tokens == 0 and num_new_tokens > 0
        return is_first_token or num_new_tokens >= self.stream_interval

    def _make_completion(self, state: RequestState, delta: bool) -> CompletionOutput:
        finished = state.finish_reason is not None
        text = ""
        if state.detokenizer is not None:
            self._detokenize(state)  # the tokens still waiting (no stop strings: none can match)
            text = state.detokenizer.get_next_output_text(finished, delta)
        if delta:
            token_ids = state.token_ids[state.num_sent_tokens :]
            logprobs = state.logprobs[state.num_sent_tokens :] if state.logprobs is not None else None
            state.num_sent_tokens = len(state.token_ids)
        else:
            token_ids, logprobs = list(state.token_ids), state.logprobs
        return CompletionOutput(
            index=state.index,
            text=text,
            token_ids=token_ids,
            cumulative_logprob=state.cumulative_logprob,
            logprobs=logprobs,
            finish_reason=state.finish_reason,
            stop_reason=state.stop_reason,
        )
