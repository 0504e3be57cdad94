"""The native decode step (engine/worker/native_decode.py): it takes decode-only CPU steps of the models it
was written for, and what it computes equals the layers' path (greedy tokens; logprobs to float rounding);
whether it runs a model is decided once, at load, and a model it cannot run is told with the reason."""

from __future__ import annotations

import logging
import random
import re

import pytest
import torch

from engine import LLM, SamplingParams
from engine.kernels.cpu import load_cpu_kernels
from engine.model.layers.linear import LinearBase
from engine.model.layers.linear_method import process_weights_after_loading
from engine.model.quantization.block_method import BlockQuantLinearMethod
from engine.model.quantization.blocks import QuantType, quantize
from engine.model.registry import get_model
from engine.worker.native_decode import NativeDecodeStep, native_decode_step, unfit_reason
from serval.tools.quantize_gguf import Plan, quantize_gguf
from tests.conftest import SMOLLM2_PATH

GGUF = SMOLLM2_PATH.parent / "smollm2-135m-instruct.gguf"

pytestmark = pytest.mark.skipif(
    not hasattr(load_cpu_kernels(), "decode_stack"), reason="needs the native CPU kernels with a vector ISA"
)

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)


def _runner(llm):
    return llm.llm_engine.engine_core.engine_core.executor.worker.model_runner


def _prompts(vocab_size: int, lengths: list[int]) -> list[dict]:
    rng = random.Random(3)
    return [{"prompt_token_ids": [rng.randrange(3, vocab_size) for _ in range(n)]} for n in lengths]


def _generate(llm, prompts, fused: bool, native_rows: int | None = None):
    runner = _runner(llm)
    stack = runner.decode_step
    default_rows = stack.native_rows
    stack.native_rows = default_rows if native_rows is None else native_rows
    runner.decode_step = stack if fused else None
    try:
        return llm.generate(prompts, GREEDY, use_tqdm=False)
    finally:
        runner.decode_step, stack.native_rows = stack, default_rows


@pytest.mark.parametrize(("arch", "tie"), [("llama", True), ("llama", False), ("qwen2", None)])
@pytest.mark.parametrize("native_rows", [0, None, 8])  # None: the default, 2 rows (the rest on packed weights)
def test_fused_decode_equals_the_layers(tiny_checkpoint, arch, tie, native_rows):
    llm = LLM(tiny_checkpoint(arch, tie), dtype="float32", max_num_seqs=12, enable_prefix_caching=False)
    stack = _runner(llm).decode_step
    assert (
        stack is not None and stack.native_rows == 2 and len(stack.packed_weights) == 4 * len(stack.layer_weights) // 7
    )
    for lengths in ([9], [5, 17, 30], [4 + i for i in range(11)]):  # batch 1, a few rows, past 8 rows
        prompts = _prompts(llm.get_tokenizer().vocab_size, lengths)
        fused = _generate(llm, prompts, True, native_rows)
        layers = _generate(llm, prompts, False)
        for got, want in zip(fused, layers, strict=True):
            assert got.outputs[0].token_ids == want.outputs[0].token_ids
            for got_top, want_top in zip(got.outputs[0].logprobs, want.outputs[0].logprobs, strict=True):
                assert got_top.keys() == want_top.keys()
                for token_id, logprob in got_top.items():
                    assert logprob.logprob == pytest.approx(want_top[token_id].logprob, abs=1e-4)


def test_only_decode_steps_of_generated_tokens_are_fused(tiny_checkpoint):
    llm = LLM(tiny_checkpoint("llama", True), dtype="float32", enable_prefix_caching=False)
    runner = _runner(llm)
    calls: list[list[int]] = []
    run = runner.decode_step.run

    def recording_run(inputs, kv_caches):
        calls.append(list(inputs.query_lens))
        return run(inputs, kv_caches)

    runner.decode_step.run = recording_run
    llm.generate(_prompts(llm.get_tokenizer().vocab_size, [1, 6]), GREEDY, use_tqdm=False)
    # The one-token prompt's first step is a prompt token: not fused; every later step is (12 tokens each,
    # the first sampled from the prompt step, 11 decode steps after it).
    assert calls and all(query_lens == [1] * len(query_lens) for query_lens in calls)
    assert len(calls) == GREEDY.max_tokens - 1


def test_not_built_for_bfloat16_or_lora(tiny_checkpoint):
    path = tiny_checkpoint("llama", True)
    assert _runner(LLM(path, dtype="bfloat16")).decode_step is None
    assert _runner(LLM(path, dtype="float32", enable_lora=True, max_lora_rank=8)).decode_step is None


