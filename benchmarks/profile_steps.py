"""Where one offline generate spends its time: per-step wall times, per-component totals, top torch ops.

Runs the throughput workload (N random-token prompts, greedy, EOS ignored, FINAL_ONLY outputs as
``LLM.generate`` asks for; ``--output-kind cumulative`` for a streaming front end's per-step outputs)
through ``LLMEngine.step`` and reports
  * the wall time of every step (prefill-carrying steps vs the median decode step, with its
    main-thread CPU time, steadier than wall time on a shared machine),
  * totals per component (scheduler, model forward, decode attention kernel, logits, sampling,
    output processing), measured by wrapping those calls, and their mean per decode step,
  * the torch profiler's top operators over a window of decode steps.

    python benchmarks/profile_steps.py --workload w2 --dtype float32 --repeat 3
    python benchmarks/profile_steps.py --model models/bench/w1-qwen2 --num-prompts 32 --input-len 256
    python benchmarks/profile_steps.py --workload l1 --dtype float32 --threads 1
"""

from __future__ import annotations

import argparse
import collections
import functools
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.peer_throughput import WORKLOADS, ensure_model, make_prompts  # noqa: E402
from engine.sampling_params import RequestOutputKind  # noqa: E402


def timed(totals: dict, key: str, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[key] += time.perf_counter() - start

    return wrapper


def instrument(llm, totals: dict) -> None:
    """Wraps the engine's main calls so their wall time adds up in ``totals``."""
    import engine.attention.torch_paged as torch_paged

    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    runner = engine.engine_core.engine_core.executor.worker.model_runner
    scheduler.schedule = timed(totals, "scheduler.schedule", scheduler.schedule)
    scheduler.update_from_output = timed(totals, "scheduler.update_from_output", scheduler.update_from_output)
    batch = runner.input_batch
    batch.apply_deltas = timed(totals, "runner.apply_deltas", batch.apply_deltas)
    batch.prepare_inputs = timed(totals, "runner.prepare_inputs", batch.prepare_inputs)
    runner._sample = timed(totals, "runner.sample", runner._sample)
    metadata = getattr(runner, "sampling_metadata", None)  # absent before the metadata cache
    if metadata is not None:
        metadata.get = timed(totals, "runner.sample: metadata", metadata.get)
    runner.model.forward = timed(totals, "model.forward", runner.model.forward)
    if getattr(runner, "native_decode", None) is not None:  # decode-only steps in one native call
        runner.decode_step.run = timed(totals, "model.forward: native_decode", runner.decode_step.run)
    runner.model.compute_logits = timed(totals, "model.compute_logits", runner.model.compute_logits)
    engine.output_processor.process_outputs = timed(totals, "output_processor", engine.output_processor.process_outputs)
    kernels = torch_paged.load_cpu_kernels()
    if kernels is not None:
        decode = timed(totals, "model.forward: decode kernel", kernels.paged_decode_attention)
        torch_paged.load_cpu_kernels = lambda: type("Kernels", (), {"paged_decode_attention": staticmethod(decode)})


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=sorted(WORKLOADS))
    parser.add_argument("--model")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, help="torch threads (default: the engine's, every CPU)")
    parser.add_argument("--repeat", type=int, default=1, choices=range(1, 10), help="timed runs (a noisy machine)")
    parser.add_argument("--profile-steps", type=int, default=20, help="decode steps under the torch profiler (0: none)")
    parser.add_argument(
        "--output-kind",
        choices=[kind.name.lower() for kind in RequestOutputKind],
        default="final_only",
        help="final_only is what LLM.generate asks for (the throughput workloads); cumulative / delta stream",
    )
    args = parser.parse_args()
    if args.workload:
        spec = WORKLOADS[args.workload]
        args.num_prompts, args.input_len, args.output_len = spec["num_prompts"], spec["input_len"], spec["output_len"]
        args.model = args.model or ensure_model(args.workload, args.dtype)
    if not args.model:
        parser.error("give --workload or --model")
    return args


