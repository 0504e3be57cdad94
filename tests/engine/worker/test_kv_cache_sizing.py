"""The worker sizes the KV pool from a memory budget, after loading the model and a profiling forward."""

import pytest
import torch

from engine import LLM, SamplingParams


def num_blocks_of(llm) -> int:
    return llm.llm_engine.engine_core.engine_core.cache_config.num_blocks


def block_bytes_of(llm) -> int:
    return llm.llm_engine.engine_core.engine_core.executor.worker.model_runner.get_kv_cache_block_bytes()


def test_explicit_budget_sets_the_pool(tiny_checkpoint):
    # tiny llama: 2 layers x (K, V) x 16 slots x 2 KV heads x head_dim 16 x 4 bytes = 8 KiB per block
    llm = LLM(
        tiny_checkpoint("llama"), dtype="float32", max_model_len=256, max_num_seqs=8, kv_cache_memory_bytes=320 * 1024
    )
    assert block_bytes_of(llm) == 2 * 2 * 16 * 2 * 16 * 4
    assert num_blocks_of(llm) == 40
    kv_caches = llm.llm_engine.engine_core.engine_core.executor.worker.model_runner.kv_caches
    assert len(kv_caches) == 2 and kv_caches[0].shape == (2, 40, 16, 2, 16)
    # The pool works at that size: more requests than fit at once still all finish.
    outputs = llm.generate(
        [{"prompt_token_ids": list(range(5, 105))}] * 6,
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
        use_tqdm=False,
    )
    assert all(len(o.outputs[0].token_ids) == 40 for o in outputs)


def test_default_budget_is_capped_at_what_can_be_used(tiny_checkpoint):
    """Free RAM would hold millions of tiny blocks; the pool stops at max_num_seqs full-length sequences."""
    llm = LLM(tiny_checkpoint("llama"), dtype="float32", max_model_len=256, max_num_seqs=4)
    assert num_blocks_of(llm) == 4 * (256 // 16) + 1


def test_a_budget_below_one_sequence_is_a_clear_error(tiny_checkpoint):
    with pytest.raises(ValueError, match="fewer than max_model_len"):
        LLM(tiny_checkpoint("llama"), dtype="float32", max_model_len=256, kv_cache_memory_bytes=64 * 1024)


def test_the_profiling_step_fills_the_token_budget_with_prompts_that_fit():
    from engine.worker.profiling import split_budget as _split_budget

    assert _split_budget(8192, 2047, 256) == [2047, 2047, 2047, 2047, 4]  # a budget past max_model_len
    assert _split_budget(2048, 4095, 256) == [2048]
    assert _split_budget(100, 10, 3) == [10, 10, 10]  # no more prompts than max_num_seqs


def test_cuda_graph_sizes_past_max_num_seqs_are_refused(tiny_checkpoint):
    with pytest.raises(ValueError, match="past max_num_seqs"):
        LLM(tiny_checkpoint("llama"), max_num_seqs=8, cuda_graph_batch_sizes=[1, 16])


def _generate(llm, prompts, max_tokens=24):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=1)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [
        (o.outputs[0].token_ids, [lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)])
        for o in outputs
    ]


@pytest.mark.parametrize("kv_cache_dtype", ["bfloat16", "float16"])
def test_a_16_bit_cache_under_a_float32_model(tiny_checkpoint, kv_cache_dtype):
    """kv_cache_dtype: half the bytes a block, twice the blocks in the budget; a prefix hit reads back exactly what
    the first computation attended to (its new K/V rounded to the cache's dtype first), so the answers repeat bit
    for bit; and they stay close to the float32 cache's."""
    kwargs = dict(dtype="float32", max_model_len=256, max_num_seqs=8, kv_cache_memory_bytes=320 * 1024)
    llm = LLM(tiny_checkpoint("llama"), kv_cache_dtype=kv_cache_dtype, **kwargs)
    assert block_bytes_of(llm) == 2 * 2 * 16 * 2 * 16 * 2
    assert num_blocks_of(llm) == 80
    kv_caches = llm.llm_engine.engine_core.engine_core.executor.worker.model_runner.kv_caches
    assert {cache.dtype for cache in kv_caches} == {getattr(torch, kv_cache_dtype)}
    prompts = [list(range(5, 105)), list(range(7, 60))]
    first = _generate(llm, prompts)
    assert _generate(llm, prompts) == first  # the prompts' blocks now prefix hits
    reference = _generate(LLM(tiny_checkpoint("llama"), **kwargs), prompts)
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(first, reference):
        assert tokens[:8] == want_tokens[:8]
        assert max(abs(a - b) for a, b in zip(logprobs[:8], want_logprobs[:8])) < 0.05


def test_a_16_bit_cache_needs_a_float32_model(tiny_checkpoint):
    with pytest.raises(ValueError, match="needs a float32 model"):
        LLM(tiny_checkpoint("llama"), dtype="bfloat16", kv_cache_dtype="float16", max_model_len=256)
