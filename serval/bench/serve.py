"""``serval bench serve``: load an OpenAI-compatible endpoint the way ``vllm bench serve`` does.

Requests from a dataset (:mod:`serval.bench.datasets`) arrive as a Poisson or gamma process
(``--request-rate``, ``--burstiness``), at most ``--max-concurrency`` in flight; each is a streamed
``POST {url}/v1/completions``. Per request it records the time to the first token, the gaps between
streamed chunks and the end-to-end latency; the report (:mod:`serval.bench.report`) has vLLM's metrics,
goodput under ``--slo``, and the raw per-request lists. Results go to a JSON file with two PNG plots
beside it.

    serval bench serve --url http://127.0.0.1:8000 --model smollm2-135m-instruct \\
        --random-input-len 256 --random-output-len 64 --num-prompts 200 --request-rate 8

The tokenizer is ``--tokenizer``, else ``--model`` when that is a directory, else the served model's
checkpoint (``root`` of its card in ``GET /v1/models``) when that is a directory on this machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import time
from pathlib import Path

from serval.bench.datasets import SampleRequest, add_dataset_arguments, sample_requests
from serval.bench.report import RequestResult, build_report, format_summary, parse_percentiles, parse_slos

SUMMARY = "load-test an OpenAI-compatible endpoint (vLLM's bench serve: datasets, arrival rates, SLOs)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The endpoint, dataset, load, report and output flags of ``serval bench serve``."""
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="Base URL; requests go to {url}/v1/completions.")
    parser.add_argument("--model", required=True, help="The served model id (a local dir also names the tokenizer).")
    parser.add_argument(
        "--tokenizer",
        help="Local Hugging Face tokenizer dir (default: --model if a dir, else its root in /v1/models).",
    )
    parser.add_argument("--api-key", help="Sent as 'Authorization: Bearer KEY'.")
    add_dataset_arguments(parser)
    _add_load_arguments(parser.add_argument_group("load"))
    _add_report_arguments(parser.add_argument_group("report"))


def _add_load_arguments(load) -> None:
    load.add_argument(
        "--request-rate", type=float, default=math.inf, help="Requests per second (default inf: all at once)."
    )
    load.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="Gamma shape of the arrival intervals: 1 is Poisson, < 1 burstier, > 1 steadier.",
    )
    load.add_argument("--max-concurrency", type=int, default=None, help="At most this many requests in flight.")
    load.add_argument("--num-warmups", type=int, default=0, help="Requests sent (and not counted) before the run.")
    load.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Generate exactly each request's output length (--no-ignore-eos: stop at EOS).",
    )
    load.add_argument("--temperature", type=float, default=0.0)
    load.add_argument(
        "--request-timeout",
        type=float,
        default=600.0,
        help="Seconds to wait on a connection or between streamed chunks before a request fails.",
    )


def _add_report_arguments(report) -> None:
    report.add_argument(
        "--percentiles",
        type=parse_percentiles,
        default=[50.0, 90.0, 99.0],
        help="Comma-separated latency percentiles (default 50,90,99).",
    )
    report.add_argument(
        "--slo", type=parse_slos, default=None, help="Latency SLOs in ms for goodput, e.g. ttft=500,tpot=50,e2el=10000."
    )
    report.add_argument("--result-dir", default="results")
    report.add_argument("--result-filename", help="Default: serve-{model basename}-{timestamp}.json.")
    report.add_argument("--disable-tqdm", action="store_true", help="No progress bar.")


def run(args: argparse.Namespace) -> int:
    """Benchmark, write the JSON and plots, print the summary. Exit code: 0 when every request succeeded,
    1 when some failed, 2 when the settings cannot run (no local tokenizer, an unusable dataset)."""
    try:
        report = benchmark(args)
    except ValueError as exc:  # bad settings: no tokenizer, unusable dataset
        print(f"serval bench serve: error: {exc}", file=sys.stderr)
        return 2
    paths = write_results(report, args)
    print(format_summary(report))
    if report["errors"]:
        print("errors:\n" + "\n".join(f"  {error}" for error in report["errors"]))
    print("wrote:\n" + "\n".join(f"  {path}" for path in paths))
    return 0 if report["failed"] == 0 else 1