def timed_run(engine, prompts: list[list[int]], params, totals: dict, tag: str) -> list[tuple[float, float, dict]]:
    """Runs the prompts to completion; per step (wall s, main-thread CPU s, component seconds)."""
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", {"prompt_token_ids": prompt}, params)
    steps = []
    while engine.has_unfinished_requests():
        before = dict(totals)
        start, cpu_start = time.perf_counter(), time.thread_time()
        engine.step()
        wall, cpu = time.perf_counter() - start, time.thread_time() - cpu_start
        steps.append((wall, cpu, {key: value - before.get(key, 0.0) for key, value in totals.items()}))
    return steps


def report(steps: list[tuple[float, float, dict]], num_generated: int) -> None:
    """Whole-run totals, then the decode-only steps (no prompt token in them) per step."""
    total = sum(wall for wall, _, _ in steps)
    print(f"{len(steps)} steps, {total:.3f} s, {num_generated / total:.0f} generated tok/s")
    floor = min(wall for wall, _, _ in steps)
    decodes = [step for step in steps if step[0] < 2 * floor + 0.005]
    walls = sorted(wall for wall, _, _ in decodes)
    cpus = sorted(cpu for _, cpu, _ in decodes)
    print(
        f"decode steps: {len(decodes)}, median {walls[len(walls) // 2] * 1e3:.2f} ms wall, "
        f"{cpus[len(cpus) // 2] * 1e3:.2f} ms main-thread CPU; the other {len(steps) - len(decodes)} steps "
        f"(prefill chunks) {total - sum(walls):.3f} s"
    )
    keys = sorted(steps[-1][2], key=lambda key: -sum(step[2].get(key, 0.0) for step in steps))
    print(f"  {'component':32s} {'whole run':>9}  {'share':>6}  {'per decode step':>15}")
    for key in keys:
        value = sum(step[2].get(key, 0.0) for step in steps)
        per_decode = sum(step[2].get(key, 0.0) for step in decodes) / len(decodes)
        print(f"  {key:32s} {value:8.3f} s  {value / total:6.1%}  {per_decode * 1e3:12.3f} ms")


def main() -> None:
    args = parse_args()
    from torch.profiler import ProfilerActivity, profile

    from engine import LLM, SamplingParams

    threads = {} if args.threads is None else {"num_threads": args.threads}
    llm = LLM(args.model, dtype=args.dtype, max_model_len=4096, max_num_seqs=max(args.num_prompts, 8), **threads)
    engine = llm.llm_engine
    output_kind = RequestOutputKind[args.output_kind.upper()]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True, output_kind=output_kind)
    prompts = make_prompts(llm.get_tokenizer().vocab_size, args.num_prompts, args.input_len)
    llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], params, use_tqdm=False)  # warm-up

    totals: dict[str, float] = collections.defaultdict(float)
    instrument(llm, totals)
    for run in range(args.repeat):  # each run's prompts shifted by one id: no prefix-cache hits across runs
        shifted = [[t + run for t in prompt] for prompt in prompts]
        report(timed_run(engine, shifted, params, totals, f"run{run}"), args.num_prompts * args.output_len)
    if args.profile_steps <= 0:
        return
    for i, prompt in enumerate(prompts):  # again, to profile decode steps once the prompts are in
        engine.add_request(f"again-{i}", {"prompt_token_ids": [t + args.repeat for t in prompt]}, params)
    scheduler = engine.engine_core.engine_core.scheduler
    while len(scheduler.waiting) or any(r.num_computed_tokens < r.num_prompt_tokens for r in scheduler.running):
        engine.step()
    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        for _ in range(args.profile_steps):
            engine.step()
    print(profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
    while engine.has_unfinished_requests():
        engine.step()


if __name__ == "__main__":
    main()
