"""PNG plots of a ``serval bench serve`` report (matplotlib's Agg canvas; no display, no pyplot state)."""

from __future__ import annotations

from pathlib import Path

from serval.bench.report import METRIC_TITLES, METRICS

BIN_S = 1.0  # width of the throughput plot's time bins


def plot_latency_cdfs(report: dict, path: Path) -> None:
    """Writes a 2x2 grid of the empirical CDFs of TTFT, TPOT, ITL and E2E latency (ms) to ``path``."""
    figure, canvas = _figure(figsize=(11, 8))
    samples = latency_samples_ms(report)
    for index, name in enumerate(METRICS):
        axes = figure.add_subplot(2, 2, index + 1)
        values = sorted(samples[name])
        if values:
            axes.plot(values, [(rank + 1) / len(values) for rank in range(len(values))], drawstyle="steps-post")
        else:
            axes.text(0.5, 0.5, "no samples", ha="center", va="center", transform=axes.transAxes)
        axes.set_title(METRIC_TITLES[name], fontsize=10)
        axes.set_xlabel(f"{name.upper()} (ms)")
        axes.set_ylabel("fraction")
        axes.grid(alpha=0.3)
    figure.suptitle(_title(report))
    figure.tight_layout()
    canvas.print_png(str(path))


def plot_throughput(report: dict, path: Path) -> None:
    """Writes output tokens/s and requests in flight over time (1 s bins) to ``path``, sharing the time axis."""
    figure, canvas = _figure(figsize=(11, 6))
    tokens_axes = figure.add_subplot(2, 1, 1)
    flight_axes = figure.add_subplot(2, 1, 2, sharex=tokens_axes)
    edges = bin_edges(max(report["end_times"], default=0.0))
    tokens_axes.stairs(output_tokens_per_s(report, edges), edges, fill=True, alpha=0.8)
    tokens_axes.set_ylabel("output tokens/s")
    flight_axes.stairs(requests_in_flight(report, edges), edges)
    flight_axes.set_ylabel("requests in flight (bin mean)")
    flight_axes.set_xlabel("time since start (s)")
    for axes in (tokens_axes, flight_axes):
        axes.grid(alpha=0.3)
    figure.suptitle(_title(report))
    figure.tight_layout()
    canvas.print_png(str(path))


def bin_edges(end_s: float) -> list[float]:
    """Edges of 1 s bins from 0 to ``end_s``; a remainder under half a bin joins the last bin (a sliver of
    a bin would make a noisy rate), a longer one is its own, shorter bin."""
    edges = [index * BIN_S for index in range(int(end_s / BIN_S) + 1)]
    if end_s - edges[-1] >= BIN_S / 2 or len(edges) == 1:
        return edges + [max(end_s, BIN_S / 2)]
    return edges[:-1] + [end_s]


def bin_index(time_s: float, num_bins: int) -> int:
    return min(int(time_s / BIN_S), num_bins - 1)


def latency_samples_ms(report: dict) -> dict[str, list[float]]:
    """Each metric's samples of the completed requests, in ms, from the report's raw lists."""

    def present(values):
        return [value * 1e3 for value in values if value is not None]

    return {
        "ttft": present(report["ttfts"]),
        "tpot": present(report["tpots"]),
        "itl": [itl * 1e3 for itls in report["itls"] for itl in itls],
        "e2el": present(report["latencies"]),
    }


def output_tokens_per_s(report: dict, edges: list[float]) -> list[float]:
    """Output tokens per second in each bin, by when their chunks arrived.

    A chunk may carry several tokens and the stream does not say how many, so each request's tokens are
    spread evenly over its chunks.
    """
    tokens = [0.0] * (len(edges) - 1)
    for start, ttft, itls, num_tokens in zip(
        report["start_times"], report["ttfts"], report["itls"], report["output_lens"]
    ):
        if ttft is None:
            continue
        chunk_time = start + ttft
        chunk_times = [chunk_time]
        for itl in itls:
            chunk_time += itl
            chunk_times.append(chunk_time)
        for chunk_time in chunk_times:
            tokens[bin_index(chunk_time, len(tokens))] += num_tokens / len(chunk_times)
    return [count / (high - low) for count, low, high in zip(tokens, edges, edges[1:])]


def requests_in_flight(report: dict, edges: list[float]) -> list[float]:
    """The time-weighted mean number of requests in flight during each bin."""
    busy_s = [0.0] * (len(edges) - 1)
    for start, end in zip(report["start_times"], report["end_times"]):
        for index in range(bin_index(start, len(busy_s)), bin_index(end, len(busy_s)) + 1):
            busy_s[index] += max(min(end, edges[index + 1]) - max(start, edges[index]), 0.0)
    return [busy / (high - low) for busy, low, high in zip(busy_s, edges, edges[1:])]


def _figure(figsize: tuple[float, float]):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=figsize, dpi=100)
    return figure, FigureCanvasAgg(figure)


def _title(report: dict) -> str:
    return (
        f"{report.get('model_id', '')}  {report.get('dataset_name', '')}  "
        f"rate {report.get('request_rate', '')}  concurrency {report.get('max_concurrency') or 'unbounded'}"
    )
