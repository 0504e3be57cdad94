"""The soak's record: counts by fate, fault windows and recovery times, the one-screen summary and the
timeline plot.

A fault's window runs from the moment the fault began to its recovery: the start of the first ``ok``
request started after the fault was applied (the soak's end if none was; a kill lands somewhere between
the fault's start and end); ``recover_s`` is that window's length. A
failed request (error, cut or hung) is inside a window when it was in flight at some point of that
window, else outside. ``settled_after_s`` (from the fault's record) is when Serve's status showed the
deployment back in shape: the replicas it should have, all RUNNING.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from serval.bench.soak_client import FATES, Outcome
from serval.bench.soak_faults import FaultRecord

FAILURES = ("error", "cut", "hung")
COLORS = {"ok": "tab:green", "disconnected": "tab:blue", "error": "tab:orange", "cut": "tab:red", "hung": "black"}
BIN_S = 1.0


def fault_windows(outcomes: list[Outcome], faults: list[FaultRecord], end_s: float) -> list[dict]:
    """Per fault: its window ``[start_s, end_s]`` and ``recover_s`` (None when no ok request started after it)."""
    ok_starts = sorted(o.start for o in outcomes if o.fate == "ok")
    windows = []
    for fault in faults:
        # After the fault was applied: a kill lands somewhere between its start and its end.
        recovered = next((start for start in ok_starts if start >= fault.finished_s), None)
        windows.append(
            {
                "fault": fault.label,
                "start_s": fault.started_s,
                "end_s": end_s if recovered is None else recovered,
                "recover_s": None if recovered is None else recovered - fault.started_s,
            }
        )
    return windows


def in_window(outcome: Outcome, window: dict) -> bool:
    return outcome.start <= window["end_s"] and outcome.end >= window["start_s"]


def build_record(outcomes: list[Outcome], faults: list[FaultRecord], duration_s: float, settings: dict) -> dict:
    """The JSON record: config, counts by fate, failures inside / outside fault windows, each fault with its
    window and errors, and every request's outcome."""
    windows = fault_windows(outcomes, faults, duration_s)
    failed = [o for o in outcomes if o.fate in FAILURES]
    inside = {o.index for o in failed if any(in_window(o, w) for w in windows)}
    for window in windows:
        window["failures"] = dict(Counter(o.fate for o in failed if in_window(o, window)))
    counts = Counter(o.fate for o in outcomes)
    return {
        "config": settings,
        "duration_s": duration_s,
        "num_requests": len(outcomes),
        "counts": {fate: counts.get(fate, 0) for fate in FATES},
        "failures_inside_windows": dict(Counter(o.fate for o in failed if o.index in inside)),
        "failures_outside_windows": dict(Counter(o.fate for o in failed if o.index not in inside)),
        "faults": [{**fault.to_json(), **window} for fault, window in zip(faults, windows)],
        "failure_details": sorted({f"{o.fate}: {o.detail}" for o in failed})[:50],
        "outcomes": [o.to_json() for o in outcomes],
    }


def migrations_during(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, int] | None:
    """Requests migrated during the soak, by kind (the ingress's counter read before and after; Ray exports
    it every few seconds, so the last ones may be missing); None if either read failed."""
    if before is None or after is None:
        return None
    return {kind: int(after[kind] - before.get(kind, 0.0)) for kind in sorted(after)}


def passed(record: dict) -> bool:
    """Nothing cut or hung, errors only inside fault windows, and the after-checks (when run) held."""
    counts, outside = record["counts"], record["failures_outside_windows"]
    after = record.get("after", {})
    return (
        counts["cut"] == counts["hung"] == 0
        and not outside
        and after.get("idle", {}).get("idle", True)
        and after.get("new_requests_ok", True)
    )


