"""``serval bench soak``: concurrent clients against an OpenAI endpoint for a bounded time, with faults.

    serval bench soak --url http://127.0.0.1:8000 --model smollm2-135m-instruct --duration-s 120 --concurrency 8 \\
        --fault kill-replica@20 --fault scale@40:2 --fault scale@70:1 --fault redeploy@100 \\
        --ray-address auto

``--concurrency`` clients each send one request after another (streamed and plain, completions and chat,
random prompt lengths and ``max_tokens`` with ``ignore_eos``; a share of the streams hang up on purpose)
until ``--duration-s`` or ``--max-requests``. Each request's fate is counted (``serval.bench.soak_client``:
ok, disconnected, error, cut, hung). Faults (``serval.bench.soak_faults``) run at their times through the
dashboard (``--dashboard-url``). Afterwards every live ``LLMServer`` replica must be idle (with
``--ray-address``: each replica's ``stats()`` through a Serve deployment handle) and new requests must
succeed. Writes a JSON record and a timeline PNG under ``--result-dir`` and prints a summary
(``serval.bench.soak_report``). Exit code 0 when nothing was cut or hung, every failure fell inside a fault
window and the after-checks held; 1 otherwise; 2 for settings that cannot run.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import os
import random
import sys
import time
from collections import Counter
from pathlib import Path
from urllib.parse import urlparse

from serval.bench.soak_client import FATES, Outcome, RequestSpec, random_spec, read_migrations, send
from serval.bench.soak_faults import Fault, FaultRecord, ServeApp, parse_fault
from serval.bench.soak_report import build_record, format_summary, migrations_during, passed, plot_timeline

SUMMARY = "soak an OpenAI endpoint: concurrent mixed clients for a bounded time, a fault schedule, every fate counted"


def int_range(text: str) -> tuple[int, int]:
    """``8`` or ``4:64`` -> (low, high), both >= 1."""
    low, _, high = text.partition(":")
    bounds = (int(low), int(high or low))
    if not 1 <= bounds[0] <= bounds[1]:
        raise argparse.ArgumentTypeError(f"expected N or LOW:HIGH with 1 <= LOW <= HIGH, got {text!r}")
    return bounds


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The endpoint, load, fault, check and output flags of ``serval bench soak``."""
    parser.add_argument(
        "--url", default="http://127.0.0.1:8000", help="The endpoint's base URL (loopback unless --allow-remote)."
    )
    parser.add_argument("--model", required=True, help="The served model id.")
    parser.add_argument("--api-key", help="Sent as 'Authorization: Bearer KEY'.")
    parser.add_argument("--allow-remote", action="store_true", help="Allow a URL that is not on loopback.")
    load = parser.add_argument_group("load")
    load.add_argument("--concurrency", type=int, default=8, help="Clients, each one request at a time.")
    load.add_argument("--duration-s", type=float, default=60.0, help="No request starts after this.")
    load.add_argument("--max-requests", type=int, default=100_000, help="No more requests than this.")
    load.add_argument("--stall-limit-s", type=float, default=30.0, help="A request with no byte for this long is hung.")
    load.add_argument("--prompt-words", type=int_range, default=(4, 48), help="Prompt length range in words.")
    load.add_argument("--max-tokens", type=int_range, default=(4, 48), help="Output length range (exact: ignore_eos).")
    load.add_argument("--stream-fraction", type=float, default=0.7)
    load.add_argument("--chat-fraction", type=float, default=0.4)
    load.add_argument("--disconnect-fraction", type=float, default=0.1, help="Share of streams that hang up early.")
    load.add_argument(
        "--error-backoff-s",
        type=float,
        default=0.25,
        help="A client waits this long after an error before its next request (as a real client would).",
    )
    load.add_argument("--seed", type=int, default=0)
    faults = parser.add_argument_group("faults and checks")
    faults.add_argument(
        "--fault",
        type=parse_fault,
        action="append",
        default=[],
        help="ACTION@SECONDS[:N]: kill-replica, kill-worker, scale (with N replicas), redeploy. Repeatable.",
    )
    faults.add_argument("--dashboard-url", default="http://127.0.0.1:8265", help="The Ray dashboard (for faults).")
    faults.add_argument("--app", default="llm", help="The Serve application's name.")
    faults.add_argument("--ray-address", help="Connect here (e.g. auto) to check every replica is idle afterwards.")
    faults.add_argument("--idle-timeout-s", type=float, default=60.0, help="How long replicas may take to go idle.")
    faults.add_argument("--after-requests", type=int, default=4, help="Requests sent after the soak; all must be ok.")
    out = parser.add_argument_group("output")
    out.add_argument("--result-dir", default="results/soak")
    out.add_argument("--result-filename", help="Default: soak-{model}-{timestamp}.json.")
    out.add_argument("--progress-s", type=float, default=5.0, help="A progress line this often (0: none).")


