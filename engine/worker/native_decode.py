"""The model runner's decode step in one native call (``decode_stack``, engine/kernels/csrc/decode_stack.cpp).

At batch 1 on a small model each decoder layer is a dozen small ops, and their Python and dispatcher cost
is paid once per layer per token. ``NativeDecodeStep`` hands the whole stack to C++, which runs the same
native ops the layers run (the fused norms, rope with the KV write, the paged decode kernel, SiLU-and-mul)
back to back. Products of up to ``native_rows`` rows take the native ``skinny_linear`` (each weight row
read once for all rows, whoever the CPU's vendor); larger ones the weight's oneDNN-packed copy where its
layer's product keeps one (so from ``PACKED_MIN_ROWS`` rows, as ``CPUFloat32Product`` decides), else
``at::linear``, what ``F.linear`` runs; a block-format weight's product is ``quant_linear``, as
``NativeBlockProduct``'s, each linear in its own format (``weight_formats``: a file whose layers mix Q8_0,
Q4_0, Q4_1, Q5_0, Q5_1 and the K-quants, as every Q4_K_M file does, keeps the stack; a packed layer whose
parts differ in format is its runs' products side by side, ``parted.PartedBlockProduct``'s). The step's LM
head takes the native product for the rows its stack did (``logits_rows``).

Chosen once, at load (``native_decode_step``), from what the parts declare: the model that its layers are the
stack's shape (``native_decode_unfit``), each layer's product how the stack computes it (``native_format``:
float32, or a block format), the attention backend its KV layout; a model it cannot run
keeps the layers, and the reason is logged once. Per step it takes only a step whose every token decodes a
generated token (``can_run``): a prompt's last tokens after a prefix-cache hit keep the layers' path, so they
still equal the full prompt's bit for bit.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch
from torch import nn

from engine.attention.torch_paged import TorchPagedAttention
from engine.kernels.cpu import fused_cpu_ops, load_cpu_kernels
from engine.model.layers.cpu_prepack import PACKED_MIN_ROWS

if TYPE_CHECKING:
    from engine.worker.step_inputs import StepInputs

logger = logging.getLogger(__name__)

# Rows up to which the products take the native kernel when the weights have no packed copy (its ceiling is 8).
NATIVE_ROWS = 8


class NativeDecodeStep:
    """The model's weights gathered once, in ``decode_stack``'s order; ``run`` is one decode-only step."""

    def __init__(self, model: nn.Module, kernels):
        stack = model.model
        self.kernels = kernels
        self.embed_tokens = stack.embed_tokens
        self.final_norm = stack.norm.weight
        self.rotary = stack.rotary
        first = stack.local_layers[0]
        attn = first.self_attn
        self.num_heads, self.num_kv_heads, self.scale = attn.num_heads, attn.num_kv_heads, attn.scale
        self.eps = first.input_layernorm.eps
        self.windows = [layer.self_attn.window or 0 for layer in stack.local_layers]  # the kernel's 0: full
        self.layer_groups = list(stack.layer_groups)  # each layer's KV cache group: its slots and block tables
        self.num_groups = len(stack.kv_cache_groups)
        empty = torch.empty(0)
        self.layer_weights = [
            tensor
            for layer in stack.local_layers
            for tensor in (
                layer.input_layernorm.weight,
                layer.self_attn.qkv_proj.weight,
                empty if layer.self_attn.qkv_proj.bias is None else layer.self_attn.qkv_proj.bias,
                layer.self_attn.o_proj.weight,
                layer.post_attention_layernorm.weight,
                layer.mlp.gate_up_proj.weight,
                layer.mlp.down_proj.weight,
            )
        ]
        products = [linear.product for layer in stack.local_layers for linear in _linears(layer)]
        self.weight_formats = [product.native_format for product in products]  # 4 per layer
        packed = [product.packed for product in products]
        self.packed_weights = [empty if p is None else p for p in packed] if any(p is not None for p in packed) else []
        # Where every float32 product keeps a packed copy, from PACKED_MIN_ROWS rows they take it, as the layers do.
        floats = [p for p, f in zip(packed, self.weight_formats) if f == -1]
        self.native_rows = PACKED_MIN_ROWS - 1 if floats and None not in floats else NATIVE_ROWS

    @property
    def logits_rows(self) -> range:
        """The LM head's ``native_rows`` in a step this one ran: the rows its stack multiplied natively."""
        return range(1, self.native_rows + 1)

    def can_run(self, inputs: StepInputs, requests: Mapping) -> bool:
        """Whether every token of the step decodes a generated token (one per request, past its prompt)."""
        if inputs.attn_metadata.num_actual_tokens != len(inputs.req_ids):
            return False
        return all(
            query_len == 1 and start >= requests[req_id].num_prompt_tokens
            for req_id, start, query_len in zip(inputs.req_ids, inputs.starts, inputs.query_lens)
        )

    def run(self, inputs: StepInputs, kv_caches: list[torch.Tensor]) -> torch.Tensor:
        """The step's final-normed hidden states [T, hidden]; each layer's new K/V written into ``kv_caches``."""
        md = inputs.attn_metadata
        n = md.num_actual_tokens
        table = self.rotary.table(md.max_seq_len - 1, self.final_norm.device)
        return self.kernels.decode_stack(
            self.embed_tokens(inputs.input_ids[:n]),
            self.layer_weights,
            self.packed_weights,
            kv_caches,
            self.final_norm,
            inputs.positions[:n],
            [md.for_group(g).slot_mapping[:n] for g in range(self.num_groups)],
            table,
            [md.for_group(g).block_tables[:n].to(torch.int32).contiguous() for g in range(self.num_groups)],
            md.seq_lens[:n].to(torch.int32),
            self.num_heads,
            self.num_kv_heads,
            self.eps,
            self.scale,
            self.native_rows,
            self.weight_formats,
            self.windows,
            self.layer_groups,
        )