def format_summary(record: dict) -> str:
    """The one-screen summary: counts, failures by window, each fault's recovery, the after-checks."""
    counts = record["counts"]
    lines = [
        "=" * 20 + " Soak Result " + "=" * 20,
        f"{'Duration (s):':<34}{record['duration_s']:>10.1f}",
        f"{'Requests:':<34}{record['num_requests']:>10}",
        *(f"{fate + ':':<34}{counts[fate]:>10}" for fate in FATES),
        f"{'Failures inside fault windows:':<34}{_counts_text(record['failures_inside_windows']):>10}",
        f"{'Failures outside fault windows:':<34}{_counts_text(record['failures_outside_windows']):>10}",
    ]
    if "migrations" in record:
        migrations = "unknown" if record["migrations"] is None else _counts_text(record["migrations"])
        lines.append(f"{'Migrated (ok when complete):':<34}{migrations:>10}")
    for fault in record["faults"]:
        recover = "never" if fault["recover_s"] is None else f"{fault['recover_s']:.2f} s"
        settled = (
            f"not by the next fault or the end ({fault['last_states']})"
            if fault["settled_after_s"] is None
            else f"{fault['settled_after_s']:.1f} s"
        )
        status = f"FAILED: {fault['error']}" if fault["error"] else fault["detail"]
        lines.append(f"  {fault['label']:<16} at {fault['started_s']:6.1f} s: recovered {recover}, settled {settled}")
        lines.append(f"  {'':<16} {status[:100]}")
        if fault["failures"]:
            lines.append(f"  {'':<18} failures in its window: {_counts_text(fault['failures'])}")
    after = record.get("after")
    if after:
        idle = after.get("idle")
        if idle is not None:
            lines.append(f"{'Live replicas idle after:':<34}{str(idle['idle']):>10} ({idle['num_replicas']} replicas)")
            failed = {replica: error for replica, error in idle.get("kv_integrity", {}).items() if error}
            checked = len(idle.get("kv_integrity", {}))
            integrity = f"FAILED on {sorted(failed)}: {list(failed.values())[:1]}" if failed else f"ok on {checked}"
            lines.append(f"{'KV cache invariants after:':<34}{integrity:>10}")
        lines.append(f"{'New requests after:':<34}{'ok' if after['new_requests_ok'] else 'FAILED':>10}")
    for detail in record["failure_details"][:8]:
        lines.append(f"  {detail[:110]}")
    lines.append(f"{'Verdict:':<34}{'PASS' if passed(record) else 'FAIL':>10}")
    return "\n".join(lines + ["=" * 53])


def _counts_text(counts: dict) -> str:
    return ", ".join(f"{fate} {n}" for fate, n in sorted(counts.items())) or "none"


def plot_timeline(record: dict, path: Path) -> None:
    """Writes outcomes per second by fate (stacked, by end time) and requests in flight, with each fault's
    marker and window shaded, to ``path`` (matplotlib's Agg canvas)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(12, 6))
    canvas = FigureCanvasAgg(figure)
    fates_axes = figure.add_subplot(2, 1, 1)
    flight_axes = figure.add_subplot(2, 1, 2, sharex=fates_axes)
    outcomes = record["outcomes"]
    num_bins = max(1, int(record["duration_s"] / BIN_S) + 1)
    edges = [index * BIN_S for index in range(num_bins + 1)]
    bottom = [0] * num_bins
    for fate in FATES:
        heights = [0] * num_bins
        for o in outcomes:
            if o["fate"] == fate:
                heights[min(int(o["end"] / BIN_S), num_bins - 1)] += 1
        if any(heights):
            fates_axes.bar(edges[:-1], heights, BIN_S, bottom=bottom, align="edge", color=COLORS[fate], label=fate)
            bottom = [b + h for b, h in zip(bottom, heights)]
    middles = [t + BIN_S / 2 for t in edges[:-1]]
    flight = [sum(o["start"] <= t < o["end"] for o in outcomes) for t in middles]
    flight_axes.plot(middles, flight, marker=".")
    for fault in record["faults"]:
        for axes in (fates_axes, flight_axes):
            axes.axvline(fault["started_s"], color="tab:purple", linestyle="--", linewidth=1)
            axes.axvspan(fault["start_s"], fault["end_s"], color="tab:purple", alpha=0.12)
        fates_axes.text(fault["started_s"], 1.0, fault["label"], rotation=90, va="top", fontsize=8,
                        transform=fates_axes.get_xaxis_transform())  # fmt: skip
    fates_axes.set_ylabel("requests ended per second")
    fates_axes.legend(loc="upper right", fontsize=8)
    flight_axes.set_ylabel("requests in flight (mid-second)")
    flight_axes.set_xlabel("time since start (s)")
    for axes in (fates_axes, flight_axes):
        axes.grid(alpha=0.3)
    figure.suptitle(f"serval bench soak: {record['config'].get('url')} ({record['num_requests']} requests)")
    figure.tight_layout()
    canvas.print_png(str(path))
