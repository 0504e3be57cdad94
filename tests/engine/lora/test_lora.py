"""Multi-LoRA in the engine: equal to transformers + PEFT with the adapter merged, adapters mixed in one
batch beyond ``max_loras`` (the slots swap mid-run), a prefix cache keyed by adapter, bad input refused."""

from __future__ import annotations

import asyncio
import functools
import json

import pytest
import torch

from engine import LLM, SamplingParams
from engine.engine_args import EngineArgs
from engine.frontend.processor import Processor
from engine.inputs import RequestOptions
from engine.lora_request import LoRARequest
from engine.model.architecture import Architecture
from serval.tools.make_adapter import make_lora_adapter
from tests.conftest import FIRST_ORDINARY_TOKEN, engine_kwargs, make_async_llm

MAX_TOKENS = 6
# Three adapters for two slots and a host LRU of two: every reuse of the third swaps a slot.
ADAPTERS = {
    "a": dict(rank=4, alpha=8.0, seed=1),
    "b": dict(rank=8, alpha=4.0, use_rslora=True, seed=2),
    "c": dict(rank=2, alpha=2.0, targets=("q", "v", "down"), seed=3),
}


@pytest.fixture(scope="module")
def base(tiny_checkpoint) -> str:
    return tiny_checkpoint("llama")


@pytest.fixture(scope="module")
def loras(base, tmp_path_factory) -> dict[str, LoRARequest]:
    root = tmp_path_factory.mktemp("loras")
    return {
        name: LoRARequest(name, index, str(make_lora_adapter(root / name, base, **kwargs)))
        for index, (name, kwargs) in enumerate(ADAPTERS.items(), start=1)
    }


@pytest.fixture(scope="module")
def llm(base):
    kwargs = engine_kwargs(enable_lora=True, max_loras=2, max_lora_rank=8, max_cpu_loras=2, block_size=4)
    with LLM(base, **kwargs) as llm:
        yield llm


