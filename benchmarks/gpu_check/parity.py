"""The device check's parity phases: our engine's greedy tokens and transformers' on the same prompts,
both in float32 without TF32; ``report.compare_parity`` judges them.
"""

from __future__ import annotations

import time
from pathlib import Path

from benchmarks.gpu_check.phases import (
    BLOCK_SIZE,
    checkpoint_dir,
    log,
    make_llm,
    model_facts,
    random_prompts,
    timed_generate,
)
from benchmarks.gpu_check.settings import Settings


def parity_prompts(settings: Settings, vocab_size: int) -> list[list[int]]:
    return random_prompts(settings.seed + 1000, settings.parity_prompt_lens, vocab_size)


def run_parity_ours(settings: Settings, work: Path, deadline: float) -> dict:
    """Our engine's greedy tokens in float32 (no TF32), with CUDA graphs, and each token's logprob."""
    from benchmarks.gpu_check.device import disable_tf32

    flags = disable_tf32()
    facts = model_facts(settings, work)
    prompts = parity_prompts(settings, facts["vocab"])
    max_model_len = max(settings.parity_prompt_lens) + settings.parity_max_tokens + BLOCK_SIZE
    llm, record = make_llm(
        settings,
        work,
        settings.parity_dtype,
        max_num_seqs=len(prompts),
        max_model_len=max_model_len,
        max_num_batched_tokens=settings.parity_max_num_batched_tokens,
        enforce_eager=False,
    )
    seconds, outputs = timed_generate(llm, prompts, settings.parity_max_tokens, logprobs=0)
    llm.shutdown()
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    logprobs = [[o.outputs[0].logprobs[i][t].logprob for i, t in enumerate(ids)] for o, ids in zip(outputs, tokens)]
    record.update(
        tf32=flags, generate_s=seconds, prompt_lens=list(settings.parity_prompt_lens), tokens=tokens, logprobs=logprobs
    )
    log(f"ours: {len(prompts)} prompts x {settings.parity_max_tokens} tokens in {seconds:.2f} s")
    return record


def load_hf_model(path: str, device: str, dtype):
    """transformers' model on ``device`` (straight there with device_map when accelerate is installed)."""
    from transformers import AutoModelForCausalLM

    if device != "cpu":
        try:
            return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, device_map=device).eval()
        except (ImportError, ValueError) as error:  # no accelerate
            log(f"device_map unavailable ({error}); loading on the CPU first")
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval().to(device)


def hf_greedy(model, prompt: list[int], max_new_tokens: int, device: str) -> dict:
    """transformers' greedy continuation (its KV cache, EOS ignored) with, at each step, the gap
    between the top-2 logits and the chosen token's logprob."""
    import inspect

    import torch
    from transformers import DynamicCache

    # transformers 5 renamed the forward's ``past_key_values`` to ``cache`` (as in tests/conftest.py).
    cache_kwarg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    tokens, gaps, logprobs = [], [], []
    cache = DynamicCache(config=model.config)
    input_ids = torch.tensor([prompt], device=device)
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = model(input_ids, use_cache=True, **{cache_kwarg: cache}).logits[0, -1].float()
            top2 = logits.topk(2)
            token = int(top2.indices[0])
            tokens.append(token)
            gaps.append(float(top2.values[0] - top2.values[1]))
            logprobs.append(float(logits.log_softmax(-1)[token]))
            input_ids = torch.tensor([[token]], device=device)
    return {"tokens": tokens, "top2_gaps": gaps, "logprobs": logprobs}


def run_parity_hf(settings: Settings, work: Path, deadline: float) -> dict:
    """transformers' greedy tokens in float32 (no TF32) on the same prompts: the reference."""
    import torch

    from benchmarks.gpu_check.device import disable_tf32

    flags = disable_tf32()
    facts = model_facts(settings, work)
    prompts = parity_prompts(settings, facts["vocab"])
    begin = time.perf_counter()
    model = load_hf_model(str(checkpoint_dir(work, settings)), settings.device, torch.float32)
    load_s = time.perf_counter() - begin
    log(f"transformers model loaded in {load_s:.1f} s (attention: {model.config._attn_implementation})")
    begin = time.perf_counter()
    references = [hf_greedy(model, ids, settings.parity_max_tokens, settings.device) for ids in prompts]
    generate_s = time.perf_counter() - begin
    log(f"transformers: {len(prompts)} prompts x {settings.parity_max_tokens} tokens in {generate_s:.2f} s")
    return {
        "tf32": flags,
        "load_s": load_s,
        "generate_s": generate_s,
        "prompt_lens": list(settings.parity_prompt_lens),
        "attn_implementation": model.config._attn_implementation,
        "references": references,
    }