def benchmark(args: argparse.Namespace) -> dict:
    """Samples the dataset, runs the warm-ups and the measured load, and returns the report; writes nothing.

    Failed requests are counted and their errors kept in the report, never raised. Raises ``ValueError``
    for settings that cannot run (no local tokenizer, an unusable dataset).
    """
    path = tokenizer_path(args)
    from transformers import AutoTokenizer

    requests = sample_requests(args, AutoTokenizer.from_pretrained(path))
    results, duration_s = asyncio.run(run_load(args, requests))
    report = build_report(results, duration_s, args.percentiles, args.slo)
    report.update(run_settings(args), tokenizer_id=path)
    return report


def write_results(report: dict, args: argparse.Namespace) -> list[Path]:
    """Writes the report as JSON under ``args.result_dir`` and the two plots beside it; returns the paths."""
    from serval.bench.plots import plot_latency_cdfs, plot_throughput

    result_dir = Path(args.result_dir)
    result_dir.mkdir(parents=True, exist_ok=True)
    json_path = result_dir / (args.result_filename or default_filename(args.model))
    json_path.write_text(json.dumps(report, indent=1))
    cdf_path = json_path.with_name(f"{json_path.stem}-latency-cdf.png")
    throughput_path = json_path.with_name(f"{json_path.stem}-throughput.png")
    plot_latency_cdfs(report, cdf_path)
    plot_throughput(report, throughput_path)
    return [json_path, cdf_path, throughput_path]


def default_filename(model: str) -> str:
    return f"serve-{Path(model).name}-{time.strftime('%Y%m%d-%H%M%S')}.json"


def tokenizer_path(args: argparse.Namespace) -> str:
    """The local tokenizer dir: ``--tokenizer``, else ``--model`` when that is a dir, else the ``root`` of the
    served model's card (``GET {url}/v1/models``) when that is a dir here. Raises ``ValueError`` otherwise."""
    if args.tokenizer or os.path.isdir(args.model):
        path = args.tokenizer or args.model
        if not os.path.isdir(path):
            raise ValueError(f"no local tokenizer at {path!r}: pass --tokenizer DIR")
        return path
    root = served_model_root(args)
    if not os.path.isdir(root):
        raise ValueError(f"{args.model!r} is served from {root!r}, which is not a directory here: pass --tokenizer DIR")
    return root


def served_model_root(args: argparse.Namespace) -> str:
    """The ``root`` (checkpoint path) of ``--model``'s card at ``{url}/v1/models``; ``ValueError`` when the
    endpoint cannot say."""
    import httpx

    url = f"{args.url.rstrip('/')}/v1/models"
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    try:
        response = httpx.get(url, headers=headers, timeout=min(args.request_timeout, 30.0))
        response.raise_for_status()
        cards = response.json().get("data", [])
    except (httpx.HTTPError, ValueError, AttributeError) as exc:
        raise ValueError(
            f"{args.model!r} is not a local dir and {url} could not be read ({exc}): pass --tokenizer DIR"
        ) from None
    for card in cards:
        if card.get("id") == args.model and card.get("root"):
            return str(card["root"])
    served = ", ".join(str(card.get("id")) for card in cards) or "none"
    raise ValueError(f"{url} has no card with a root for {args.model!r} (served: {served}): pass --tokenizer DIR")


def run_settings(args: argparse.Namespace) -> dict:
    """What the run was, for the JSON record (vLLM's keys where it has them)."""
    return {
        "date": time.strftime("%Y%m%d-%H%M%S"),
        "url": args.url,
        "model_id": args.model,
        "tokenizer_id": args.tokenizer or args.model,
        "dataset_name": args.dataset_name,
        "num_prompts": args.num_prompts,
        "seed": args.seed,
        # JSON has no infinity; vLLM records an unbounded rate as "inf" too.
        "request_rate": args.request_rate if math.isfinite(args.request_rate) else "inf",
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
        "ignore_eos": args.ignore_eos,
        "temperature": args.temperature,
    }


async def run_load(args: argparse.Namespace, requests: list[SampleRequest]) -> tuple[list[RequestResult], float]:
    """Warm-ups, then every request at its arrival time; returns the results in send order and the duration."""
    import httpx
    from tqdm import tqdm

    arrival_times = arrival_offsets(len(requests), args.request_rate, args.burstiness, random.Random(args.seed))
    # Without a concurrency cap every request may be in flight at once: the pool must not queue them.
    num_connections = args.max_concurrency or None
    limits = httpx.Limits(max_connections=num_connections, max_keepalive_connections=num_connections)
    sender = CompletionSender(args)
    async with httpx.AsyncClient(timeout=args.request_timeout, limits=limits) as client:
        warmups = [requests[index % len(requests)] for index in range(args.num_warmups)]
        await asyncio.gather(*(sender.send(client, request, time.perf_counter()) for request in warmups))
        with tqdm(total=len(requests), disable=args.disable_tqdm, desc="requests") as progress:
            return await _measured_run(client, sender, requests, arrival_times, progress)


