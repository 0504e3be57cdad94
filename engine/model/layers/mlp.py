"""Gated feed-forward: down(act(gate(x)) * up(x)) with gate/up packed as ``gate_up_proj``: SwiGLU (``silu``,
Llama's) or GeGLU (``gelu_pytorch_tanh``, Gemma's: GELU's tanh approximation)."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels.cpu import fused_cpu_ops
from engine.model.layers.cpu_prepack import NO_NATIVE_ROWS
from engine.model.layers.linear import MergedColumnParallelLinear, RowParallelLinear

# transformers' ``hidden_act`` / ``hidden_activation`` names -> the activation.
ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh")}


class GatedMLP(nn.Module):
    """[T, hidden] -> [T, hidden]. HF names ``gate_proj``/``up_proj`` load into ``gate_up_proj`` shards 0/1."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        bias: bool = False,
        hidden_act: str = "silu",
        tp_rank: int = 0,
        tp_size: int = 1,
    ):
        super().__init__()
        if hidden_act not in ACTIVATIONS:
            raise NotImplementedError(f"hidden_act {hidden_act!r} (supported: {', '.join(ACTIVATIONS)})")
        self.act = ACTIVATIONS[hidden_act]
        self.is_silu = hidden_act == "silu"
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, [intermediate_size] * 2, bias=bias, tp_rank=tp_rank, tp_size=tp_size
        )
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias, tp_rank=tp_rank, tp_size=tp_size)

    def forward(self, x: torch.Tensor, native_rows: range = NO_NATIVE_ROWS) -> torch.Tensor:
        """``native_rows``: the step's fact for the products (``cpu_prepack``)."""
        gate_up = self.gate_up_proj(x, native_rows)  # [T, 2 * I_local]
        ops = fused_cpu_ops(gate_up) if self.is_silu else None
        if ops is not None:  # one vectorized pass, bit-identical to the torch ops below in bf16
            return self.down_proj(ops.silu_and_mul(gate_up), native_rows)
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up, native_rows)
