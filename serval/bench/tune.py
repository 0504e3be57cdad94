"""``serval bench tune``: sweep engine settings on a live cluster; keep the fastest one that meets the SLO.

For every point of ``--max-num-seqs`` x ``--max-num-batched-tokens`` (x
``--num-replicas``) it redeploys the Serve config with that model's settings
changed (through the dashboard's REST API, as ``serve deploy`` does), waits
until the app runs, and runs ``serval bench serve`` against it. The best point
is the highest output throughput whose ``--goodput`` latencies (at
``--slo-percentile``) are all within their limits and whose requests all
succeeded. It writes a JSON record and a plot of throughput against latency
with the Pareto frontier, then redeploys the original config (or the best
one, ``--keep-best``).

    serval bench tune --config configs/serve/default.yaml --model smollm2-135m-instruct \\
        --tokenizer models/smollm2-135m-instruct \\
        --max-num-seqs 16 64 --max-num-batched-tokens 512 2048 --goodput ttft:500 tpot:50 --num-prompts 200
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from serval.bench import serve
from serval.bench.report import percentile_label
from serval.shipped import DEFAULT_SERVE_CONFIG

SUMMARY = "sweep max_num_seqs x max_num_batched_tokens (x replicas) on a live app; best config under an SLO"
DEFAULT_SLO_PERCENTILE = 99.0


@dataclass
class TunePoint:
    """One sweep point and what ``serval bench serve`` measured there (``error`` when it did not deploy)."""

    max_num_seqs: int
    max_num_batched_tokens: int
    num_replicas: int
    output_throughput: float | None = None
    request_throughput: float | None = None
    latencies_ms: dict[str, float] | None = None  # the SLO'd metrics at --slo-percentile
    num_failed: int | None = None
    is_within_slo: bool = False
    error: str | None = None

    def label(self) -> str:
        return f"seqs={self.max_num_seqs} tok={self.max_num_batched_tokens} rep={self.num_replicas}"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    serve.add_arguments(parser)
    tune = parser.add_argument_group("tune")
    tune.add_argument("--config", default=str(DEFAULT_SERVE_CONFIG), help="The Serve config YAML to vary.")
    tune.add_argument("--address", default="http://127.0.0.1:8265", help="The Ray dashboard (Serve REST API).")
    tune.add_argument("--max-num-seqs", type=int, nargs="+", required=True)
    tune.add_argument("--max-num-batched-tokens", type=int, nargs="+", required=True)
    tune.add_argument(
        "--num-replicas", type=int, nargs="+", default=None, help="Replica counts to sweep too (default: the config's)."
    )
    tune.add_argument(
        "--slo-percentile",
        type=float,
        default=DEFAULT_SLO_PERCENTILE,
        help="The percentile of each --goodput metric that must be within its limit.",
    )
    tune.add_argument("--deploy-timeout-s", type=float, default=600.0)
    tune.add_argument(
        "--keep-best",
        action="store_true",
        help="Leave the best point deployed (default: redeploy the original config).",
    )


def run(args: argparse.Namespace) -> int:
    """Sweeps, writes ``tune-*.json`` and ``tune-*-frontier.png``; 0 when some point met the SLO, else 1."""
    from serval.launcher import lifecycle as launcher

    if args.slo_percentile not in args.metric_percentiles:
        args.metric_percentiles = sorted({*args.metric_percentiles, args.slo_percentile})
    original = launcher.load_config(args.config)
    points = [
        measure_point(args, original, point, index, total) for index, point, total in enumerate_points(args, original)
    ]
    best = best_point(points)
    final_config = with_point(original, args.model, best) if (args.keep_best and best) else original
    print(f"Redeploying the {'best' if final_config is not original else 'original'} config ...", flush=True)
    deploy_and_wait(final_config, args)
    paths = write_tune_results(points, best, args)
    print(format_table(points, best, args))
    print("wrote:\n" + "\n".join(f"  {path}" for path in paths))
    return 0 if best else 1


def enumerate_points(args: argparse.Namespace, config: dict):
    """(index, TunePoint, total) for the grid, in sweep order."""
    replica_counts = args.num_replicas or [
        llm_config_of(config, args.model)["deployment_config"].get("num_replicas", 1)
    ]
    grid = list(itertools.product(replica_counts, args.max_num_seqs, args.max_num_batched_tokens))
    for index, (num_replicas, max_num_seqs, max_num_batched_tokens) in enumerate(grid):
        yield index, TunePoint(max_num_seqs, max_num_batched_tokens, num_replicas), len(grid)


def llm_config_of(config: dict, model_id: str) -> dict:
    """The llm_config serving ``model_id`` in a Serve config; ``ValueError`` when there is none."""
    for app in config["applications"]:
        for llm_config in app.get("args", {}).get("llm_configs", []):
            if isinstance(llm_config, dict) and llm_config["model_loading_config"]["model_id"] == model_id:
                return llm_config
    raise ValueError(f"no llm_config serves model {model_id!r} in the Serve config")


def with_point(config: dict, model_id: str, point: TunePoint) -> dict:
    """A copy of ``config`` with ``model_id``'s engine settings and replica count set to ``point``'s."""
    varied = copy.deepcopy(config)
    llm_config = llm_config_of(varied, model_id)
    llm_config.setdefault("engine_kwargs", {}).update(
        max_num_seqs=point.max_num_seqs, max_num_batched_tokens=point.max_num_batched_tokens
    )
    llm_config.setdefault("deployment_config", {})["num_replicas"] = point.num_replicas
    return varied


def deploy_and_wait(config: dict, args: argparse.Namespace) -> None:
    from serval.launcher import lifecycle as launcher

    launcher.deploy(config, args.address)
    launcher.wait_until_running(args.address, [app["name"] for app in config["applications"]], args.deploy_timeout_s)


def measure_point(args: argparse.Namespace, config: dict, point: TunePoint, index: int, total: int) -> TunePoint:
    """Deploys ``point`` and benchmarks it; a point that fails to deploy is recorded with its error."""
    print(f"[{index + 1}/{total}] {point.label()}: deploying ...", flush=True)
    try:
        deploy_and_wait(with_point(config, args.model, point), args)
    except (RuntimeError, TimeoutError) as exc:
        point.error = str(exc)[-500:]
        print(f"[{index + 1}/{total}] {point.label()}: not deployed: {point.error}", flush=True)
        return point
    report = serve.benchmark(args)
    point.output_throughput = report["output_throughput"]
    point.request_throughput = report["request_throughput"]
    point.num_failed = report["failed"]
    point.latencies_ms = slo_latencies(report, args)
    point.is_within_slo = point.num_failed == 0 and all(
        point.latencies_ms[name] <= limit for name, limit in slos(args).items()
    )
    print(
        f"[{index + 1}/{total}] {point.label()}: {point.output_throughput:.1f} output tok/s, "
        f"{format_latencies(point.latencies_ms)}, {'meets' if point.is_within_slo else 'misses'} the SLO",
        flush=True,
    )
    return point


def slo_latencies(report: dict, args: argparse.Namespace) -> dict[str, float]:
    """Each SLO'd metric (TTFT and TPOT when no SLO is set) at ``--slo-percentile``, in ms."""
    label = percentile_label(args.slo_percentile)
    return {name: report[f"p{label}_{name}_ms"] for name in (slos(args) or {"ttft": 0, "tpot": 0})}