async def _measured_run(
    client, sender: CompletionSender, requests: list[SampleRequest], arrival_times: list[float], progress
) -> tuple[list[RequestResult], float]:
    start = time.perf_counter()

    async def send_one(request: SampleRequest) -> RequestResult:
        result = await sender.send(client, request, start)
        progress.update(1)
        return result

    tasks = []
    for request, arrival_time in zip(requests, arrival_times):
        delay = start + arrival_time - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(send_one(request)))
    results = await asyncio.gather(*tasks)
    return list(results), time.perf_counter() - start


def arrival_offsets(num_requests: int, request_rate: float, burstiness: float, rng: random.Random) -> list[float]:
    """Seconds from the start at which each request is sent: all at 0 for an infinite rate, else the
    cumulative sums of Gamma(shape=burstiness, scale=1/(rate*burstiness)) intervals (mean 1/rate)."""
    if math.isinf(request_rate):
        return [0.0] * num_requests
    if request_rate <= 0 or burstiness <= 0:
        raise ValueError(f"--request-rate and --burstiness must be positive, got {request_rate}, {burstiness}")
    scale = 1.0 / (request_rate * burstiness)
    offsets, offset = [], 0.0
    for _ in range(num_requests):
        offsets.append(offset)  # the first request goes out at once, as in vLLM
        offset += rng.gammavariate(burstiness, scale)
    return offsets


class CompletionSender:
    """Sends one streamed completion and times it; at most ``--max-concurrency`` at once."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.url = f"{args.url.rstrip('/')}/v1/completions"
        self.headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        self.model = args.model
        self.ignore_eos = args.ignore_eos
        self.temperature = args.temperature
        self.semaphore = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None

    def payload(self, request: SampleRequest) -> dict:
        return {
            "model": self.model,
            "prompt": request.prompt,
            "max_tokens": request.expected_output_len,
            "temperature": self.temperature,
            "ignore_eos": self.ignore_eos,
            "stream": True,
            "stream_options": {"include_usage": True},
        }

    async def send(self, client, request: SampleRequest, benchmark_start: float) -> RequestResult:
        """The request's result, times in seconds since ``benchmark_start``; failures are results too."""
        if self.semaphore is None:
            return await self._stream(client, request, benchmark_start)
        async with self.semaphore:
            return await self._stream(client, request, benchmark_start)

    async def _stream(self, client, request: SampleRequest, benchmark_start: float) -> RequestResult:
        import httpx

        result = RequestResult(
            prompt_len=request.prompt_len, start_time=time.perf_counter() - benchmark_start, end_time=0.0
        )
        try:
            async with client.stream("POST", self.url, json=self.payload(request), headers=self.headers) as response:
                if response.status_code != 200:
                    result.error = f"HTTP {response.status_code}: {error_message(await response.aread())}"
                else:
                    await _read_events(response, result, benchmark_start)
        except httpx.HTTPError as exc:
            result.error = f"{type(exc).__name__}: {exc}"
        except ValueError as exc:  # an event that is not JSON
            result.error = f"malformed stream: {exc}"
        result.end_time = time.perf_counter() - benchmark_start
        if result.error is None and not result.chunk_times:
            result.error = "the stream ended without any token"
        return result


async def _read_events(response, result: RequestResult, benchmark_start: float) -> None:
    """Reads the SSE stream into ``result``: chunk times, token counts, or the error event's message."""
    async for line in response.aiter_lines():
        if not line.startswith("data:") or line[5:].strip() == "[DONE]":
            continue
        event = json.loads(line[5:])
        if "error" in event:
            result.error = error_message(event)
            return
        if event.get("choices"):  # a chunk of tokens (its text may be empty: half a character)
            result.chunk_times.append(time.perf_counter() - benchmark_start)
        if event.get("usage"):
            result.num_prompt_tokens = event["usage"].get("prompt_tokens")
            result.num_output_tokens = event["usage"].get("completion_tokens", 0)
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
