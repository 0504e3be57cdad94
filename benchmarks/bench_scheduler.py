"""Microseconds per scheduler step (schedule() + update_from_output()) in steady-state decode.

Every request has a 1k-token context, prefix caching is on, and each step
every request decodes one token, so a block fills (and is hashed and cached)
every 16 steps per request, as in real serving. No model: the runner output
is made by hand.

    python benchmarks/bench_scheduler.py --num-running 256 1024
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

from engine.config import CacheConfig, SchedulerConfig
from engine.sampling_params import SamplingParams
from engine.sched.request import Request
from engine.sched.scheduler import Scheduler
from engine.sched.step_outputs import ModelRunnerOutput

BLOCK_SIZE = 16


def build_running_scheduler(num_running: int, context_len: int, num_steps: int) -> Scheduler:
    max_model_len = context_len + num_steps + 8
    blocks_per_request = -(-max_model_len // BLOCK_SIZE)
    scheduler = Scheduler(
        # A budget that prefills everyone in one step, so all requests then decode in lockstep.
        SchedulerConfig(
            max_num_batched_tokens=num_running * context_len, max_num_seqs=num_running, max_model_len=max_model_len
        ),
        CacheConfig(block_size=BLOCK_SIZE, num_blocks=num_running * blocks_per_request + 1, enable_prefix_caching=True),
    )
    params = SamplingParams(max_tokens=num_steps + 4, ignore_eos=True)
    for i in range(num_running):
        prompt = [(i * 7919 + j) % 32000 for j in range(context_len)]
        scheduler.add_request(Request(f"req-{i}", prompt, params, eos_token_id=2))
    while scheduler.waiting:  # prefill everything
        run_step(scheduler)
    # As the engine does after start-up: keep the long-lived block pool out of the cyclic GC's scans.
    gc.collect()
    gc.freeze()
    return scheduler


def run_step(scheduler: Scheduler) -> None:
    output = scheduler.schedule()
    req_ids = list(output.num_scheduled_tokens)
    sampled = [
        [11] if scheduler.requests[r].num_computed_tokens == scheduler.requests[r].num_tokens else [] for r in req_ids
    ]
    scheduler.update_from_output(output, ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled))


def decode_step(scheduler: Scheduler, req_ids: list[str], sampled: list[list[int]]) -> None:
    output = scheduler.schedule()
    scheduler.update_from_output(output, ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled))


def measure(num_running: int, context_len: int, num_steps: int) -> list[float]:
    scheduler = build_running_scheduler(num_running, context_len, num_steps)
    req_ids = [request.request_id for request in scheduler.running]
    sampled = [[11] for _ in req_ids]
    timings_us = []
    for _ in range(num_steps):
        start = time.perf_counter()
        decode_step(scheduler, req_ids, sampled)
        timings_us.append((time.perf_counter() - start) * 1e6)
    assert len(scheduler.running) == num_running, "a request finished early; the measurement is off"
    scheduler.kv_cache_manager.check_integrity()
    return timings_us


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-running", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--context-len", type=int, default=1024)
    parser.add_argument("--num-steps", type=int, default=200)
    args = parser.parse_args()
    print(f"{'running':>8} {'mean_us':>9} {'median_us':>10} {'p90_us':>8} {'p99_us':>8} {'us/request':>11}")
    for num_running in args.num_running:
        timings = sorted(measure(num_running, args.context_len, args.num_steps))
        mean = statistics.fmean(timings)
        p90, p99 = timings[int(0.9 * len(timings))], timings[int(0.99 * len(timings))]
        print(
            f"{num_running:>8} {mean:>9.0f} {statistics.median(timings):>10.0f} {p90:>8.0f} {p99:>8.0f} "
            f"{mean / num_running:>11.2f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