@functools.cache
def _hf_model(base: str, lora_path: str | None):
    """The transformers model, with the PEFT adapter at ``lora_path`` merged into it (float32)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    return model if lora_path is None else PeftModel.from_pretrained(model, lora_path).merge_and_unload()


def _reference(base: str, lora: LoRARequest | None, prompt: list[int]) -> tuple[list[int], list[float]]:
    """Greedy tokens and their logprobs from transformers + PEFT (merged)."""
    model = _hf_model(base, None if lora is None else lora.lora_path)
    ids, tokens, logprobs = list(prompt), [], []
    with torch.no_grad():
        for _ in range(MAX_TOKENS):
            row = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), dim=-1)
            token = int(row.argmax())
            tokens.append(token)
            logprobs.append(float(row[token]))
            ids.append(token)
    return tokens, logprobs


def _prompt(seed: int, length: int = 9) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(FIRST_ORDINARY_TOKEN, 512, (length,), generator=generator).tolist()


def _check(output, expected: tuple[list[int], list[float]]) -> None:
    completion = output.outputs[0]
    tokens, logprobs = expected
    assert list(completion.token_ids) == tokens
    got = [position[token].logprob for position, token in zip(completion.logprobs, tokens)]
    assert max(abs(g - e) for g, e in zip(got, logprobs)) < 1e-4


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=0, ignore_eos=True)


def test_each_adapter_matches_peft_merged(llm, base, loras):
    prompt = _prompt(0)
    base_tokens = _reference(base, None, prompt)[0]
    for lora in loras.values():
        expected = _reference(base, lora, prompt)
        assert expected[0] != base_tokens  # the adapter changes what the model says
        (output,) = llm.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False, lora_request=lora)
        _check(output, expected)


def test_a_batch_mixing_the_base_and_more_adapters_than_slots(llm, base, loras):
    plan = [None, "a", "b", "c", "a", None, "c", "b"]
    prompts = [_prompt(10 + i) for i in range(len(plan))]
    requests = [None if name is None else loras[name] for name in plan]
    manager = llm.llm_engine.engine_core.engine_core.executor.worker.model_runner.lora
    swaps_before = manager.num_slot_swaps
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False, lora_request=requests)
    for output, prompt, lora in zip(outputs, prompts, requests):
        _check(output, _reference(base, lora, prompt))
    assert manager.num_slot_swaps > swaps_before  # three adapters went through two slots
    assert manager.num_host_evictions > 0
    # What the replica's metrics export (serval_lora_slot_swaps, serval_lora_step_loads): the engine's stats.
    counts = llm.llm_engine.engine_core.get_stats().lora_counts
    assert (counts.num_slot_swaps, counts.num_step_loads) == (manager.num_slot_swaps, manager.num_step_loads)


def test_the_prefix_cache_never_shares_blocks_across_adapters(llm, base, loras):
    prompt = _prompt(99, length=13)  # three full blocks of 4

    def cached(lora) -> int:
        (output,) = llm.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False, lora_request=lora)
        if lora is not None:
            _check(output, _reference(base, lora, prompt))
        return output.num_cached_tokens

    assert cached(loras["a"]) == 0
    assert cached(loras["b"]) == 0  # same tokens, another adapter: a miss
    assert cached(None) == 0  # nor the base model
    assert cached(loras["a"]) == 12  # the same adapter hits its own blocks
    assert cached(None) == 12


def test_bad_lora_requests_are_refused_and_the_engine_serves_on(llm, base, loras, tmp_path):
    prompt = [{"prompt_token_ids": _prompt(5)}]
    lacking = make_lora_adapter(tmp_path / "lacking", base, rank=2)
    config = json.loads((lacking / "adapter_config.json").read_text())
    (lacking / "adapter_config.json").write_text(json.dumps({**config, "target_modules": ["embed_tokens"]}))
    bad = {
        "no adapter_config.json": LoRARequest("missing", 20, str(tmp_path / "missing")),
        "above max_lora_rank": LoRARequest("big", 21, str(make_lora_adapter(tmp_path / "big", base, rank=16))),
        "targets modules the model lacks": LoRARequest("lacking", 22, str(lacking)),
        "already names the adapter": LoRARequest("again", loras["a"].lora_int_id, loras["b"].lora_path),
    }
    for message, lora in bad.items():
        with pytest.raises(ValueError, match=message):
            llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=lora)
    with pytest.raises(ValueError, match="2 LoRA requests for 1 prompts"):
        llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=[loras["a"], None])
    with pytest.raises(ValueError, match="positive integer"):
        LoRARequest("zero", 0, loras["a"].lora_path)
    assert not llm.llm_engine.has_unfinished_requests()
    (output,) = llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=loras["c"])
    _check(output, _reference(base, loras["c"], prompt[0]["prompt_token_ids"]))


def test_lora_refuses_speculative_decoding_at_start_and_needs_enable_lora(base, loras):
    with pytest.raises(ValueError, match="enable_lora with speculative_config is not supported"):
        LLM(base, enable_lora=True, speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="enable_lora supports pipeline_parallel_size=1"):
        LLM(base, enable_lora=True, pipeline_parallel_size=2)
    with pytest.raises(ValueError, match="enable_lora with kv_transfer_config is not supported"):
        LLM(base, enable_lora=True, kv_transfer_config={"kv_role": "kv_both"})
    config = EngineArgs(model=base).create_engine_config()
    processor = Processor(config, None, 512, [1], arch=Architecture.from_model(base))
    with pytest.raises(ValueError, match="start it with enable_lora=True"):
        processor.make_request("r", [5, 6, 7], GREEDY, RequestOptions(lora_request=loras["a"]))


def test_async_llm_carries_the_adapter_to_a_core_process(base, loras):
    async def run():
        engine = make_async_llm(base, enable_lora=True, max_loras=1, engine_core_process=True)
        try:
            prompt = _prompt(7)
            stream = engine.generate({"prompt_token_ids": prompt}, GREEDY, "x", RequestOptions(lora_request=loras["b"]))
            outputs = [output async for output in stream]
            _check(outputs[-1], _reference(base, loras["b"], prompt))
        finally:
            engine.shutdown()

    asyncio.run(run())
