"""Where one offline generate spends its time: per-step wall times, per-component totals, top torch ops.

Runs the throughput workload (N random-token prompts, greedy, EOS ignored) through ``LLMEngine.step``
and reports
  * the wall time of every step (prefill-carrying steps vs the median decode step),
  * totals per component (scheduler, model forward, decode attention kernel, logits, sampling,
    output processing), measured by wrapping those calls,
  * the torch profiler's top operators over a window of decode steps.

    python benchmarks/profile_steps.py --workload w2
    python benchmarks/profile_steps.py --model models/bench/w1-qwen2 --num-prompts 32 --input-len 256
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
    scheduler = engine.engine_core.scheduler
    runner = engine.engine_core.executor.worker.model_runner
    scheduler.schedule = timed(totals, "scheduler.schedule", scheduler.schedule)
    scheduler.update_from_output = timed(totals, "scheduler.update_from_output", scheduler.update_from_output)
    batch = runner.input_batch
    batch.prepare_inputs = timed(totals, "runner.prepare_inputs", batch.prepare_inputs)
    runner._sample = timed(totals, "runner.sample", runner._sample)
    runner.model.forward = timed(totals, "model.forward", runner.model.forward)
    runner.model.compute_logits = timed(totals, "model.compute_logits", runner.model.compute_logits)
    engine.output_processor.process_outputs = timed(totals, "output_processor", engine.output_processor.process_outputs)
    kernels = torch_paged.load_cpu_kernels()
    if kernels is not None:
        decode = timed(totals, "attention.decode_kernel", kernels.paged_decode_attention)
        torch_paged.load_cpu_kernels = lambda: type("Kernels", (), {"paged_decode_attention": staticmethod(decode)})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=sorted(WORKLOADS))
    parser.add_argument("--model")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--profile-steps", type=int, default=20, help="decode steps under the torch profiler")
    args = parser.parse_args()
    if args.workload:
        spec = WORKLOADS[args.workload]
        args.num_prompts, args.input_len, args.output_len = spec["num_prompts"], spec["input_len"], spec["output_len"]
        args.model = args.model or ensure_model(args.workload, args.dtype)
    if not args.model:
        parser.error("give --workload or --model")

    from torch.profiler import ProfilerActivity, profile

    from engine import LLM, SamplingParams

    llm = LLM(args.model, dtype=args.dtype, max_model_len=4096, max_num_seqs=max(args.num_prompts, 8))
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    prompts = make_prompts(llm.get_tokenizer().vocab_size, args.num_prompts, args.input_len)
    llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], params, use_tqdm=False)  # warm-up

    totals: dict[str, float] = collections.defaultdict(float)
    instrument(llm, totals)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"profile-{i}", {"prompt_token_ids": prompt}, params)
    step_times = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        step_times.append(time.perf_counter() - start)
    total = sum(step_times)
    decode_times = sorted(t for t in step_times if t < 2 * min(step_times) + 0.005)
    print(f"{len(step_times)} steps, {total:.3f} s, {args.num_prompts * args.output_len / total:.0f} generated tok/s")
    print(
        f"median decode step {decode_times[len(decode_times) // 2] * 1e3:.2f} ms "
        f"({len(decode_times)} steps); the other {len(step_times) - len(decode_times)} steps "
        f"(prefill chunks) {total - sum(decode_times):.3f} s"
    )
    for key, value in sorted(totals.items(), key=lambda item: -item[1]):
        print(f"  {key:32s} {value:8.3f} s  {value / total:6.1%}")

    for i, prompt in enumerate(prompts):  # again, to profile decode steps once the prompts are in
        engine.add_request(f"again-{i}", {"prompt_token_ids": [t + 1 for t in prompt]}, params)
    scheduler = engine.engine_core.scheduler
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
