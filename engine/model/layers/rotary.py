"""Rotary position embedding (neox / rotate-half layout), as Hugging Face computes it.

``compute_inv_freq`` reproduces transformers' ``ROPE_INIT_FUNCTIONS`` for the
rope types the supported families use: ``default``, ``linear``, ``dynamic``
(NTK), ``llama3`` and ``yarn``. ``RotaryEmbedding`` keeps a float32 cos/sin
table indexed by absolute position, grown on demand.

Dynamic NTK: transformers rescales ``inv_freq`` from the *batch's* largest
position, which is not consistent across chunked prefill. Here the row for
position ``p`` uses ``seq_len = max(p + 1, max_position_embeddings)``: identical
to transformers for every sequence within ``max_position_embeddings`` and to
transformers' token-by-token decode beyond it.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


def _default_inv_freq(base: float, dim: int) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _llama3_inv_freq(p: dict[str, Any], dim: int) -> torch.Tensor:
    inv_freq = _default_inv_freq(p["rope_theta"], dim)
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old_ctx = p["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(p: dict[str, Any], dim: int, max_pos: int) -> tuple[torch.Tensor, float]:
    base, orig = p["rope_theta"], p["original_max_position_embeddings"]
    factor = p.get("factor") or max_pos / orig
    attn_factor = p.get("attention_factor")
    if attn_factor is None:
        ms, ms_all = p.get("mscale"), p.get("mscale_all_dim")
        attn_factor = (
            (_yarn_mscale(factor, ms) / _yarn_mscale(factor, ms_all)) if ms and ms_all else _yarn_mscale(factor)
        )
    beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def corr_dim(rot: float) -> float:
        return (dim * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(base))

    low, high = corr_dim(beta_fast), corr_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrap = 1 - ramp  # [dim/2] weight of the unscaled frequency
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrap) + (1.0 / pos_freqs) * extrap
    return inv_freq, float(attn_factor)


def _dynamic_inv_freq(p: dict[str, Any], dim: int, max_pos: int, seq_lens: torch.Tensor) -> torch.Tensor:
    """One row per entry of ``seq_lens`` ([n] -> [n, dim/2])."""
    factor = p["factor"]
    seq = torch.clamp(seq_lens.double(), min=max_pos)
    base = p["rope_theta"] * ((factor * seq / max_pos) - (factor - 1)) ** (dim / (dim - 2))  # [n]
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (base.float()[:, None] ** exponents[None, :])


def compute_inv_freq(
    rope: dict[str, Any], dim: int, max_pos: int, seq_len: int | None = None
) -> tuple[torch.Tensor, float]:
    """(inv_freq [dim/2] float32, attention_factor) exactly as transformers' rope init.

    ``seq_len`` only matters for ``dynamic`` (defaults to ``max_pos``).
    """
    rope_type = rope.get("rope_type", "default")
    if rope_type == "default":
        return _default_inv_freq(rope["rope_theta"], dim), 1.0
    if rope_type == "linear":
        return _default_inv_freq(rope["rope_theta"], dim) / rope["factor"], 1.0
    if rope_type == "llama3":
        return _llama3_inv_freq(rope, dim), 1.0
    if rope_type == "yarn":
        return _yarn_inv_freq(rope, dim, max_pos)
    if rope_type == "dynamic":
        seq = torch.tensor([seq_len or max_pos])
        return _dynamic_inv_freq(rope, dim, max_pos, seq)[0], 1.0
    raise NotImplementedError(f"rope_type {rope_type!r}")


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RotaryEmbedding(nn.Module):
    """Applies rope to q [T, Hq, D] and k [T, Hk, D] at absolute ``positions`` [T]."""

    def __init__(self, head_dim: int, rope: dict[str, Any], max_position_embeddings: int):
        super().__init__()
        self.head_dim = head_dim
        self.rope = dict(rope)
        self.max_pos = max_position_embeddings
        self.dynamic = self.rope.get("rope_type") == "dynamic"
        self.inv_freq, self.attention_factor = compute_inv_freq(self.rope, head_dim, self.max_pos)
        self.cos_sin: torch.Tensor | None = None  # [max_cached, 2, D] float32
        self._ensure(self.max_pos)

    def _table_rows(self, start: int, end: int) -> torch.Tensor:
        pos = torch.arange(start, end, dtype=torch.int64)
        if self.dynamic:
            inv = _dynamic_inv_freq(self.rope, self.head_dim, self.max_pos, pos + 1)  # [n, D/2]
            freqs = pos[:, None].float() * inv
        else:
            freqs = pos[:, None].float() * self.inv_freq[None, :]  # [n, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [n, D]
        return torch.stack((emb.cos(), emb.sin()), dim=1) * self.attention_factor  # [n, 2, D]

    def _ensure(self, length: int) -> None:
        have = 0 if self.cos_sin is None else self.cos_sin.shape[0]
        if length <= have:
            return
        new_len = max(length, 2 * have)
        rows = self._table_rows(have, new_len)
        if self.cos_sin is not None:
            rows = torch.cat((self.cos_sin, rows.to(self.cos_sin.device)))
        self.cos_sin = rows

    def table(self, max_position: int, device: torch.device) -> torch.Tensor:
        """The whole cos/sin table [P, 2, D] float32 (row p: cos, sin at position p), P > max_position."""
        self._ensure(max_position + 1)
        if self.cos_sin.device != device:
            self.cos_sin = self.cos_sin.to(device)
        return self.cos_sin

    def cos_sin_for(self, positions: torch.Tensor, max_position: int | None = None) -> torch.Tensor:
        """[T] positions -> [T, 2, D] float32 (``max_position`` avoids a device sync)."""
        if max_position is None:
            max_position = int(positions.max()) if positions.numel() else 0
        return self.table(max_position, positions.device).index_select(0, positions)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if cos_sin is None:
            cos_sin = self.cos_sin_for(positions)
        cos = cos_sin[:, 0, None, :].to(q.dtype)  # [T, 1, D]
        sin = cos_sin[:, 1, None, :].to(q.dtype)
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
