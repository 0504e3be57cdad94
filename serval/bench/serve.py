"""``serval bench serve``: load an OpenAI-compatible endpoint the way ``vllm bench serve`` does, with its flags.

Requests from a dataset (:mod:`serval.bench.datasets`) arrive as a Poisson or gamma process
(``--request-rate``, ``--burstiness``), at most ``--max-concurrency`` in flight; each is one streamed
request of ``--backend`` (:mod:`serval.bench.request_funcs`: ``openai`` completions or ``openai-chat``), or one
``openai-embeddings`` request answered whole (its latency only: ``--percentile-metrics`` defaults to e2el).
Per request it records the time to the first token, the gaps between streamed chunks and the end-to-end
latency; the report (:mod:`serval.bench.report`) has vLLM's metrics and keys, goodput under
``--goodput``, and, with ``--save-detailed``, the per-request lists. With ``--save-result`` (or a
``--result-dir`` / ``--result-filename``) it writes the JSON with two PNG plots beside it. The flags are
:mod:`serval.bench.serve_args`'s.

    serval bench serve --base-url http://127.0.0.1:8000 --random-input-len 256 --random-output-len 64 \\
        --num-prompts 200 --request-rate 8 --goodput ttft:500 tpot:50 --save-result

The model is ``--model``, else the first card of ``GET /v1/models``. The tokenizer is ``--tokenizer``,
else ``--model`` when that is a directory, else the served model's checkpoint (``root`` of its card)
when that is a directory on this machine.
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
from dataclasses import replace
from pathlib import Path

from serval.bench import serve_args
from serval.bench.datasets import SampleRequest, sample_requests
from serval.bench.report import METRICS, PER_REQUEST_KEYS, RequestResult, build_report, format_summary
from serval.bench.request_funcs import Backend, RequestSender

SUMMARY = "load-test an OpenAI-compatible endpoint (vLLM's bench serve: its flags, datasets, result keys)"
add_arguments = serve_args.add_arguments


def run(args: argparse.Namespace) -> int:
    """Benchmark, write the JSON and plots when asked, print the summary. Exit code: 0 when every request
    succeeded, 1 when some failed, 2 when the settings cannot run (no model or tokenizer to find, an
    unusable dataset, a bad flag value)."""
    try:
        report = benchmark(args)
    except ValueError as exc:
        print(f"serval bench serve: error: {exc}", file=sys.stderr)
        return 2
    paths = write_results(report, args) if is_saving(args) else []
    print(format_summary(report))
    if report["first_errors"]:
        print("errors:\n" + "\n".join(f"  {error}" for error in report["first_errors"]))
    if paths:
        print("wrote:\n" + "\n".join(f"  {path}" for path in paths))
    return 0 if report["failed"] == 0 else 1


def benchmark(args: argparse.Namespace) -> dict:
    """Samples the dataset, runs the warm-ups and the measured load, and returns the full report (per-request
    lists included); writes nothing.

    Failed requests are counted and their errors kept in the report, never raised. Raises ``ValueError``
    for settings that cannot run (no model or tokenizer to find, an unusable dataset, a bad flag value).
    """
    from transformers import AutoTokenizer

    serve_args.parse_key_values(args.metadata, "--metadata")  # bad pairs fail before the load, not after
    sender = make_sender(args)  # checks the endpoint and headers before the (slow) model look-up
    model, path = resolve_model(args)
    sender = replace(sender, model=args.served_model_name or model)
    serve_args.apply_general_lengths(args)
    tokenizer = AutoTokenizer.from_pretrained(path)
    requests = sample_requests(args, tokenizer)
    if args.backend is Backend.OPENAI_CHAT:  # a chat message is text; its length is the server's count
        requests = [replace(request, prompt=as_text(request.prompt, tokenizer)) for request in requests]
    results, duration_s = asyncio.run(run_load(args, sender, requests))
    slos = dict(args.goodput) if args.goodput else None
    metrics = args.percentile_metrics or (list(METRICS) if args.backend.streams else ["e2el"])
    report = build_report(results, duration_s, args.metric_percentiles, metrics, slos)
    return {**run_settings(args, model, path, sender), **report}


def make_sender(args: argparse.Namespace) -> RequestSender:
    """The request sender of these flags, naming ``--model`` until :func:`resolve_model` has run."""
    return RequestSender(
        backend=args.backend,
        api_url=serve_args.api_url(args),
        model=args.served_model_name or args.model or "",
        headers=serve_args.request_headers(args),
        ignore_eos=serve_args.is_ignore_eos(args),
        sampling=serve_args.sampling_fields(args),
        max_concurrency=args.max_concurrency,
    )


def as_text(prompt: str | list[int], tokenizer) -> str:
    return prompt if isinstance(prompt, str) else tokenizer.decode(prompt)


def is_saving(args: argparse.Namespace) -> bool:
    return bool(args.save_result or args.result_dir or args.result_filename)


def write_results(report: dict, args: argparse.Namespace) -> list[Path]:
    """Writes the report as JSON (the per-request lists with ``--save-detailed`` only) and the two plots
    beside it; returns the paths."""
    from serval.bench.plots import plot_latency_cdfs, plot_throughput

    json_path = result_path(args, report)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    saved = report if args.save_detailed else {k: v for k, v in report.items() if k not in PER_REQUEST_KEYS}
    json_path.write_text(json.dumps(saved, indent=1))
    cdf_path = json_path.with_name(f"{json_path.stem}-latency-cdf.png")
    throughput_path = json_path.with_name(f"{json_path.stem}-throughput.png")
    plot_latency_cdfs(report, cdf_path)
    plot_throughput(report, throughput_path)
    return [json_path, cdf_path, throughput_path]


def result_path(args: argparse.Namespace, report: dict) -> Path:
    """``--result-dir`` / ``--result-filename``, else vLLM's name
    ``{label}-{request_rate}qps[-concurrency{N}]-{model basename}-{date}.json`` in the current directory."""
    concurrency = f"-concurrency{args.max_concurrency}" if args.max_concurrency is not None else ""
    model_name = report["model_id"].split("/")[-1]
    default_name = f"{report['label']}-{args.request_rate}qps{concurrency}-{model_name}-{report['date']}.json"
    return Path(args.result_dir or ".") / (args.result_filename or default_name)


def resolve_model(args: argparse.Namespace) -> tuple[str, str]:
    """(the model id requests name, the local tokenizer dir). The model is ``--model``, else the first card of
    ``GET /v1/models``; the tokenizer ``--tokenizer``, else ``--model`` when that is a dir, else the root of
    the model's card when that is a dir here. Raises ``ValueError`` when one cannot be found."""
    if args.tokenizer or (args.model and os.path.isdir(args.model)):
        path = args.tokenizer or args.model
        if not os.path.isdir(path):
            raise ValueError(f"no local tokenizer at {path!r}: pass --tokenizer DIR")
        return args.model or served_models(args)[0]["id"], path
    cards = served_models(args)
    model = args.model or cards[0]["id"]
    roots = [str(card["root"]) for card in cards if card.get("id") == model and card.get("root")]
    if not roots:
        served = ", ".join(str(card.get("id")) for card in cards)
        raise ValueError(
            f"{serve_args.base_url(args)}/v1/models has no card with a root for {model!r} (served: {served}): "
            "pass --tokenizer DIR"
        )
    if not os.path.isdir(roots[0]):
        raise ValueError(f"{model!r} is served from {roots[0]!r}, which is not a directory here: pass --tokenizer DIR")
    return model, roots[0]


