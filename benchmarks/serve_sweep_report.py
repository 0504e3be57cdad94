"""A markdown table and a plot of `serval bench serve` runs at several request rates, one directory per engine.

    python benchmarks/serve_sweep_report.py results/serve-baseline/serval results/serve-baseline/vllm-cpu \
        --plot results/serve-baseline/latency-vs-rate.png

Each directory holds ``rate-<R>.json`` records (``benchmarks/serve_baseline.sh`` writes them); the
engine's name is the directory's.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

COLUMNS = (
    "request_rate",
    "request_throughput",
    "output_throughput",
    "median_ttft_ms",
    "p99_ttft_ms",
    "median_tpot_ms",
    "p99_tpot_ms",
    "median_itl_ms",
    "p99_e2el_ms",
    "goodput_fraction",
    "failed",
)


def load_runs(directory: Path) -> list[dict]:
    """The directory's records in order of request rate (an unbounded rate last)."""
    runs = [json.loads(path.read_text()) for path in directory.glob("rate-*.json")]
    return sorted(runs, key=lambda run: rate_value(run["request_rate"]))


def rate_value(rate) -> float:
    return math.inf if rate == "inf" else float(rate)


def format_cell(value) -> str:
    if isinstance(value, float):
        return f"{value:.2f}" if value < 100 else f"{value:.0f}"
    return str(value)


def markdown_table(runs_by_engine: dict[str, list[dict]]) -> str:
    lines = ["| engine | " + " | ".join(COLUMNS) + " |", "|---|" + "---:|" * len(COLUMNS)]
    for engine, runs in runs_by_engine.items():
        for run in runs:
            lines.append(f"| {engine} | " + " | ".join(format_cell(run.get(column)) for column in COLUMNS) + " |")
    return "\n".join(lines)


def plot(runs_by_engine: dict[str, list[dict]], path: Path) -> None:
    """TTFT and TPOT (median and p99) against the offered request rate, one line per engine."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(11, 4.5))
    canvas = FigureCanvasAgg(figure)
    for index, metric in enumerate(("ttft", "tpot")):
        axes = figure.add_subplot(1, 2, index + 1)
        for engine, runs in runs_by_engine.items():
            # An unbounded rate is drawn at the measured request throughput of that run.
            rates = [
                rate_value(run["request_rate"]) if run["request_rate"] != "inf" else run["request_throughput"]
                for run in runs
            ]
            for stat, style in (("median", "-o"), ("p99", "--x")):
                axes.plot(rates, [run[f"{stat}_{metric}_ms"] for run in runs], style, label=f"{engine} {stat}")
        axes.set_xlabel("request rate (req/s; the burst at its achieved rate)")
        axes.set_ylabel(f"{metric.upper()} (ms)")
        axes.set_yscale("log")
        axes.grid(alpha=0.3, which="both")
        axes.legend(fontsize=8)
    figure.suptitle("serval bench serve: latency against offered load")
    figure.tight_layout()
    canvas.print_png(str(path))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("directories", nargs="+", type=Path)
    parser.add_argument("--plot", type=Path, help="write the latency-against-rate plot here")
    args = parser.parse_args()
    runs_by_engine = {directory.name: load_runs(directory) for directory in args.directories}
    print(markdown_table(runs_by_engine))
    if args.plot:
        plot(runs_by_engine, args.plot)
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
