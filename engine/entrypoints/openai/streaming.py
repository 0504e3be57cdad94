"""Merging the engine's output streams of one HTTP request, and SSE framing.

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
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence

from pydantic import BaseModel

from engine.entrypoints.openai.errors import ErrorResponse, from_exception
from engine.request_output import RequestOutput

DONE_EVENT = "data: [DONE]\n\n"

# Put on the queue by a drain task whose generator finished.
_EXHAUSTED = object()


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
    batches: AsyncIterator[list[tuple[int, RequestOutput]]],
    format_batch: Callable[[list[tuple[int, RequestOutput]]], str],
    format_end: Callable[[], str],
) -> AsyncIterator[ErrorResponse | str]:
    """A streamed response's items: SSE strings, or one ErrorResponse if nothing was sent yet.

    ``format_batch`` turns a batch into events (maybe none); ``format_end``
    gives the closing events (the usage chunk) before ``[DONE]``. An error
    after the first event goes out as a final ``data: {"error": ...}`` event.
    """
    is_started = False
    async with contextlib.aclosing(batches):
        try:
            async for batch in batches:
                events = format_batch(batch)
                if events:
                    is_started = True
                    yield events
            closing = format_end()
        except Exception as exc:  # noqa: BLE001 - every failure becomes an OpenAI error
            error = from_exception(exc)
            if is_started:
                yield sse_event(error.body()) + DONE_EVENT
            else:
                yield error
            return
    yield closing + DONE_EVENT