def served_models(args: argparse.Namespace) -> list[dict]:
    """The model cards of ``GET {base}/v1/models`` (at least one); ``ValueError`` when it cannot say."""
    import httpx

    url = f"{serve_args.base_url(args)}/v1/models"
    try:
        response = httpx.get(url, headers=serve_args.request_headers(args), timeout=min(args.request_timeout, 30.0))
        response.raise_for_status()
        cards = [card for card in response.json().get("data", []) if isinstance(card, dict) and "id" in card]
    except (httpx.HTTPError, ValueError, AttributeError) as exc:
        raise ValueError(f"{url} could not be read ({exc}): pass --model and --tokenizer DIR") from None
    if not cards:
        raise ValueError(f"{url} lists no model: is the server's app running?")
    return cards


def run_settings(args: argparse.Namespace, model: str, tokenizer_path: str, sender: RequestSender) -> dict:
    """What the run was, for the JSON record: vLLM's keys, then ``--metadata``'s pairs."""
    return {
        "date": time.strftime("%Y%m%d-%H%M%S"),
        "endpoint_type": args.backend.value,
        "backend": args.backend.value,
        "label": args.label or args.backend.value,
        "base_url": serve_args.base_url(args),
        "api_url": sender.api_url,
        "model_id": model,
        "tokenizer_id": tokenizer_path,
        "dataset_name": args.dataset_name,
        "num_prompts": args.num_prompts,
        "seed": args.seed,
        # JSON has no infinity; vLLM records an unbounded rate as "inf" too.
        "request_rate": args.request_rate if math.isfinite(args.request_rate) else "inf",
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
        "ignore_eos": sender.ignore_eos,
        "sampling_params": sender.sampling,
        **serve_args.parse_key_values(args.metadata, "--metadata"),
    }


async def run_load(
    args: argparse.Namespace, sender: RequestSender, requests: list[SampleRequest]
) -> tuple[list[RequestResult], float]:
    """Warm-ups, then every request at its arrival time; returns the results in send order and the duration."""
    import httpx
    from tqdm import tqdm

    arrival_times = arrival_offsets(len(requests), args.request_rate, args.burstiness, random.Random(args.seed))
    # Without a concurrency cap every request may be in flight at once: the pool must not queue them.
    num_connections = args.max_concurrency or None
    limits = httpx.Limits(max_connections=num_connections, max_keepalive_connections=num_connections)
    async with httpx.AsyncClient(timeout=args.request_timeout, limits=limits) as client:
        warmups = [requests[index % len(requests)] for index in range(args.num_warmups)]
        await asyncio.gather(*(sender.send(client, request, time.perf_counter()) for request in warmups))
        with tqdm(total=len(requests), disable=args.disable_tqdm, desc="requests") as progress:
            return await _measured_run(client, sender, requests, arrival_times, progress)


async def _measured_run(
    client, sender: RequestSender, requests: list[SampleRequest], arrival_times: list[float], progress
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
