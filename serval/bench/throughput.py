"""``serval bench throughput``: offline throughput of the engine in this process, as ``vllm bench throughput``.

Samples requests from a dataset (``serval.bench.datasets``), hands them all at once to
``engine.LLM.generate`` (greedy, ``ignore_eos``, each request's ``max_tokens`` its expected output
length) and reports requests and tokens per second over the wall time of that one call. The engine
flags defined here are shared with ``serval bench latency``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass

from serval.bench.datasets import SampleRequest, add_dataset_arguments, sample_requests
from serval.engine_flags import add_engine_flags, engine_kwargs_from_flags

SUMMARY = "offline throughput of the in-process engine on a dataset (vllm bench throughput)"

# The benchmarks seed the prompts and the engine with their own --seed.
BENCH_EXCLUDED_FLAGS = frozenset({"seed"})


@dataclass
class ThroughputResult:
    elapsed_time: float
    num_requests: int
    total_prompt_tokens: int
    total_output_tokens: int

    def to_dict(self) -> dict:
        """vLLM's JSON keys, plus the token totals and the output token rate."""
        total_num_tokens = self.total_prompt_tokens + self.total_output_tokens
        return {
            "elapsed_time": self.elapsed_time,
            "num_requests": self.num_requests,
            "total_num_tokens": total_num_tokens,
            "total_prompt_tokens": self.total_prompt_tokens,
            "total_output_tokens": self.total_output_tokens,
            "requests_per_second": self.num_requests / self.elapsed_time,
            "tokens_per_second": total_num_tokens / self.elapsed_time,
            "output_tokens_per_second": self.total_output_tokens / self.elapsed_time,
        }


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds ``--model``, a flag per ``EngineArgs`` field (``serval.engine_flags``) and ``--engine-kwargs``."""
    group = parser.add_argument_group("engine")
    group.add_argument("--model", required=True, help="local checkpoint directory")
    add_engine_flags(group, exclude=BENCH_EXCLUDED_FLAGS)


def engine_kwargs_from_args(args: argparse.Namespace, seed: int) -> dict:
    """The ``LLM(**kwargs)`` the engine flags ask for (``--model`` excluded)."""
    return {**engine_kwargs_from_flags(args, exclude=BENCH_EXCLUDED_FLAGS), "seed": seed}


def build_llm(args: argparse.Namespace, seed: int):
    """An ``engine.LLM`` from the engine flags; ValueError for a bad setting."""
    from engine import LLM

    return LLM(args.model, **engine_kwargs_from_args(args, seed))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_arguments(parser)
    add_dataset_arguments(parser)
    parser.add_argument("--output-json", metavar="PATH", help="write the results to this JSON file")


def run(args: argparse.Namespace) -> int:
    try:
        result = _benchmark(args)
    except ValueError as error:
        print(f"serval bench throughput: {error}", file=sys.stderr)
        return 1
    metrics = result.to_dict()
    print(
        f"Throughput: {metrics['requests_per_second']:.2f} requests/s, "
        f"{metrics['tokens_per_second']:.2f} total tokens/s, "
        f"{metrics['output_tokens_per_second']:.2f} output tokens/s"
    )
    print(f"Total num prompt tokens:  {result.total_prompt_tokens}")
    print(f"Total num output tokens:  {result.total_output_tokens}")
    if args.output_json:
        with open(args.output_json, "w", encoding="utf-8") as f:
            json.dump(metrics, f, indent=4)
    return 0


def _benchmark(args: argparse.Namespace) -> ThroughputResult:
    llm = build_llm(args, seed=args.seed)
    try:
        return measure_throughput(llm, sample_requests(args, llm.get_tokenizer()))
    finally:
        llm.shutdown()


def measure_throughput(llm, requests: list[SampleRequest]) -> ThroughputResult:
    """Runs every request through one ``llm.generate`` call; tokens are counted from the outputs."""
    from engine import SamplingParams

    prompts = [{"prompt_token_ids": r.prompt} if isinstance(r.prompt, list) else r.prompt for r in requests]
    params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=r.expected_output_len) for r in requests]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed_time = time.perf_counter() - start
    return ThroughputResult(
        elapsed_time=elapsed_time,
        num_requests=len(outputs),
        total_prompt_tokens=sum(len(output.prompt_token_ids) for output in outputs),
        total_output_tokens=sum(len(completion.token_ids) for output in outputs for completion in output.outputs),
    )
