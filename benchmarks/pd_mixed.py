"""A mixed workload for disaggregated versus colocated serving: a few long prompts arrive while many
short requests decode.

    python benchmarks/pd_mixed.py run --url http://127.0.0.1:8000 --model tiny-llama \\
        --tokenizer models/tiny-llama --out results/pd-mixed/colocated.json
    python benchmarks/pd_mixed.py report results/pd-mixed/colocated.json results/pd-mixed/disaggregated.json \\
        --plot docs/img/pd-mixed.png

Short requests (``--short-input-len`` / ``--short-output-len``) arrive as a Poisson process at
``--short-rate``; a long prompt (``--long-input-len``, ``--long-output-len`` tokens out) every
``--long-interval-s``. Every request streams; the report gives the short requests' inter-token
latency (what a long prefill stalls) and both classes' time to first token.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path

from serval.bench.datasets import SampleRequest, ordinary_token_ids
from serval.bench.report import RequestResult, percentile
from serval.bench.request_funcs import Backend, RequestSender
from serval.bench.serve import arrival_offsets


def make_requests(args: argparse.Namespace, token_ids: list[int]) -> list[tuple[float, str, SampleRequest]]:
    """(send time, class, request) for the whole run, in send order."""
    rng = random.Random(args.seed)

    def request(input_len: int, output_len: int) -> SampleRequest:
        return SampleRequest([rng.choice(token_ids) for _ in range(input_len)], input_len, output_len)

    num_short = int(args.duration_s * args.short_rate)
    schedule = [
        (offset, "short", request(args.short_input_len, args.short_output_len))
        for offset in arrival_offsets(num_short, args.short_rate, 1.0, rng)
    ]
    num_long = int(args.duration_s / args.long_interval_s)
    schedule += [
        (args.long_interval_s * (index + 0.5), "long", request(args.long_input_len, args.long_output_len))
        for index in range(num_long)
    ]
    return sorted(schedule, key=lambda item: item[0])


async def run_schedule(args: argparse.Namespace, schedule) -> list[tuple[str, RequestResult]]:
    import httpx
    from tqdm import tqdm

    sender = RequestSender(
        Backend.OPENAI,
        f"{args.url.rstrip('/')}/v1/completions",
        args.model,
        ignore_eos=True,
        sampling={"temperature": 0.0},
    )
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        warmup = schedule[0][2]
        await sender.send(client, warmup, time.perf_counter())
        start = time.perf_counter()
        progress = tqdm(total=len(schedule), desc="requests")

        async def send(kind: str, request: SampleRequest) -> tuple[str, RequestResult]:
            result = await sender.send(client, request, start)
            progress.update(1)
            return kind, result

        tasks = []
        for offset, kind, request in schedule:
            delay = start + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(send(kind, request)))
        results = await asyncio.gather(*tasks)
        progress.close()
        return list(results)


def summarize(results: list[tuple[str, RequestResult]]) -> dict:
    summary: dict = {"num_failed": sum(1 for _, result in results if not result.is_success)}
    for kind in ("short", "long"):
        done = [result for k, result in results if k == kind and result.is_success]
        ttfts = sorted(result.ttft * 1000 for result in done)
        itls = sorted(itl * 1000 for result in done for itl in result.itls)
        summary[kind] = {"num_requests": len(done), "ttft_ms": ttfts, "itl_ms": itls}
        for name, values in (("ttft", ttfts), ("itl", itls)):
            for q in (50, 90, 99):
                summary[kind][f"p{q}_{name}_ms"] = percentile(values, q) if values else None
    return summary


def run(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    token_ids = ordinary_token_ids(AutoTokenizer.from_pretrained(args.tokenizer))
    schedule = make_requests(args, token_ids)
    results = asyncio.run(run_schedule(args, schedule))
    summary = {
        "label": args.label,
        "settings": {key: value for key, value in vars(args).items() if key != "func"},
        **summarize(results),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(summary))
    print(format_rows([summary]))
    return 1 if summary["num_failed"] else 0


def format_rows(summaries: list[dict]) -> str:
    lines = [
        "| serving | short ITL p50 / p99 (ms) | short TTFT p50 / p99 (ms) | long TTFT p50 / p99 (ms) | failed |",
        "|---|---|---|---|---|",
    ]
    for s in summaries:
        short, long = s["short"], s["long"]
        lines.append(
            f"| {s['label']} | {short['p50_itl_ms']:.1f} / {short['p99_itl_ms']:.1f} | "
            f"{short['p50_ttft_ms']:.0f} / {short['p99_ttft_ms']:.0f} | "
            f"{long['p50_ttft_ms']:.0f} / {long['p99_ttft_ms']:.0f} | {s['num_failed']} |"
        )
    return "\n".join(lines)


def report(args: argparse.Namespace) -> int:
    summaries = [json.loads(Path(path).read_text()) for path in args.results]
    print(format_rows(summaries))
    if args.plot:
        plot(summaries, args.plot)
        print(f"plot: {args.plot}")
    return 0


def plot(summaries: list[dict], path: str) -> None:
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    panels = (
        ("short", "itl_ms", "Short requests: inter-token latency"),
        ("short", "ttft_ms", "Short requests: time to first token"),
        ("long", "ttft_ms", "Long prompts: time to first token"),
    )
    for axis, (kind, key, title) in zip(axes, panels):
        for summary in summaries:
            values = summary[kind][key]
            fractions = [(index + 1) / len(values) for index in range(len(values))]
            axis.plot(values, fractions, label=summary["label"])
        axis.set_xscale("log")
        low, high = axis.get_xlim()
        subs = (1.0, 2.0, 5.0) if high / low < 100 else (1.0,)  # within two decades, label 2x and 5x too
        axis.xaxis.set_major_locator(matplotlib.ticker.LogLocator(subs=subs))
        axis.xaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
        axis.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        axis.set_xlabel("ms (log scale)")
        axis.set_ylabel("fraction of samples")
        axis.set_title(title)
        axis.grid(True, which="both", alpha=0.3)
        axis.legend()
    figure.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(required=True)
    run_parser = commands.add_parser("run", help="load one endpoint, write its summary")
    run_parser.add_argument("--url", default="http://127.0.0.1:8000")
    run_parser.add_argument("--model", required=True)
    run_parser.add_argument("--tokenizer", required=True)
    run_parser.add_argument("--label", required=True)
    run_parser.add_argument("--out", required=True)
    run_parser.add_argument("--duration-s", type=float, default=60.0)
    run_parser.add_argument("--short-rate", type=float, default=3.0)
    run_parser.add_argument("--short-input-len", type=int, default=64)
    run_parser.add_argument("--short-output-len", type=int, default=128)
    run_parser.add_argument("--long-interval-s", type=float, default=5.0)
    run_parser.add_argument("--long-input-len", type=int, default=1536)
    run_parser.add_argument("--long-output-len", type=int, default=8)
    run_parser.add_argument("--seed", type=int, default=0)
    run_parser.set_defaults(func=run)
    report_parser = commands.add_parser("report", help="a markdown table (and a plot) of several summaries")
    report_parser.add_argument("results", nargs="+")
    report_parser.add_argument("--plot")
    report_parser.set_defaults(func=report)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
