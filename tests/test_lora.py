"""Multi-LoRA in the engine: equal to transformers + PEFT with the adapter merged, adapters mixed in one
batch beyond ``max_loras`` (the slots swap mid-run), a prefix cache keyed by adapter, bad input refused."""

from __future__ import annotations

import functools

import pytest
import torch

from engine import LLM, SamplingParams
from engine.lora.make_adapter import make_lora_adapter
from engine.lora.request import LoRARequest
from tests.conftest import FIRST_ORDINARY_TOKEN, engine_kwargs

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
    manager = llm.llm_engine.engine_core.executor.worker.model_runner.lora
    swaps_before = manager.num_slot_swaps
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False, lora_request=requests)
    for output, prompt, lora in zip(outputs, prompts, requests):
        _check(output, _reference(base, lora, prompt))
    assert manager.num_slot_swaps > swaps_before  # three adapters went through two slots
    assert manager.num_host_evictions > 0
