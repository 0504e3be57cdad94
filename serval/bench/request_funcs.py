"""One request of ``serval bench serve``, timed: the OpenAI completions and chat-completions backends, streamed,
and the embeddings backend, not (vLLM's ``--backend openai``, ``openai-chat`` and ``openai-embeddings``, its
``benchmarks/lib/endpoint_request_func.py``).

Times are seconds since the benchmark started. A request's first token is its first streamed chunk that
carries generated output; an embedding's is its whole response (as vLLM times it: its TTFT is its latency,
it has no output tokens). Failures (HTTP errors, error events, broken streams) are results, never raised.
"""

from __future__ import annotations

import asyncio
import enum
import json
import time
from dataclasses import dataclass, field

from serval.bench.datasets import SampleRequest
from serval.bench.report import RequestResult


class Backend(enum.Enum):
    """An OpenAI API the benchmark calls; the value is vLLM's ``--backend`` name."""

    OPENAI = "openai"
    OPENAI_CHAT = "openai-chat"
    OPENAI_EMBEDDINGS = "openai-embeddings"

    @property
    def default_endpoint(self) -> str:
        return "/v1/" + self.endpoint_suffix

    @property
    def endpoint_suffix(self) -> str:
        """What an endpoint of this backend's API ends with (vLLM checks the same)."""
        return {"openai": "completions", "openai-chat": "chat/completions", "openai-embeddings": "embeddings"}[
            self.value
        ]

    @property
    def streams(self) -> bool:
        """Whether its requests stream tokens (an embeddings request is answered whole)."""
        return self is not Backend.OPENAI_EMBEDDINGS

    def body(self, prompt: str | list[int], output_len: int) -> dict:
        """The request body's prompt and length fields; a chat prompt is one user message of text; an
        embeddings input has no output length."""
        if self is Backend.OPENAI:
            return {"prompt": prompt, "max_tokens": output_len}
        if self is Backend.OPENAI_EMBEDDINGS:
            return {"input": prompt}
        return {"messages": [{"role": "user", "content": prompt}], "max_completion_tokens": output_len}

    def carries_output(self, choice: dict) -> bool:
        """Whether a streamed choice carries generated output: any completions chunk (its text may be empty,
        half a character); a chat delta with content or tool calls (not the opening role-only delta)."""
        if self is Backend.OPENAI:
            return True
        delta = choice.get("delta") or {}
        return bool(delta.get("content") or delta.get("tool_calls") or delta.get("reasoning_content"))


@dataclass
class RequestSender:
    """Sends one streamed request to ``api_url`` and times it; at most ``max_concurrency`` at once.

    ``sampling`` holds the optional sampling fields sent in every body (``temperature``, ``top_p``, ...);
    ``ignore_eos`` is sent only when true, as vLLM does.
    """

    backend: Backend
    api_url: str
    model: str
    headers: dict[str, str] = field(default_factory=dict)
    ignore_eos: bool = False
    sampling: dict[str, float] = field(default_factory=dict)
    max_concurrency: int | None = None

    def __post_init__(self) -> None:
        self.semaphore = asyncio.Semaphore(self.max_concurrency) if self.max_concurrency else None

    def payload(self, request: SampleRequest) -> dict:
        """The body; an embeddings request's is its model and input only (it samples nothing)."""
        body = {"model": self.model, **self.backend.body(request.prompt, request.expected_output_len)}
        if not self.backend.streams:
            return body
        payload = {**body, "stream": True, "stream_options": {"include_usage": True}, **self.sampling}
        if self.ignore_eos:
            payload["ignore_eos"] = True
        return payload

    async def send(self, client, request: SampleRequest, benchmark_start: float) -> RequestResult:
        """The request's result, times in seconds since ``benchmark_start``; failures are results too."""
        call = self._stream if self.backend.streams else self._post
        if self.semaphore is None:
            return await call(client, request, benchmark_start)
        async with self.semaphore:
            return await call(client, request, benchmark_start)

    async def _post(self, client, request: SampleRequest, benchmark_start: float) -> RequestResult:
        """A request answered whole (embeddings): its one "chunk" is the response, its input the server's count."""
        import httpx

        result = RequestResult(
            prompt_len=request.prompt_len, start_time=time.perf_counter() - benchmark_start, end_time=0.0
        )
        try:
            response = await client.post(self.api_url, json=self.payload(request), headers=self.headers)
            body = response.json()
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {error_message(body)}"
            else:
                result.num_prompt_tokens = body["usage"]["prompt_tokens"]
        except httpx.HTTPError as exc:
            result.error = f"{type(exc).__name__}: {exc}"
        except (ValueError, KeyError, TypeError) as exc:  # a body that is not the API's
            result.error = f"malformed response: {exc!r}"
        result.end_time = time.perf_counter() - benchmark_start
        result.chunk_times.append(result.end_time)
        return result

    async def _stream(self, client, request: SampleRequest, benchmark_start: float) -> RequestResult:
        import httpx

        result = RequestResult(
            prompt_len=request.prompt_len, start_time=time.perf_counter() - benchmark_start, end_time=0.0
        )
        try:
            body = self.payload(request)
            async with client.stream("POST", self.api_url, json=body, headers=self.headers) as response:
                if response.status_code != 200:
                    result.error = f"HTTP {response.status_code}: {error_message(await response.aread())}"
                else:
                    await self._read_events(response, result, benchmark_start)
        except httpx.HTTPError as exc:
            result.error = f"{type(exc).__name__}: {exc}"
        except ValueError as exc:  # an event that is not JSON
            result.error = f"malformed stream: {exc}"
        result.end_time = time.perf_counter() - benchmark_start
        if result.error is None and not result.chunk_times:
            result.error = "the stream ended without any token"
        return result

    async def _read_events(self, response, result: RequestResult, benchmark_start: float) -> None:
        """Reads the SSE stream into ``result``: chunk times, token counts, or the error event's message."""
        async for line in response.aiter_lines():
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            event = json.loads(line[5:])
            if "error" in event:
                result.error = error_message(event)
                return
            if any(self.backend.carries_output(choice) for choice in event.get("choices") or []):
                result.chunk_times.append(time.perf_counter() - benchmark_start)
            if event.get("usage"):
                result.num_prompt_tokens = event["usage"].get("prompt_tokens")
                result.num_output_tokens = event["usage"].get("completion_tokens") or 0
        if result.num_output_tokens == 0:
            # No usage chunk: each chunk carries at least one token (a lower bound when the server batches them).
            result.num_output_tokens = len(result.chunk_times)


def error_message(body: bytes | dict) -> str:
    """The message of an OpenAI error body (``{"error": {"message": ...}}``), else the body itself, cut short."""
    if isinstance(body, bytes):
        try:
            body = json.loads(body)
        except ValueError:
            return body.decode(errors="replace")[:500]
    error = body.get("error", body) if isinstance(body, dict) else body
    if isinstance(error, dict) and "message" in error:
        return str(error["message"])
    return str(error)[:500]
