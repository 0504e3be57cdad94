"""Merging the engine's output streams of one HTTP request, and SSE framing (``SSEChunk``).

A batched completions request runs one engine request per prompt; its
outputs arrive on several async generators. :func:`merge_streams` drains
each on its own task into one queue and hands the consumer everything that
arrived since it last asked, so a slow consumer gets fewer, larger batches
(streamed as one item) instead of falling behind one output at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Protocol

from pydantic import BaseModel

from engine.entrypoints.openai.continuation import StreamDelta, StreamProgress
from engine.entrypoints.openai.errors import ApiStyle, ErrorResponse, from_exception
from engine.request_output import RequestOutput

# Put on the queue by a drain task whose generator finished.
_EXHAUSTED = object()


@dataclass(frozen=True, slots=True)
class SSEChunk:
    """A streamed response's item: ``text``, one or more server-sent events (several joined when the engine
    is ahead of the consumer), sent to the client as is; the last of a stream ends with its ``ApiStyle.end``
    (OpenAI's ``[DONE]``).
    ``delta``: what the chunk carried, on a tracked stream only (``CallOptions.track``; request migration)."""

    text: str
    delta: StreamDelta | None = None


class ResponseStream(Protocol):
    """A streamed completion's or chat's per-request state, as ``stream_events`` drives it."""

    progress: StreamProgress | None  # set on a tracked stream: filled in by format_batch

    def format_batch(self, batch: list[tuple[int, RequestOutput]]) -> str:
        """The events of one batch (maybe none)."""

    def format_end(self) -> str:
        """The closing events (the usage chunk), before ``[DONE]``."""


def sse_event(payload: BaseModel | dict) -> str:
    """One server-sent event carrying ``payload`` as JSON."""
    if isinstance(payload, BaseModel):
        return f"data: {payload.model_dump_json()}\n\n"
    return f"data: {json.dumps(payload)}\n\n"


async def merge_streams(
    generators: Sequence[AsyncGenerator[RequestOutput, None]],
) -> AsyncIterator[list[tuple[int, RequestOutput]]]:
    """Yields batches of ``(generator index, output)`` until every generator is exhausted.

    The first batch waits until every generator has produced its first output,
    so an error any of them raises at the start (bad input, overload) comes
    before anything is yielded. The first exception a generator raises is
    re-raised here, after a batch of what arrived before it. Closing this
    iterator (or an exception) cancels the drain tasks, which closes every
    generator: the engine aborts their requests.
    """
    queue: asyncio.Queue = asyncio.Queue()
    tasks = [asyncio.create_task(_drain(index, generator, queue)) for index, generator in enumerate(generators)]
    try:
        num_running = len(tasks)
        awaiting_first = set(range(len(tasks)))
        batch: list[tuple[int, RequestOutput]] = []
        while num_running:
            error = None
            for index, item in await _get_all(queue):
                if isinstance(item, BaseException):
                    error = item
                    break
                awaiting_first.discard(index)
                if item is _EXHAUSTED:
                    num_running -= 1
                else:
                    batch.append((index, item))
            if batch and not awaiting_first:
                yield batch  # what arrived before an error still goes out
                batch = []
            if error is not None:
                raise error
    finally:
        for task in tasks:
            task.cancel()


async def _get_all(queue: asyncio.Queue) -> list:
    """Waits for one item, then takes everything else already queued."""
    items = [await queue.get()]
    while not queue.empty():
        items.append(queue.get_nowait())
    return items


async def _drain(index: int, generator: AsyncGenerator[RequestOutput, None], queue: asyncio.Queue) -> None:
    try:
        async with contextlib.aclosing(generator):
            async for output in generator:
                queue.put_nowait((index, output))
    except Exception as exc:  # noqa: BLE001 - handed to the consumer, which maps it to an HTTP error
        queue.put_nowait((index, exc))
        return
    queue.put_nowait((index, _EXHAUSTED))


async def collect_final_outputs(generators: Sequence[AsyncGenerator[RequestOutput, None]]) -> list[RequestOutput]:
    """The last output of each generator (its final one under ``FINAL_ONLY``), in order."""
    finals: list[RequestOutput | None] = [None] * len(generators)
    async with contextlib.aclosing(merge_streams(generators)) as batches:
        async for batch in batches:
            for index, output in batch:
                finals[index] = output
    return finals


async def stream_events(
    batches: AsyncIterator[list[tuple[int, RequestOutput]]], stream: ResponseStream, style: ApiStyle = ApiStyle.OPENAI
) -> AsyncIterator[ErrorResponse | SSEChunk]:
    """A streamed response's items: ``SSEChunk``\\ s, or one ErrorResponse if nothing was sent yet.

    ``stream.format_batch`` turns a batch into events (maybe none); ``stream.format_end`` gives the closing
    events (the usage chunk) before ``style.end`` (``[DONE]``). An error after the first event goes out as
    ``style.late_error`` (a final ``data: {"error": ...}`` event). On a tracked stream each chunk carries
    ``stream.progress.take()``.
    """

    def chunk(text: str) -> SSEChunk:
        return SSEChunk(text, None if stream.progress is None else stream.progress.take())

    is_started = False
    async with contextlib.aclosing(batches):
        try:
            async for batch in batches:
                events = stream.format_batch(batch)
                if events:
                    is_started = True
                    yield chunk(events)
            closing = stream.format_end()
        except Exception as exc:  # noqa: BLE001 - every failure becomes an OpenAI error
            error = from_exception(exc)
            if is_started:
                yield chunk(style.late_error(error))
            else:
                yield error
            return
    yield chunk(closing + style.end)