def slos(args: argparse.Namespace) -> dict[str, float]:
    """``--goodput``'s limits in ms by metric."""
    return dict(args.goodput or [])


def format_latencies(latencies_ms: dict[str, float]) -> str:
    return ", ".join(f"{name} {value:.1f} ms" for name, value in latencies_ms.items())


def best_point(points: list[TunePoint]) -> TunePoint | None:
    """The highest output throughput among the points within the SLO (None if no point is)."""
    within = [point for point in points if point.is_within_slo]
    return max(within, key=lambda point: point.output_throughput, default=None)


def pareto_frontier(points: list[TunePoint], metric: str) -> list[TunePoint]:
    """Measured points that no other point beats on both throughput (higher) and ``metric`` (lower),
    in order of throughput."""
    measured = sorted(
        (p for p in points if p.error is None), key=lambda p: (-p.output_throughput, p.latencies_ms[metric])
    )
    frontier, best_latency = [], float("inf")
    for point in measured:
        if point.latencies_ms[metric] < best_latency:
            frontier.append(point)
            best_latency = point.latencies_ms[metric]
    return frontier[::-1]


def write_tune_results(points: list[TunePoint], best: TunePoint | None, args: argparse.Namespace) -> list[Path]:
    """``tune-<model>-<time>.json`` and its frontier plot under ``--result-dir``."""
    result_dir = Path(args.result_dir or ".")
    result_dir.mkdir(parents=True, exist_ok=True)
    stem = f"tune-{Path(args.model).name}-{time.strftime('%Y%m%d-%H%M%S')}"
    json_path = result_dir / f"{stem}.json"
    record = {
        "config": args.config,
        "model_id": args.model,
        "slo": slos(args),
        "slo_percentile": args.slo_percentile,
        "settings": serve.run_settings(args, args.model, args.tokenizer or args.model, serve.make_sender(args)),
        "points": [asdict(point) for point in points],
        "best": asdict(best) if best else None,
    }
    json_path.write_text(json.dumps(record, indent=1))
    plot_path = result_dir / f"{stem}-frontier.png"
    plot_frontier(points, best, args, plot_path)
    return [json_path, plot_path]


