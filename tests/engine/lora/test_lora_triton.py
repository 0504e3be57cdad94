"""The batched-LoRA Triton kernels (``engine.lora.triton_ops``) equal ``LinearLoRA``'s torch path, and both
equal the per-token definition.

On a machine without CUDA they run through Triton's interpreter (set before the kernels are imported),
so the shapes are tiny; on a GPU the same tests run natively. Each case fills a ``LinearLoRA``'s slots
from adapters of chosen ranks (zero-padded to ``max_rank``, as the engine loads them), groups the
step's tokens the way ``LoRAManager.prepare`` does, and compares both paths on the same inputs.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from engine import SamplingParams  # noqa: E402 - after TRITON_INTERPRET
from engine.lora import triton_ops  # noqa: E402
from engine.lora.adapter import LoRAAdapter  # noqa: E402
from engine.lora.layers import LinearLoRA, LoRABatch  # noqa: E402
from engine.lora_request import LoRARequest  # noqa: E402
from serval.tools.make_adapter import make_lora_adapter  # noqa: E402
from tests.conftest import make_llm  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HEAD_DIM = 16
QKV = {"q_proj": (0, 4 * HEAD_DIM, 0), "k_proj": (64, 2 * HEAD_DIM, 0), "v_proj": (96, 2 * HEAD_DIM, 0)}  # GQA 2
GATE_UP = {"gate_proj": (0, 48, 0), "up_proj": (48, 48, 0)}  # 48: no power of two


def make_layer(slices, in_features, ranks, max_rank, max_loras, seed=0) -> LinearLoRA:
    """A layer whose slot i holds a random adapter of rank ``ranks[i]`` (None: the slot stays empty)."""
    generator = torch.Generator().manual_seed(seed)
    out_features = max(offset + size for offset, size, _ in slices.values())
    layer = LinearLoRA(
        LoRABatch(), slices, in_features, out_features, max_loras, max_rank, torch.float32, torch.device(DEVICE)
    )
    for slot, rank in enumerate(ranks):
        if rank is None:
            continue
        weights = {
            (0, module): (
                torch.randn(rank, in_features, generator=generator) / in_features**0.5,
                torch.randn(size, rank, generator=generator),
            )
            for module, (_, size, _) in slices.items()
        }
        layer.set_slot(slot, LoRAAdapter(rank=rank, scaling=1.0, weights=weights), layer=0)
    return layer


def set_groups(layer: LinearLoRA, token_slots: list[int | None]) -> None:
    """The manager's grouping: one (slot, rows) per slot in use, rows None when a slot has every token."""
    groups = []
    for slot in dict.fromkeys(s for s in token_slots if s is not None):
        rows = [i for i, s in enumerate(token_slots) if s == slot]
        whole = len(rows) == len(token_slots)
        groups.append((slot, None if whole else torch.tensor(rows, dtype=torch.int64, device=DEVICE)))
    layer.batch.groups = groups


