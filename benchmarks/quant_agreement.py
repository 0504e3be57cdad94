"""Issue 34's greedy gate on a GGUF file: the first N greedy tokens of 20 chat prompts with the file's blocks
kept (``quantization="gguf"``) against the same file dequantized (``"none"``, the float model it stands for).

Prints, per file, how many chats agree on all N tokens and, for each that parts, the token where it parts and
both texts. Offline, float32, EOS ignored (every chat runs its N tokens). ``--kv-cache-dtype float16`` gives the
blocks' run a 16-bit KV cache (as quant_vs_llama.sh serves them); the dequantized reference keeps float32's.

    python benchmarks/quant_agreement.py models/smollm2-135m-instruct.gguf /tmp/smollm2-135m-instruct.q8_0.gguf
    python benchmarks/quant_agreement.py FILE.gguf --tokens 32
"""

from __future__ import annotations

import argparse

from engine import LLM, SamplingParams

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Name three primary colors.",
    "How do plants make food?",
    "What is 2+2?",
    "Explain what a CPU does in one sentence.",
    "Give me a tip for learning to cook.",
    "What is the tallest mountain on Earth?",
    "Translate 'good morning' into Spanish.",
    "Why is the sky blue?",
    "Write a Python function that adds two numbers.",
    "What is photosynthesis?",
    "Suggest a name for a pet cat.",
    "How many days are in a leap year?",
    "What does HTTP stand for?",
    "Describe a rainy day in two sentences.",
    "What is the boiling point of water?",
    "List three fruits.",
    "Who wrote Romeo and Juliet?",
    "What is machine learning?",
]


def greedy_tokens(path: str, quantization: str, tokens: int, kv: str = "auto") -> tuple[list[list[int]], object]:
    llm = LLM(
        model=path,
        quantization=quantization,
        dtype="float32",
        kv_cache_dtype=kv,
        max_model_len=512,
        kv_cache_memory_bytes=64 << 20,
    )
    chats = [[{"role": "user", "content": prompt}] for prompt in PROMPTS]
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    outputs = [list(o.outputs[0].token_ids) for o in llm.chat(chats, params, use_tqdm=False)]
    tokenizer = llm.get_tokenizer()
    llm.shutdown()
    return outputs, tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", help="GGUF files storing Q8_0 / Q4_0 / Q4_1 tensors")
    parser.add_argument("--tokens", type=int, default=16, help="greedy tokens per chat (default 16)")
    parser.add_argument("--kv-cache-dtype", default="auto", help="the blocks' KV cache (default auto: float32)")
    args = parser.parse_args()
    for path in args.files:
        print(f"{path}: {len(PROMPTS)} chats, {args.tokens} greedy tokens, blocks kept against dequantized ...")
        blocks, tokenizer = greedy_tokens(path, "gguf", args.tokens, args.kv_cache_dtype)
        dense, _ = greedy_tokens(path, "none", args.tokens)
        for prompt, ours, theirs in zip(PROMPTS, blocks, dense):
            if ours != theirs:
                parted = next(i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b)
                print(f"  parts at token {parted}: {prompt!r}")
                print(f"    blocks:      {tokenizer.decode(ours)!r}\n    dequantized: {tokenizer.decode(theirs)!r}")
        agree = sum(ours == theirs for ours, theirs in zip(blocks, dense))
        print(f"RESULT {path}: the first {args.tokens} greedy tokens agree on {agree} of {len(PROMPTS)} chats")


if __name__ == "__main__":
    main()