def _loaded(path: str, dtype: torch.dtype = torch.float32, formats: dict[str, QuantType] | None = None):
    """The model at ``path`` with its weights processed, as the model runner loads it; ``formats``: linears
    (by name suffix) quantized to a block format first, as a .gguf file's plan would keep them."""
    model = get_model(path, dtype)
    for name, layer in model.named_modules():
        qtype = next((q for suffix, q in (formats or {}).items() if name.endswith(suffix)), None)
        if qtype is not None and isinstance(layer, LinearBase):
            raw = quantize(layer.weight, qtype)
            layer.quantize_as(BlockQuantLinearMethod(qtype, dtype))
            layer.weight.data.copy_(raw)
    process_weights_after_loading(model)
    return model


def test_a_model_the_stack_cannot_run_is_told_once_at_load_with_the_reason(tiny_checkpoint, caplog):
    with caplog.at_level(logging.INFO, logger="engine.worker.native_decode"):
        assert native_decode_step(_loaded(tiny_checkpoint("qwen3")), lora_enabled=False) is None
    assert caplog.messages == ["native decode stack off: layer 0 has q/k norms"]
    llama = tiny_checkpoint("llama", True)
    assert unfit_reason(_loaded(llama), lora_enabled=True) == "LoRA adapters (their deltas are added in Python)"
    assert unfit_reason(_loaded(llama, torch.bfloat16), False) == (
        "the model computes in torch.bfloat16, the stack in float32"
    )
    assert unfit_reason(_loaded(tiny_checkpoint("qwen2")), False) is None  # a qkv bias is the stack's shape
    assert isinstance(native_decode_step(_loaded(llama), lora_enabled=False), NativeDecodeStep)


def test_the_stack_reads_each_layers_product_as_chosen_at_load(tiny_checkpoint):
    path = tiny_checkpoint("llama", True)
    model = _loaded(path)
    stack = NativeDecodeStep(model, load_cpu_kernels())
    num_products = 4 * model.num_local_layers
    assert stack.weight_formats == [-1] * num_products and len(stack.packed_weights) == num_products
    assert stack.native_rows == 2 and stack.logits_rows == range(1, 3)
    q8 = NativeDecodeStep(_loaded(path, formats={"proj": QuantType.Q8_0}), load_cpu_kernels())
    assert q8.weight_formats == [QuantType.Q8_0.kernel_id] * num_products and q8.packed_weights == []
    assert q8.native_rows == 8
    formats = {"mlp.down_proj": QuantType.Q4_0, "self_attn.qkv_proj": QuantType.Q8_0}
    mixed = NativeDecodeStep(_loaded(path, formats=formats), load_cpu_kernels())  # blocks beside packed floats
    assert mixed.weight_formats == [0, -1, -1, 1] * model.num_local_layers and mixed.native_rows == 2
    assert [p.numel() == 0 for p in mixed.packed_weights] == [True, False, False, True] * model.num_local_layers


class _MixedFormats(Plan):
    """A ``quantize_gguf`` plan: every block format, within each layer three or four, and layers unlike their
    neighbours (the file's type says Q4_1); Q5_0 beside Q8_0 as in a Q4_K_M file of a model whose widths are no
    multiple of 256."""

    def target(self, name: str) -> str | None:
        match = re.fullmatch(r"blk\.(\d+)\.(\w+)\.weight", name)
        if match is None:
            return None  # the embedding (the tied head): Q8_0, as stored
        part = match[2]
        if part in ("attn_q", "attn_k", "attn_v"):
            return "Q8_0"
        if part in ("ffn_gate", "ffn_up"):
            return "Q4_0"
        odd = int(match[1]) % 2
        if part == "ffn_down":
            return "Q8_0" if odd else "Q5_1"
        if part == "attn_output":
            return "Q5_0" if odd else None  # Q4_1 as stored in the even layers
        return None  # the norms


def test_a_file_whose_layers_mix_formats_keeps_the_stack_bit_for_bit(tmp_path):
    assert GGUF.is_file(), "run `make models`"
    path = tmp_path / "mixed.gguf"
    counts = quantize_gguf(GGUF, path, _MixedFormats("Q4_1"))
    assert all(counts[kind] for kind in ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"))
    llm = LLM(str(path), max_num_seqs=4, enable_prefix_caching=False)
    stack = _runner(llm).decode_step
    assert stack is not None and stack.weight_formats[:8] == [0, 2, 1, 4, 0, 3, 1, 0]  # layers 0 and 1
    for lengths in ([9], [5, 17, 30]):  # batch 1, a few rows
        prompts = _prompts(llm.get_tokenizer().vocab_size, lengths)
        fused = _generate(llm, prompts, True)
        layers = _generate(llm, prompts, False)
        for got, want in zip(fused, layers, strict=True):
            assert got.outputs[0].token_ids == want.outputs[0].token_ids
            assert _logprobs(got) == _logprobs(want)  # every product quant_linear's, the head a Q8_0 one: exact


def _logprobs(output) -> list[dict[int, float]]:
    return [{token_id: entry.logprob for token_id, entry in top.items()} for top in output.outputs[0].logprobs]