def is_loopback_url(url: str) -> bool:
    host = urlparse(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def keep_ray_on_loopback() -> None:
    """Ray, when this process first imports it (a fault's state query, the idle check's ``ray.init``), swaps a
    cluster's 127.0.0.1 for this machine's network address unless this is set, and then waits on an address
    nothing listens on; the launcher starts its head with the same setting."""
    if "ray" not in sys.modules:
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")


def run(args: argparse.Namespace) -> int:
    """Soak, check, write the JSON and PNG, print the summary; the exit code as the module says."""
    remote = [url for url in (args.url, args.dashboard_url) if not is_loopback_url(url)]
    if remote and not args.allow_remote:
        print(f"serval bench soak: error: {remote[0]} is not on loopback (pass --allow-remote)", file=sys.stderr)
        return 2
    if not args.allow_remote:
        keep_ray_on_loopback()
    app = ServeApp(args.dashboard_url, args.app, args.model, args.seed) if args.fault or args.ray_address else None
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else None
    migrations_before = read_migrations(args.url, headers)
    outcomes, faults, duration_s = asyncio.run(soak(args, app))
    record = build_record(outcomes, faults, duration_s, settings(args))
    record["after"] = after_checks(args, app)
    record["migrations"] = migrations_during(migrations_before, read_migrations(args.url, headers))
    paths = write_results(record, args)
    print(format_summary(record))
    print("wrote:\n" + "\n".join(f"  {path}" for path in paths))
    return 0 if passed(record) else 1


def settings(args: argparse.Namespace) -> dict:
    """The run's flags for the record (faults by label)."""
    values = {key: value for key, value in vars(args).items() if key != "handler" and not key.endswith("_command")}
    values.update(fault=[fault.label for fault in args.fault], date=time.strftime("%Y%m%d-%H%M%S"))
    return values


class SoakState:
    """What the clients share: the clock, the request counter, outcomes so far, requests in flight."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.start = time.perf_counter()
        self.next_index = 0
        self.in_flight = 0
        self.outcomes: list[Outcome] = []
        self.rng = random.Random(args.seed)

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def next_spec(self) -> RequestSpec | None:
        """The next request to send, or None once the duration or the request count is spent."""
        if self.elapsed() >= self.args.duration_s or self.next_index >= self.args.max_requests:
            return None
        self.next_index += 1
        return random_spec(self.next_index - 1, self.rng, self.args)


def http_client(args: argparse.Namespace, num_connections: int):
    """An ``httpx.AsyncClient`` whose read timeout is the stall limit. No keep-alive: a connection the
    server closed while idle would otherwise fail the next request as if the server had cut it."""
    import httpx

    limits = httpx.Limits(max_connections=num_connections, max_keepalive_connections=0)
    return httpx.AsyncClient(timeout=httpx.Timeout(args.stall_limit_s, pool=None), limits=limits)


async def soak(args: argparse.Namespace, app: ServeApp | None) -> tuple[list[Outcome], list[FaultRecord], float]:
    """Runs the clients, the fault schedule and the progress line; returns the outcomes (by start time), the
    fault records and the duration (until the last request ended)."""
    state = SoakState(args)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else None
    base_url = args.url.rstrip("/")
    records: list[FaultRecord] = []
    async with http_client(args, args.concurrency) as client:

        async def client_loop() -> None:
            while (spec := state.next_spec()) is not None:
                state.in_flight += 1
                try:
                    outcome = await send(client, base_url, args.model, spec, state.start, headers)
                finally:
                    state.in_flight -= 1
                state.outcomes.append(outcome)
                if outcome.fate == "error":  # a fast-failing server would otherwise be flooded
                    await asyncio.sleep(args.error_backoff_s)

        progress = asyncio.create_task(progress_loop(state, args.fault))
        schedule = asyncio.create_task(run_faults(state, app, args.fault, records))
        await asyncio.gather(*(client_loop() for _ in range(args.concurrency)))
        duration_s = state.elapsed()
        schedule.cancel()
        progress.cancel()
        await asyncio.gather(schedule, progress, return_exceptions=True)
    return sorted(state.outcomes, key=lambda o: o.start), records, duration_s


async def run_faults(state: SoakState, app: ServeApp | None, faults: list[Fault], records: list[FaultRecord]) -> None:
    """Applies each fault at its time (in a thread: the dashboard and Ray calls block) and records it, then
    watches Serve's status until the app has settled; a fault that fails is recorded with its error, never
    raised. Faults past the duration do not run. Cancelled when the clients are done."""
    watchers = []
    try:
        for fault in sorted(faults, key=lambda f: f.at_s):
            if fault.at_s >= state.args.duration_s:
                break
            await asyncio.sleep(max(0.0, fault.at_s - state.elapsed()))
            for watcher in watchers:  # a new fault changes what "settled" means for the earlier ones
                watcher.cancel()
            record = FaultRecord(fault.label, fault.action, fault.at_s, started_s=state.elapsed())
            records.append(record)
            try:
                record.detail, settled = await asyncio.to_thread(app.run, fault)
                watchers.append(asyncio.create_task(watch_settled(state, app, record, settled)))
            except Exception as exc:  # noqa: BLE001 - a fault that cannot run is part of the record
                record.error = f"{type(exc).__name__}: {exc}"
            record.finished_s = state.elapsed()
            print(f"[{record.started_s:7.1f} s] fault {fault.label}: {record.error or record.detail}", flush=True)
        await asyncio.gather(*watchers, return_exceptions=True)  # the cancelled ones too
    finally:
        for watcher in watchers:
            watcher.cancel()


async def watch_settled(state: SoakState, app: ServeApp, record: FaultRecord, settled) -> None:
    """Sets ``record.settled_after_s`` once ``settled`` holds for Serve's status of the deployment (and
    ``record.last_states`` to the replica states each poll saw)."""
    while True:
        try:
            replicas = await asyncio.to_thread(app.replicas)
        except OSError:  # the dashboard busy or restarting: ask again
            replicas = None
        if replicas is not None:
            record.last_states = [replica.get("state", "?") for replica in replicas]
            if settled(replicas):
                record.settled_after_s = state.elapsed() - record.started_s
                print(f"[{state.elapsed():7.1f} s] settled after {record.label} ({record.settled_after_s:.1f} s)")
                return
        await asyncio.sleep(0.5)


async def progress_loop(state: SoakState, faults: list[Fault]) -> None:
    """Prints elapsed time, requests in flight, counts so far and the next fault every ``--progress-s``."""
    if state.args.progress_s <= 0:
        return
    while True:
        await asyncio.sleep(state.args.progress_s)
        elapsed = state.elapsed()
        counts = Counter(o.fate for o in state.outcomes)
        upcoming = [f for f in sorted(faults, key=lambda f: f.at_s) if f.at_s > elapsed]
        next_fault = f"{upcoming[0].label} in {upcoming[0].at_s - elapsed:.0f} s" if upcoming else "none"
        text = " ".join(f"{fate} {counts.get(fate, 0)}" for fate in FATES)
        print(f"[{elapsed:7.1f} s] in flight {state.in_flight:3d} | {text} | next fault: {next_fault}", flush=True)


def after_checks(args: argparse.Namespace, app: ServeApp | None) -> dict:
    """Every live replica idle (with ``--ray-address``), then ``--after-requests`` new requests, all ok."""
    after: dict = {}
    if args.ray_address and app is not None:
        import ray

        if not ray.is_initialized():
            loopback = {} if args.allow_remote else {"_node_ip_address": "127.0.0.1"}
            ray.init(address=args.ray_address, logging_level="warning", log_to_driver=False, **loopback)
        after["idle"] = app.wait_idle(args.idle_timeout_s)
    outcomes = asyncio.run(new_requests(args))
    after["new_requests"] = [o.to_json() for o in outcomes]
    after["new_requests_ok"] = all(o.fate == "ok" for o in outcomes)
    return after


async def new_requests(args: argparse.Namespace) -> list[Outcome]:
    """``--after-requests`` requests, one of each kind in turn (completions / chat, streamed / plain)."""
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else None
    kinds = [("completions", True), ("chat", True), ("completions", False), ("chat", False)]
    specs = [
        RequestSpec(-1 - i, *kinds[i % len(kinds)], prompt="after the soak", max_tokens=args.max_tokens[0])
        for i in range(args.after_requests)
    ]
    async with http_client(args, max(1, len(specs))) as client:
        start = time.perf_counter()
        return list(
            await asyncio.gather(*(send(client, args.url.rstrip("/"), args.model, s, start, headers) for s in specs))
        )


def write_results(record: dict, args: argparse.Namespace) -> list[Path]:
    """The JSON record and its timeline PNG under ``--result-dir``; returns their paths."""
    result_dir = Path(args.result_dir)
    result_dir.mkdir(parents=True, exist_ok=True)
    name = args.result_filename or f"soak-{Path(args.model).name}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    json_path = result_dir / name
    json_path.write_text(json.dumps(record, indent=1, default=str))
    png_path = json_path.with_name(f"{json_path.stem}-timeline.png")
    plot_timeline(record, png_path)
    return [json_path, png_path]
