"""The serving front end's output path: ``AsyncLLM``'s front end on the event loop (vLLM's ``output_handler``).

Runs ``AsyncLLM`` (core in a child process, as serving runs it) on many concurrent DELTA streams; each
consumer does a small per-chunk job on the event loop (an SSE-like ``json.dumps``), as a server does. Each
``CoreStep`` goes from the core client's reader thread to the loop (``StepBuffer``: one
``call_soon_threadsafe`` per batch of steps), where the output processor puts each output into its
collector. Until commit 73b821d this benchmark also ran the front end's own thread (the design replaced:
reader thread -> the front end's thread, which detokenized -> ``call_soon_threadsafe`` -> the collectors);
its figures are in docs/design-measurements.md. Reported per round and as medians: wall time, output
tokens/s, this process's CPU time per output token (the front end's and the consumers' work, the core's
process left out: the figure a loaded machine disturbs least), and the time from a step reaching this
process (the reader thread) to its output landing in a collector (p50, p99).

    python benchmarks/frontend_output_path.py --model models/tiny-llama --streams 64 --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine.async_llm import AsyncLLM  # noqa: E402
from engine.engine_args import EngineArgs  # noqa: E402
from engine.frontend import output_collector  # noqa: E402
from engine.frontend.output_collector import RequestOutputCollector  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.sampling_params import RequestOutputKind, SamplingParams  # noqa: E402

LATENCIES: list[float] = []  # seconds from a step's arrival to its output in a collector
ARRIVED = [0.0]  # when the step being processed reached this process


def stamp_steps(engine: LLMEngine) -> None:
    """Carries each step's arrival mark (set on the reader thread) onto the outputs made from it."""
    process, make_output = engine.process_core_step, engine.output_processor._make_output

    def process_core_step(step):
        ARRIVED[0] = step.arrived
        return process(step)

    def stamped_output(state):
        output = make_output(state)
        if output is not None:
            output.metrics["arrived"] = ARRIVED[0]
        return output

    engine.process_core_step = process_core_step
    engine.output_processor._make_output = stamped_output


def stamp_arrivals(llm: AsyncLLM) -> None:
    """Marks each step's arrival on the reader thread (the core client looks its sink's ``on_step`` up on
    every step)."""
    buffer = llm._frontend._steps
    buffer_on_step = buffer.on_step

    def on_step(step) -> None:
        step.arrived = time.perf_counter()
        buffer_on_step(step)

    buffer.on_step = on_step
    stamp_steps(llm._frontend.engine)


def timed_put(put):
    def put_and_time(self, output) -> None:
        LATENCIES.append(time.perf_counter() - output.metrics["arrived"])
        put(self, output)

    return put_and_time


async def consume(client, prompt, params, request_id: str) -> int:
    num_tokens = 0
    async for output in client.generate(prompt, params, request_id):
        chunk = output.outputs[0]
        num_tokens += len(chunk.token_ids)
        json.dumps({"id": request_id, "choices": [{"text": chunk.text, "index": 0}]})  # the SSE chunk's work
    return num_tokens


async def one_round(client, args, tag: str) -> tuple[float, int]:
    rng = random.Random(0)
    params = SamplingParams(
        max_tokens=args.output_len, temperature=0.0, ignore_eos=True, output_kind=RequestOutputKind.DELTA
    )
    prompts = [{"prompt_token_ids": [rng.randrange(10, 500) for _ in range(args.input_len)]} for _ in args.ids]
    start, cpu_start = time.perf_counter(), time.process_time()
    counts = await asyncio.gather(*(consume(client, p, params, f"{tag}-{i}") for i, p in zip(args.ids, prompts)))
    return time.perf_counter() - start, time.process_time() - cpu_start, sum(counts)


def engine_config(args):
    engine_args = EngineArgs(model=args.model, max_model_len=1024, max_num_seqs=args.streams, dtype="float32", seed=0)
    return engine_args.create_engine_config()


def run_round(args, round_index: int) -> dict:
    LATENCIES.clear()

    async def body():
        client = AsyncLLM(engine_config(args))
        stamp_arrivals(client)
        try:
            await one_round(client, args, "warm")
            LATENCIES.clear()
            return await one_round(client, args, f"r{round_index}")
        finally:
            client.shutdown()

    wall, cpu, num_tokens = asyncio.run(body())
    ordered = sorted(LATENCIES)
    return {
        "design": "loop",
        "wall_s": wall,
        "tok_s": num_tokens / wall,
        "cpu_us_per_tok": 1e6 * cpu / num_tokens,  # this process (front end and consumers), not the core's
        "p50_ms": 1e3 * ordered[len(ordered) // 2],
        "p99_ms": 1e3 * ordered[int(len(ordered) * 0.99)],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(ROOT / "models" / "tiny-llama"))
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    args.ids = list(range(args.streams))
    RequestOutputCollector.put = timed_put(RequestOutputCollector.put)
    assert output_collector.RequestOutputCollector.put is RequestOutputCollector.put
    rounds = []
    for round_index in range(args.rounds):
        result = run_round(args, round_index)
        rounds.append(result)
        print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in result.items()}), flush=True)
    medians = {
        key: statistics.median(r[key] for r in rounds)
        for key in ("wall_s", "tok_s", "cpu_us_per_tok", "p50_ms", "p99_ms")
    }
    print("loop median:", json.dumps({k: round(v, 2) for k, v in medians.items()}))


if __name__ == "__main__":
    main()
