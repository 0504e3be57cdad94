"""``serval bench latency``: the latency of one batch through the in-process engine, as ``vllm bench latency``.

One batch of ``--batch-size`` prompts of ``--input-len`` random ordinary tokens, each generating
exactly ``--output-len`` tokens (greedy, ``ignore_eos``), goes through ``engine.LLM.generate``
``--num-iters-warmup`` untimed and ``--num-iters`` timed times; a latency is one whole call.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from serval.bench.report import percentile
from serval.bench.throughput import add_engine_arguments, build_llm

SUMMARY = "latency of one batch through the in-process engine, over repeated runs (vllm bench latency)"

PERCENTAGES = (10, 25, 50, 75, 90, 99)


@dataclass
class LatencyResult:
    latencies: list[float]

    def to_dict(self) -> dict:
        """vLLM's JSON: ``avg_latency``, ``latencies`` and ``percentiles`` (percentage -> seconds)."""
        ordered = sorted(self.latencies)
        return {
            "avg_latency": sum(ordered) / len(ordered),
            "latencies": self.latencies,
            "percentiles": {str(percentage): percentile(ordered, percentage) for percentage in PERCENTAGES},
        }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_arguments(parser)
    parser.add_argument("--input-len", type=int, default=32, help="prompt tokens per request")
    parser.add_argument("--output-len", type=int, default=128, help="generated tokens per request")
    parser.add_argument("--batch-size", type=int, default=8, help="requests in the batch")
    parser.add_argument("--num-iters-warmup", type=int, default=1, help="untimed runs first")
    parser.add_argument("--num-iters", type=int, default=5, help="timed runs")
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompts and the engine")
    parser.add_argument("--output-json", metavar="PATH", help="write the results to this JSON file")
    parser.add_argument(
        "--plot", action="store_true", help="also write a latency histogram PNG beside --output-json (same name, .png)"
    )


def run(args: argparse.Namespace) -> int:
    if min(args.input_len, args.output_len, args.batch_size, args.num_iters) < 1 or args.num_iters_warmup < 0:
        print(
            "serval bench latency: --input-len, --output-len, --batch-size and --num-iters must be at least 1, "
            "--num-iters-warmup at least 0",
            file=sys.stderr,
        )
        return 1
    if args.plot and not args.output_json:
        print("serval bench latency: --plot needs --output-json", file=sys.stderr)
        return 1
    try:
        result = LatencyResult(_benchmark(args))
    except ValueError as error:
        print(f"serval bench latency: {error}", file=sys.stderr)
        return 1
    metrics = result.to_dict()
    print(f"Avg latency: {metrics['avg_latency']} seconds")
    for percentage, value in metrics["percentiles"].items():
        print(f"{percentage}% percentile latency: {value} seconds")
    if args.output_json:
        with open(args.output_json, "w", encoding="utf-8") as f:
            json.dump(metrics, f, indent=4)
    if args.plot:
        plot_latency_histogram(result.latencies, Path(args.output_json).with_suffix(".png"))
    return 0


def _benchmark(args: argparse.Namespace) -> list[float]:
    from engine import SamplingParams
    from serval.bench.datasets import ordinary_token_ids

    llm = build_llm(args, seed=args.seed)
    try:
        token_ids = ordinary_token_ids(llm.get_tokenizer())
        rng = random.Random(args.seed)
        prompts = [{"prompt_token_ids": rng.choices(token_ids, k=args.input_len)} for _ in range(args.batch_size)]
        params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=args.output_len)
        measure_latencies(llm, prompts, params, args.num_iters_warmup, "Warmup iterations")
        return measure_latencies(llm, prompts, params, args.num_iters, "Profiling iterations")
    finally:
        llm.shutdown()


def measure_latencies(llm, prompts: list, params, num_iters: int, description: str) -> list[float]:
    """Seconds of each of ``num_iters`` ``llm.generate(prompts, params)`` calls, under a progress bar."""
    from tqdm import tqdm

    latencies = []
    for _ in tqdm(range(num_iters), desc=description):
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        latencies.append(time.perf_counter() - start)
    return latencies


def plot_latency_histogram(latencies: list[float], path: Path) -> None:
    """A histogram of ``latencies`` with the median and p99 marked, saved as a PNG at ``path``."""
    # The Agg canvas directly, as serval.bench.plots does: no display, no pyplot global state.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(7, 4), dpi=100)
    canvas = FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    axes.hist(latencies, bins=min(len(latencies), 30))
    ordered = sorted(latencies)
    for percentage, style in ((50, "--"), (99, ":")):
        axes.axvline(percentile(ordered, percentage), color="black", linestyle=style, label=f"p{percentage}")
    axes.set(xlabel="batch latency (s)", ylabel="runs", title=f"{len(latencies)} runs")
    axes.legend()
    figure.tight_layout()
    canvas.print_png(str(path))
