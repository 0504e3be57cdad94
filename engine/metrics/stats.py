"""What one engine step tells about latency, as vLLM users know it.

Times are ``time.monotonic()`` seconds (the scheduler stamps a request's
first admission with the same clock). Per request the front end keeps a
``RequestTimes``; each step fills one ``IterationStats``:

* time to first token (TTFT): arrival -> the step that returned the first token;
* inter-token latency (ITL): between two steps that returned tokens of one request;
* at finish, a ``FinishedRequestStats``: end-to-end latency (arrival -> last
  token), queue time (arrival -> first admitted), prefill time (admitted ->
  first token), decode time (first -> last token), inference time (admitted ->
  last token), and time per output token (decode time / (tokens - 1)).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class RequestTimes:
    """One request's milestones (monotonic seconds), filled as its outputs arrive."""

    arrival_time: float
    num_prompt_tokens: int
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    num_generation_tokens: int = 0


@dataclass(frozen=True)
class FinishedRequestStats:
    finish_reason: str
    num_prompt_tokens: int
    num_generation_tokens: int
    e2e_latency_s: float
    queued_time_s: float
    prefill_time_s: float
    decode_time_s: float
    inference_time_s: float
    mean_time_per_output_token_s: float


@dataclass
class IterationStats:
    """One step's token counts and latencies; ``now`` is the step's completion time.

    ``num_generation_tokens`` and ``num_finished_reqs`` count every request; the
    rest only those that keep latency statistics (a ``RequestTimes``).
    """

    now: float = field(default_factory=time.monotonic)
    num_prompt_tokens: int = 0  # prompts whose first token came this step
    num_generation_tokens: int = 0
    num_finished_reqs: int = 0  # user requests that ended this step (n > 1: once, with its last completion)
    time_to_first_tokens_s: list[float] = field(default_factory=list)
    inter_token_latencies_s: list[float] = field(default_factory=list)
    finished_requests: list[FinishedRequestStats] = field(default_factory=list)
    kv_load_latencies_s: list[float] = field(default_factory=list)  # remote KV loads (disaggregated prefill)

    def record_tokens(
        self, times: RequestTimes | None, num_new_tokens: int, first_scheduled_time: float | None, pooled: bool = False
    ) -> None:
        """A step's output for one request (``num_new_tokens`` may be 0: prompt logprobs of a chunk).
        ``pooled``: it is a pooling request's vector, its first and only output (as vLLM counts it: its prompt
        is counted then, and the time to it is its time to first token).

        With ``times`` None (the request keeps no latency statistics) only the tokens are counted.
        """
        self.num_generation_tokens += num_new_tokens
        if times is None:
            return
        if times.first_scheduled_time is None:
            times.first_scheduled_time = first_scheduled_time
        if num_new_tokens == 0 and not pooled:
            return
        if times.first_token_time is None:
            self.num_prompt_tokens += times.num_prompt_tokens
            self.time_to_first_tokens_s.append(self.now - times.arrival_time)
            times.first_token_time = self.now
        else:
            self.inter_token_latencies_s.append(self.now - times.last_token_time)
        times.last_token_time = self.now
        times.num_generation_tokens += num_new_tokens

    def record_finished(self, times: RequestTimes, finish_reason: str) -> None:
        """The request ended this step; milestones it never reached count as zero-length phases."""
        scheduled = times.first_scheduled_time if times.first_scheduled_time is not None else self.now
        first_token = times.first_token_time if times.first_token_time is not None else self.now
        last_token = times.last_token_time if times.last_token_time is not None else self.now
        decode_time = last_token - first_token
        num_tokens = times.num_generation_tokens
        self.finished_requests.append(
            FinishedRequestStats(
                finish_reason=finish_reason,
                num_prompt_tokens=times.num_prompt_tokens,
                num_generation_tokens=num_tokens,
                e2e_latency_s=last_token - times.arrival_time,
                queued_time_s=scheduled - times.arrival_time,
                prefill_time_s=first_token - scheduled,
                decode_time_s=decode_time,
                inference_time_s=last_token - scheduled,
                mean_time_per_output_token_s=decode_time / (num_tokens - 1) if num_tokens > 1 else 0.0,
            )
        )
