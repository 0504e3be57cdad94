"""``serval demo``: the offline engine end to end on a local checkpoint.

Runs a few chat prompts and a batch of random-token prompts through
``engine.LLM`` and prints the completions and the throughput.
"""

from __future__ import annotations

import argparse
import random
import time

SUMMARY = "run the offline engine on a local checkpoint and print completions and throughput"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="local checkpoint directory (see `serval make-model`)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--num-prompts", type=int, default=32, help="random-token prompts in the batch run")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)


def run(args: argparse.Namespace) -> int:
    from engine import LLM, SamplingParams

    llm = LLM(args.model, dtype=args.dtype, max_model_len=1024)
    conversations = [
        [{"role": "user", "content": text}] for text in ("What is a paged KV cache?", "Write a haiku about Ray.")
    ]
    for conversation, output in zip(
        conversations,
        llm.chat(conversations, SamplingParams(temperature=0.8, top_p=0.95, max_tokens=32, seed=0), use_tqdm=False),
    ):
        print(f"user: {conversation[0]['content']}\nmodel: {output.outputs[0].text!r}\n")

    rng = random.Random(0)
    vocab_size = llm.get_tokenizer().vocab_size
    prompts = [
        {"prompt_token_ids": [rng.randrange(10, vocab_size) for _ in range(args.input_len)]}
        for _ in range(args.num_prompts)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    num_generated = sum(len(output.outputs[0].token_ids) for output in outputs)
    print(
        f"{args.num_prompts} prompts x {args.input_len} tokens -> {num_generated} tokens in {elapsed:.2f} s "
        f"({num_generated / elapsed:.0f} generated tokens/s)"
    )
    return 0
