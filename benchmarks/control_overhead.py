"""Per-step control overhead of the Ray executor versus the in-process one.

Runs the same greedy workload on the tiny model with the in-process executor
and with the Ray executor at TP=1 and TP=2, over both control paths (actor
tasks, compiled graph). For every step it times the engine core's
``execute_model`` call (driver side); the Ray workers time their own
``execute_model``. The control overhead per step is the driver's time minus
the output rank's: serializing the SchedulerOutput once, the workers getting
it, and the result coming back.

    python benchmarks/control_overhead.py --model models/tiny-llama
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

CONFIGS = {
    "uni": dict(),
    "tp1-tasks": dict(distributed_executor_backend="ray", ray_compiled_graph=False),
    "tp1-graph": dict(distributed_executor_backend="ray", ray_compiled_graph=True),
    "tp2-tasks": dict(distributed_executor_backend="ray", tensor_parallel_size=2, ray_compiled_graph=False),
    "tp2-graph": dict(distributed_executor_backend="ray", tensor_parallel_size=2, ray_compiled_graph=True),
}


def run(model: str, name: str, num_requests: int, input_len: int, output_len: int) -> dict:
    from engine import LLM, SamplingParams

    llm = LLM(
        model,
        dtype="float32",
        max_model_len=1024,
        max_num_seqs=num_requests,
        seed=0,
        num_threads=1,
        num_cpus_per_worker=0.5,
        **CONFIGS[name],
    )
    executor = llm.llm_engine.engine_core.engine_core.executor
    step_times: list[float] = []
    execute_model = executor.execute_model

    def timed_execute_model(scheduler_output):
        start = time.perf_counter()
        output = execute_model(scheduler_output)
        step_times.append(time.perf_counter() - start)
        return output

    executor.execute_model = timed_execute_model
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(10, 500) for _ in range(input_len)]} for _ in range(num_requests)]
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    llm.generate(prompts[:2], params, use_tqdm=False)  # warm-up
    worker_before = _worker_stats(executor)
    step_times.clear()
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    result = dict(
        config=name,
        num_steps=len(step_times),
        wall_s=elapsed,
        step_ms_mean=1e3 * statistics.fmean(step_times),
        step_ms_p50=1e3 * statistics.median(step_times),
    )
    if worker_before is not None:
        num_steps, busy_s = (after - before for after, before in zip(_worker_stats(executor), worker_before))
        result["worker_step_ms_mean"] = 1e3 * busy_s / num_steps
        result["control_overhead_ms"] = result["step_ms_mean"] - result["worker_step_ms_mean"]
    llm.shutdown()
    return result


def _worker_stats(executor) -> tuple[int, float] | None:
    """(steps, busy seconds) of the output rank, or None for the in-process executor."""
    if not hasattr(executor, "workers"):
        return None
    import ray

    return ray.get(executor.workers[executor.output_rank].step_stats.remote())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(ROOT / "models" / "tiny-llama"))
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=128)
    args = parser.parse_args()
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    import ray

    ray.init(
        _node_ip_address="127.0.0.1",
        num_cpus=os.cpu_count(),
        include_dashboard=False,
        object_store_memory=200 * 1024 * 1024,
        logging_level="warning",
        log_to_driver=False,
    )
    results = []
    print(f"{'config':>10} {'steps':>6} {'step ms (mean/p50)':>19} {'worker ms':>10} {'overhead ms':>12}")
    for name in args.configs:
        print(f"running {name} ...", file=sys.stderr, flush=True)
        r = run(args.model, name, args.num_requests, args.input_len, args.output_len)
        results.append(r)
        print(
            f"{name:>10} {r['num_steps']:>6} {r['step_ms_mean']:>10.2f} /{r['step_ms_p50']:>7.2f} "
            f"{r.get('worker_step_ms_mean', r['step_ms_mean']):>10.2f} {r.get('control_overhead_ms', 0.0):>12.2f}",
            flush=True,
        )
    ray.shutdown()
    out_dir = ROOT / "results"
    out_dir.mkdir(exist_ok=True)
    (out_dir / "control-overhead.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
