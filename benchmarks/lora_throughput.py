"""Multi-LoRA throughput (issue 23): a W2-shaped load over 4 rank-16 adapters against the base model alone.

    python benchmarks/lora_throughput.py                 # 2 rounds, then the adapter load times
    python benchmarks/lora_throughput.py --rounds 4 --num-threads 1   # steadier on a shared machine

W2's shape: the 5M Llama (``benchmarks/peer_throughput.py``'s checkpoint, float32), 64 requests of 128
prompt tokens, 128 generated (greedy, ignore_eos). Three engines in one process, run alternately each
round so the machine's load falls on all alike:

* ``base``: the model alone (``enable_lora`` off);
* ``lora, no adapter``: ``enable_lora=True, max_loras=4, max_lora_rank=16``, every request on the base
  model (what enabling LoRA costs by itself);
* ``lora, 4 adapters``: the same engine, request i on adapter i % 4 (random PEFT adapters, rank 16, every
  projection, made by ``serval.tools.make_adapter`` beside the checkpoint).

The prefix cache is off in all three (the rounds repeat the prompts; a hit would skip their prefill).
The figure is generated tokens per second; the ratio is the adapters' against ``base`` (target >= 0.8),
of the best rounds, the medians, and each round's own (a round's three runs share the machine's load); and
by the process's CPU seconds for the same tokens, which with ``--num-threads 1`` hardly move when other
processes share the cores (no OpenMP region waits on a descheduled thread).
Then the adapter load times, through the LoRA engine's worker: from disk into the host LRU
(``load_adapter``; the files are in the OS page cache after the first read), and from the host LRU into a
device slot (``LoRAManager.prepare`` of an adapter the LRU holds but no slot does: every layer's A and B
copied in).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.peer_throughput import ensure_model, make_prompts  # noqa: E402

NUM_ADAPTERS, RANK = 4, 16
ENGINE_KWARGS = dict(
    max_model_len=4096, seed=0, max_num_seqs=64, enable_prefix_caching=False, kv_cache_memory_bytes=256 << 20
)
LORA_KWARGS = dict(enable_lora=True, max_loras=NUM_ADAPTERS, max_lora_rank=RANK, max_cpu_loras=2 * NUM_ADAPTERS)


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def make_adapters(model: str, count: int, first_seed: int = 1) -> list[str]:
    """``count`` random rank-16 PEFT adapters for ``model`` (made once; the same bytes each time)."""
    from serval.tools.make_adapter import make_lora_adapter

    root = Path(model).parent / f"{Path(model).name}-loras"
    seeds = range(first_seed, first_seed + count)
    return [
        str(make_lora_adapter(root / f"r{RANK}-s{seed}", model, rank=RANK, alpha=2.0 * RANK, seed=seed))
        for seed in seeds
    ]


def timed_generate(llm, prompts, params, lora_request) -> tuple[float, int, float, float]:
    """(generated tokens per second, tokens, wall seconds, this process's CPU seconds) of one generate call;
    the CPU seconds move less than the wall time when other work shares the cores."""
    start, cpu_start = time.perf_counter(), time.process_time()
    outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=lora_request)
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return tokens / elapsed, tokens, elapsed, cpu


def run_throughput(args, model: str, adapters: list[str]):
    """Each engine's generated tokens per second per round; and the LoRA engine (kept) with its requests."""
    from engine import LLM, SamplingParams
    from engine.lora_request import LoRARequest

    log(f"loading the base engine and the LoRA engine ({model})")
    kwargs = ENGINE_KWARGS if args.num_threads is None else {**ENGINE_KWARGS, "num_threads": args.num_threads}
    base = LLM(model, **kwargs)
    lora = LLM(model, **kwargs, **LORA_KWARGS)
    prompts = [{"prompt_token_ids": p} for p in make_prompts(base.get_tokenizer().vocab_size, 64, 128)]
    params = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
    requests = [LoRARequest(f"adapter-{i}", i + 1, path) for i, path in enumerate(adapters)]
    per_prompt = [requests[i % len(requests)] for i in range(len(prompts))]
    runs = {"base": (base, None), "lora, no adapter": (lora, None), "lora, 4 adapters": (lora, per_prompt)}
    log("warm-up: 2 requests per engine, every adapter loaded once")
    base.generate(prompts[:2], params, use_tqdm=False)
    lora.generate(prompts[:4], params, use_tqdm=False, lora_request=per_prompt[:4])
    results: dict[str, list[float]] = {name: [] for name in runs}
    results.update({f"{name} CPU s": [] for name in runs})
    for round_ in range(args.rounds):
        for name, (llm, lora_request) in runs.items():
            log(f"round {round_ + 1}/{args.rounds}: {name} ...")
            rate, tokens, elapsed, cpu = timed_generate(llm, prompts, params, lora_request)
            results[name].append(rate)
            results[f"{name} CPU s"].append(cpu)
            ratio = rate / results["base"][-1]
            load = os.getloadavg()[0]
            print(
                f"round {round_ + 1} {name:<18} {rate:6.0f} gen tok/s ({tokens} tokens, {elapsed:.2f} s, "
                f"{cpu:.2f} CPU s, load {load:.1f}) {ratio:.2f}x base",
                flush=True,
            )
    base.shutdown()
    return results, lora, requests


def run_load_times(lora_llm, model: str, loaded) -> None:
    """Disk -> host LRU and host LRU -> device slot, each for ``NUM_ADAPTERS`` adapters not seen before."""
    import torch

    from engine.lora.adapter import load_adapter
    from engine.lora_request import LoRARequest
    from engine.model.architecture import Architecture

    fresh = make_adapters(model, NUM_ADAPTERS, first_seed=101)
    arch = Architecture.from_model(model)
    disk = []
    for path in fresh:
        start = time.perf_counter()
        load_adapter(path, arch, RANK, torch.float32)
        disk.append(time.perf_counter() - start)
    manager = lora_llm.llm_engine.engine_core.engine_core.executor.worker.model_runner.lora
    # New ids: each prepare reads the adapter from disk into the LRU and then into a slot (a swap: the
    # four slots hold the throughput run's adapters); then the first four again, from the LRU only.
    new = [LoRARequest(f"fresh-{i}", 100 + i, path) for i, path in enumerate(fresh)]
    timings = {}
    for name, batch in (("disk -> LRU -> slot", new), ("LRU -> slot", loaded)):
        loads_before, times = manager.num_loads, []
        for request in batch:
            start = time.perf_counter()
            manager.prepare([request], [1])
            times.append(time.perf_counter() - start)
        timings[name] = (times, manager.num_loads - loads_before)
    manager.prepare([], [])
    print(f"load_adapter (disk -> host LRU), rank {RANK}: median {statistics.median(disk) * 1e3:.2f} ms of {len(disk)}")
    for name, (times, loads) in timings.items():
        print(f"prepare, {name}: median {statistics.median(times) * 1e3:.2f} ms of {len(times)} ({loads} disk loads)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--num-threads",
        type=int,
        help="torch threads of both engines (default: the engine's, all cores); 1 keeps another process on the "
        "machine from stalling every OpenMP region",
    )
    args = parser.parse_args()
    log(f"load average at start: {os.getloadavg()[0]:.2f}; cpus: {os.cpu_count()}")
    model = ensure_model("w2", "float32")
    adapters = make_adapters(model, NUM_ADAPTERS)
    results, lora_llm, requests = run_throughput(args, model, adapters)
    base, base_cpu = results["base"], statistics.median(results["base CPU s"])
    for name in ("base", "lora, no adapter", "lora, 4 adapters"):
        rates, cpu = results[name], statistics.median(results[f"{name} CPU s"])
        paired = statistics.median(rate / b for rate, b in zip(rates, base))
        print(
            f"{name:<18} best {max(rates):6.0f} gen tok/s ({max(rates) / max(base):.2f}x base), "
            f"median {statistics.median(rates):6.0f} ({statistics.median(rates) / statistics.median(base):.2f}x), "
            f"median of the rounds' ratios {paired:.2f}x; median CPU {cpu:.2f} s ({base_cpu / cpu:.2f}x base)"
        )
    log("adapter load times ...")
    run_load_times(lora_llm, model, requests)
    lora_llm.shutdown()
    log(f"load average at end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