def per_token(layer: LinearLoRA, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The definition, one token at a time: y[t] + x[t] @ A[slot].T @ B[slot].T for each grouped token."""
    out = y.clone()
    for slot, rows in layer.batch.groups:
        for t in range(len(x)) if rows is None else rows.tolist():
            out[t] += x[t] @ layer.lora_a[slot].T @ layer.lora_b[slot].T
    return out


def assert_paths_agree(layer: LinearLoRA, num_tokens: int, seed: int = 1) -> torch.Tensor:
    """The Triton kernels, the torch path and the per-token definition give the same output."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, layer.lora_a.shape[2], generator=generator).to(DEVICE)
    y = torch.randn(num_tokens, layer.lora_b.shape[1], generator=generator).to(DEVICE)
    expected = per_token(layer, x, y)
    torch.testing.assert_close(layer.apply_torch(x, y.clone()), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(layer.apply_triton(x, y.clone()), expected, rtol=1e-5, atol=1e-5)
    return expected - y  # the deltas, for the callers' own checks


def test_a_mixed_batch_of_base_tokens_and_three_ranks_on_packed_qkv():
    layer = make_layer(QKV, 64, ranks=[2, 5, 8], max_rank=8, max_loras=3)
    slots = [None, 0, 1, 2, 1, None, 0, 0, 2, None, 1, 2, 2, 2, None, 0, 1, 1, 1, None, 2]
    set_groups(layer, slots)
    delta = assert_paths_agree(layer, len(slots))
    base_rows = [i for i, s in enumerate(slots) if s is None]
    assert not delta[base_rows].any()  # base-model tokens are untouched
    assert delta[[i for i, s in enumerate(slots) if s is not None]].abs().min(dim=1).values.gt(0).all()


def test_gate_up_slices_and_a_prefill_longer_than_a_token_block():
    layer = make_layer(GATE_UP, 32, ranks=[4, 16], max_rank=16, max_loras=2)
    set_groups(layer, [0] * 23 + [None] * 7 + [1] * 19)  # runs over several 16-token blocks
    assert_paths_agree(layer, 49)


def test_ranks_up_to_max_lora_rank_span_several_rank_blocks():
    layer = make_layer(QKV, 32, ranks=[80, 1], max_rank=80, max_loras=2)  # 80 > one 64-wide rank block
    set_groups(layer, [1, 0, 0, 1, 0, None])
    assert_paths_agree(layer, 6)


def test_a_single_token_with_every_slot_its_own():
    layer = make_layer({"o_proj": (0, 40, 0)}, 24, ranks=[3], max_rank=4, max_loras=1)
    set_groups(layer, [0])  # rows None: the whole step is one adapter
    assert layer.batch.groups == [(0, None)]
    assert_paths_agree(layer, 1)


def test_empty_groups_and_empty_slots_add_nothing():
    """Slots with no token this step (one never filled) and a group whose row list is empty."""
    layer = make_layer(QKV, 32, ranks=[4, None, 6, 2], max_rank=8, max_loras=4)
    set_groups(layer, [2, None, 0, None])  # slots 0, 2 and 3: not consecutive
    layer.batch.groups = [*layer.batch.groups, (3, torch.empty(0, dtype=torch.int64, device=DEVICE))]
    delta = assert_paths_agree(layer, 4)
    assert not delta[[1, 3]].any()


def test_the_token_plan_sorts_tokens_by_slot_and_drops_the_base_model():
    plan = triton_ops.plan_lora_tokens(torch.tensor([2, -1, 0, 2, -1, 0, 0]), max_loras=4)
    assert plan.counts.tolist() == [3, 0, 2, 0]
    order = plan.order.tolist()
    runs = [order[s : s + c] for s, c in zip(plan.starts.tolist(), plan.counts.tolist())]
    assert runs == [[2, 5, 6], [], [0, 3], []]


def test_the_engine_on_the_triton_kernels_generates_the_torch_paths_tokens(tiny_checkpoint, tmp_path):
    """The whole engine with every LoRA layer on the kernels (as on CUDA): a batch of the base model and two
    adapters of different ranks, prompts of different lengths (prefill and decode steps), equals the torch path."""
    base = tiny_checkpoint("llama")
    loras = [
        LoRARequest("a", 1, str(make_lora_adapter(tmp_path / "a", base, rank=4, seed=1))),
        LoRARequest("b", 2, str(make_lora_adapter(tmp_path / "b", base, rank=8, targets=("k", "up", "down"), seed=2))),
    ]
    prompts = [{"prompt_token_ids": list(range(20, 20 + n))} for n in (5, 11, 3)]
    params = SamplingParams(temperature=0.0, max_tokens=3, logprobs=0, ignore_eos=True)
    llm = make_llm(base, enable_lora=True, max_loras=2, max_lora_rank=8, enable_prefix_caching=False)
    manager = llm.llm_engine.engine_core.engine_core.executor.worker.model_runner.lora
    results = {}
    for kernels in ("torch", "triton"):
        for _, layer in manager.layers:
            layer.kernels = kernels
        outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=[loras[0], None, loras[1]])
        results[kernels] = [
            (
                list(o.outputs[0].token_ids),
                [p[t].logprob for p, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)],
            )
            for o in outputs
        ]
    llm.shutdown()
    for (tokens, logprobs), (expected_tokens, expected_logprobs) in zip(results["triton"], results["torch"]):
        assert tokens == expected_tokens
        assert max(abs(a - b) for a, b in zip(logprobs, expected_logprobs)) < 1e-4