def native_decode_step(model: nn.Module, lora_enabled: bool) -> NativeDecodeStep | None:
    """The native step for ``model`` if it computes the model's decode steps exactly, else None, with one INFO
    line saying why (module docstring). Called once, after the weights are processed."""
    reason = unfit_reason(model, lora_enabled)
    if reason is not None:
        logger.info("native decode stack off: %s", reason)
        return None
    return NativeDecodeStep(model, load_cpu_kernels())


def unfit_reason(model: nn.Module, lora_enabled: bool) -> str | None:
    """Why ``NativeDecodeStep`` cannot run ``model`` (the first reason found), None when it can. The CPU
    kernels are asked for last: on a GPU the products say no first, and nothing is compiled."""
    if lora_enabled:
        return "LoRA adapters (their deltas are added in Python)"
    reason = model.native_decode_unfit()
    if reason is not None:
        return reason
    dtype = model.model.norm.weight.dtype  # the model's (an embedding may be stored in blocks)
    if dtype != torch.float32:
        return f"the model computes in {dtype}, the stack in float32"
    reason = _products_unfit(model.model.local_layers)
    if reason is not None:
        return reason
    backend = model.backend
    if not isinstance(backend, TorchPagedAttention) or not backend.use_cpu_kernel:
        return f"the attention backend ({type(backend).__name__}) is not the torch paged one with its CPU kernel"
    if not hasattr(load_cpu_kernels(), "decode_stack"):
        return "the native CPU kernels (decode_stack) are not built here"
    if fused_cpu_ops(model.model.norm.weight) is None:
        return "the fused CPU norms are not built here"
    return None


def _products_unfit(layers) -> str | None:
    """Why a layer's product is not one the stack computes, None when every one is."""
    for index, layer in enumerate(layers):
        for name, linear in zip(("qkv_proj", "o_proj", "gate_up_proj", "down_proj"), _linears(layer)):
            if linear.product.native_format is None:
                return f"layer {index}'s {name} product ({type(linear.product).__name__}) has no native form"
    return None


def _linears(layer: nn.Module) -> tuple[nn.Module, ...]:
    return layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj
