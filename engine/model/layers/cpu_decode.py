"""A decode-only CPU step's decoder stack in one native call (``decode_stack``, engine/kernels/csrc/decode_stack.cpp).

At batch 1 on a small model each decoder layer is a dozen small ops, and their Python and dispatcher cost
is paid once per layer per token. ``CPUDecodeStack`` hands the whole stack to C++, which runs the same
native ops the layers run (the fused norms, rope with the KV write, the paged decode kernel, SiLU-and-mul)
back to back. Products of up to ``native_rows`` rows take the native ``skinny_linear`` (each weight row
read once for all rows, whoever the CPU's vendor); larger ones the weight's oneDNN-packed copy where
``cpu_prepack`` made one (so from ``PACKED_MIN_ROWS`` rows, as ``cpu_prepack.linear`` decides), else
``at::linear``, what ``F.linear`` runs.

It takes a step only when every token is a decode of a generated token (``can_run``): a prompt's last
tokens after a prefix-cache hit keep the layers' path, so they still equal the full prompt's bit for bit.
Only the models it was written for are taken (``build``): float32 on CPU, one rank, the Llama layer with
at most a qkv bias, no LoRA, the products' weights all float or all in one block format, the torch paged
backend with its CPU kernel; anything else keeps the layers.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch
from torch import nn

from engine.attention.torch_paged import TorchPagedAttention
from engine.kernels.cpu import fused_cpu_ops, load_cpu_kernels
from engine.model.layers.cpu_prepack import PACKED_MIN_ROWS

if TYPE_CHECKING:
    from engine.worker.step_inputs import StepInputs

# Rows up to which the products take the native kernel when the weights have no packed copy (its ceiling is 8).
NATIVE_ROWS = 8


class CPUDecodeStack:
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
        linears = [linear for layer in stack.local_layers for linear in _linears(layer)]
        self.weight_format = _format(linears[0])  # one format across the stack (_is_plain_llama)
        packed = all(linear.packed_weight is not None for linear in linears)
        self.packed_weights = [linear.packed_weight for linear in linears] if packed else []
        self.native_rows = PACKED_MIN_ROWS - 1 if packed else NATIVE_ROWS

    @classmethod
    def build(cls, model: nn.Module) -> CPUDecodeStack | None:
        """The stack for ``model`` if it is one ``decode_stack`` computes exactly (module docstring), else None."""
        if not _is_plain_llama(model):  # first: on a GPU, no CPU kernel build
            return None
        kernels = load_cpu_kernels()
        if kernels is None or not hasattr(kernels, "decode_stack"):
            return None
        norm = model.model.norm.weight  # the model's dtype (an embedding may be stored in blocks)
        if norm.dtype != torch.float32 or fused_cpu_ops(norm) is None:
            return None
        return cls(model, kernels)

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
            md.slot_mapping[:n],
            table,
            md.block_tables[:n].to(torch.int32).contiguous(),
            md.seq_lens[:n].to(torch.int32),
            self.num_heads,
            self.num_kv_heads,
            self.eps,
            self.scale,
            self.native_rows,
            self.weight_format,
        )


def _is_plain_llama(model: nn.Module) -> bool:
    """One rank, one stage, CPU, layers without q/k norms or o/MLP biases or LoRA, the torch paged backend."""
    stack = getattr(model, "model", None)
    layers = getattr(stack, "local_layers", None)
    if not layers or getattr(model, "tp_size", 1) != 1 or getattr(model, "pp_size", 1) != 1:
        return False
    if stack.embed_tokens is None or stack.norm is None or stack.embed_tokens.weight.device.type != "cpu":
        return False
    eps = layers[0].input_layernorm.eps
    formats = {_format(linear) for layer in layers for linear in _linears(layer)}
    return len(formats) == 1 and all(_is_plain_layer(layer, eps) for layer in layers)


def _linears(layer: nn.Module) -> tuple[nn.Module, ...]:
    return layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj


def _is_plain_layer(layer: nn.Module, eps: float) -> bool:
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    if attn is None or mlp is None or attn.q_norm is not None or attn.o_proj.bias is not None:
        return False
    backend = attn.backend
    if not isinstance(backend, TorchPagedAttention) or not backend.use_cpu_kernel:
        return False
    if any(linear.lora is not None for linear in _linears(layer)):
        return False
    if mlp.gate_up_proj.bias is not None or mlp.down_proj.bias is not None:
        return False
    return layer.input_layernorm.eps == eps and layer.post_attention_layernorm.eps == eps


def _format(linear: nn.Module) -> int:
    """-1 for float weights, else the kernel id of the layer's block format (``decode_stack``'s weight_format)."""
    method = linear.quant_method
    return method.qtype.kernel_id if method.is_quantized else -1
