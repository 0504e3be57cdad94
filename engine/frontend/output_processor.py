"""Turns the core's token-level outputs into user-facing RequestOutputs.

Per request it keeps the detokenizer (text, stop strings), the logprobs
gathered so far and, for ``n`` > 1, the parent that joins the ``n`` child
completions. A stop string ends a request here, in the front end: its id is
returned so the caller aborts it in the core and the blocks are freed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.frontend.detokenizer import IncrementalDetokenizer
from engine.metrics.stats import IterationStats, RequestTimes
from engine.request_output import CompletionOutput, Logprob, PositionLogprobs, RequestOutput
from engine.sampling_params import RequestOutputKind, SamplingParams
from engine.sched.step_outputs import EngineCoreOutput, LogprobsLists


@dataclass
class ParentRequest:
    """Joins the ``n`` children of one user request."""

    request_id: str
    num_children: int
    completions: dict[int, CompletionOutput] = field(default_factory=dict)
    num_finished: int = 0


@dataclass
class RequestState:
    request_id: str  # the core's id (a child's id for n > 1)
    user_request_id: str
    index: int  # which of the n completions
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer | None
    parent: ParentRequest | None = None
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


class OutputProcessor:
    def __init__(self, tokenizer, stream_interval: int = 1) -> None:
        self.tokenizer = tokenizer
        # vLLM's stream_interval: a streamed (DELTA / CUMULATIVE) request gets an output for its first token,
        # then once per stream_interval new tokens, and at its end. Fewer, larger outputs cost the serving
        # path (detokenizing, SSE, every hop to the client) less per token.
        self.stream_interval = stream_interval
        self.states: dict[str, RequestState] = {}

    def add_request(
        self,
        request_id: str,
        user_request_id: str,
        index: int,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        parent: ParentRequest | None,
        arrival_time: float | None = None,
    ) -> None:
        """``arrival_time`` (time.monotonic()) turns on latency statistics for this request."""
        detokenizer = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params) if params.detokenize else None
        state = RequestState(request_id, user_request_id, index, prompt, prompt_token_ids, params, detokenizer, parent)
        if arrival_time is not None:
            state.times = RequestTimes(arrival_time, len(prompt_token_ids))
        if params.logprobs is not None:
            state.logprobs, state.cumulative_logprob = [], 0.0
        if params.prompt_logprobs is not None:
            state.prompt_logprobs = [None]  # the first prompt token has no context
        self.states[request_id] = state

    def has_unfinished_requests(self) -> bool:
        return bool(self.states)

    def abort(self, request_id: str) -> RequestState | None:
        return self.states.pop(request_id, None)

    def process_outputs(
        self, core_outputs: list[EngineCoreOutput], iteration_stats: IterationStats | None = None
    ) -> tuple[list[RequestOutput], list[str]]:
        """(outputs to deliver, ids the core must abort because a stop string ended them).

        With ``iteration_stats``, every request's new tokens are counted there, and the step's
        latencies of requests that keep statistics go there.
        """
        request_outputs: list[RequestOutput] = []
        to_abort: list[str] = []
        for core_output in core_outputs:
            state = self.states.get(core_output.request_id)
            if state is None:  # aborted by the user meanwhile
                continue
            if self._update(state, core_output):
                to_abort.append(state.request_id)
            if iteration_stats is not None:
                iteration_stats.record_tokens(
                    state.times, len(core_output.new_token_ids), core_output.first_scheduled_time
                )
                if state.finish_reason is not None and state.times is not None:
                    iteration_stats.record_finished(state.times, state.finish_reason)
            if state.finish_reason is not None:
                del self.states[state.request_id]
            request_output = self._make_output(state)
            if request_output is not None:
                request_outputs.append(request_output)
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

    def _make_output(self, state: RequestState) -> RequestOutput | None:
        kind = state.params.output_kind
        finished = state.finish_reason is not None
        if not finished and (kind == RequestOutputKind.FINAL_ONLY or not self._is_stream_due(state)):
            return None
        state.num_streamed_tokens = len(state.token_ids)
        completion = self._make_completion(state, delta=kind == RequestOutputKind.DELTA)
        parent = state.parent
        if parent is None:
            outputs, all_finished = [completion], finished
        else:
            parent.completions[state.index] = completion
            parent.num_finished += finished
            all_finished = parent.num_finished == parent.num_children
            if kind == RequestOutputKind.FINAL_ONLY:
                if not all_finished:
                    return None
                outputs = [parent.completions[i] for i in sorted(parent.completions)]
            else:
                outputs = [completion]
        return RequestOutput(
            request_id=state.user_request_id,
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