def plot_frontier(points: list[TunePoint], best: TunePoint | None, args: argparse.Namespace, path: Path) -> None:
    """Output throughput against each SLO'd latency (one panel each), one dot per point, the Pareto
    frontier joined, the SLO drawn, the best point starred."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    measured = [point for point in points if point.error is None]
    metrics = list(measured[0].latencies_ms) if measured else []
    figure = Figure(figsize=(7 * max(len(metrics), 1), 5.5))
    canvas = FigureCanvasAgg(figure)
    for index, metric in enumerate(metrics):
        _plot_metric(figure.add_subplot(1, len(metrics), index + 1), measured, best, metric, args)
    figure.suptitle(f"serval bench tune: {args.model}")
    figure.tight_layout()
    canvas.print_png(str(path))


def _plot_metric(
    axes, measured: list[TunePoint], best: TunePoint | None, metric: str, args: argparse.Namespace
) -> None:
    for is_within in (True, False):
        group = [point for point in measured if point.is_within_slo == is_within]
        axes.scatter(
            [p.output_throughput for p in group],
            [p.latencies_ms[metric] for p in group],
            label="meets the SLO" if is_within else "misses the SLO",
            color="tab:green" if is_within else "tab:red",
            zorder=3,
        )
    for point in measured:
        axes.annotate(
            point.label(),
            (point.output_throughput, point.latencies_ms[metric]),
            fontsize=7,
            xytext=(4, 4),
            textcoords="offset points",
        )
    frontier = pareto_frontier(measured, metric)
    axes.plot(
        [p.output_throughput for p in frontier],
        [p.latencies_ms[metric] for p in frontier],
        "--",
        color="gray",
        label="Pareto frontier",
    )
    if best:
        axes.scatter(
            [best.output_throughput],
            [best.latencies_ms[metric]],
            marker="*",
            s=300,
            color="gold",
            edgecolor="black",
            zorder=4,
            label="best",
        )
    if metric in slos(args):
        axes.axhline(slos(args)[metric], color="tab:red", linestyle=":", label=f"{metric} SLO")
    axes.set_xlabel("output tokens/s")
    axes.set_ylabel(f"p{percentile_label(args.slo_percentile)} {metric.upper()} (ms)")
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8)


def format_table(points: list[TunePoint], best: TunePoint | None, args: argparse.Namespace) -> str:
    lines = [
        f"{'max_num_seqs':>12} {'batched_tokens':>14} {'replicas':>8} {'output tok/s':>12}  "
        f"p{args.slo_percentile:g} latencies"
    ]
    for point in points:
        measured = (
            (
                f"{point.output_throughput:12.1f}  {format_latencies(point.latencies_ms)}"
                f"{'' if point.is_within_slo else '  (misses the SLO)'}"
            )
            if point.error is None
            else f"{'-':>12}  not deployed"
        )
        marker = " <- best" if point is best else ""
        lines.append(
            f"{point.max_num_seqs:12d} {point.max_num_batched_tokens:14d} {point.num_replicas:8d} {measured}{marker}"
        )
    if best is None:
        lines.append("No point met the SLO.")
    return "\n".join(lines)
