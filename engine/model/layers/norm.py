"""RMSNorm, computed like Hugging Face (normalise in float32, scale in the input dtype), and Gemma's.

With a ``residual`` it is vLLM's fused add + norm: ``residual = x + residual`` then the norm of that
(the decoder layers carry the residual stream this way). On CPU with the native ops both forms are
one pass each (``engine/kernels/csrc/elementwise.cpp``); elsewhere, plain torch.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.kernels.cpu import fused_cpu_ops
from engine.model.layers.linear import default_weight_loader


class RMSNorm(nn.Module):
    """y = weight * (x / sqrt(mean(x^2) + eps)) over the last dim; any leading shape.

    ``forward(x)`` returns the norm of x. ``forward(x, residual)`` returns ``(norm(x + residual),
    x + residual)`` and may reuse the storage of ``x`` and ``residual`` for the results (callers
    pass activations they no longer need).
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.weight.weight_loader = default_weight_loader

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        ops = self._fused_ops(x)
        if residual is None:
            return ops.rms_norm(x, self.native_weight(), self.eps) if ops is not None else self._norm(x)
        if ops is not None and x.is_contiguous() and residual.is_contiguous() and residual.dtype == x.dtype:
            ops.fused_add_rms_norm(x, residual, self.native_weight(), self.eps)  # in place: x = norm, residual = sum
            return x, residual
        residual = x + residual
        return self._norm(residual), residual

    def _fused_ops(self, x: torch.Tensor):
        return fused_cpu_ops(x) if x.dtype == self.weight.dtype else None

    def native_weight(self) -> torch.Tensor:
        """The weight the native ops scale by (Llama's form: weight * normed x)."""
        return self.weight

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class GemmaRMSNorm(RMSNorm):
    """Gemma's (transformers' ``Gemma3RMSNorm``): y = (x / sqrt(mean(x^2) + eps)) * (1 + weight), all in float32,
    then cast to x's dtype; the weight is stored zero-centred. The same two forms as ``RMSNorm``. On float32
    activations that is Llama's form over the weight 1 + weight, which the native ops compute; on others, plain
    torch (Llama's scales in the activations' dtype, Gemma's in float32)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__(hidden_size, eps)
        self.weight.data.zero_()
        self._scale: tuple[int, torch.Tensor] | None = None  # (the weight's version, 1 + weight)

    def _fused_ops(self, x: torch.Tensor):
        return fused_cpu_ops(x) if x.dtype == torch.float32 == self.weight.dtype else None

    def native_weight(self) -> torch.Tensor:
        if self._scale is None or self._scale[0] != self.weight._version:  # made again should the weight change
            self._scale = (self.weight._version, 1.0 + self.weight)
        return self._scale[1]

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).to(x.dtype)
