"""What one decode step must read and what one prefill token must compute, counted from a checkpoint.

Pure arithmetic on the checkpoint's tensor shapes (read from the safetensors headers, so nothing is
loaded) and its config.json; the phases store these counts and ``report`` divides them by the
measured ceilings:

* decode roofline step time = (weight bytes read per step + KV bytes read per step) / copy bandwidth.
  Weights: every linear, every norm, the whole lm_head, and only ``batch`` rows of the embedding
  table. KV: every sequence's keys and values over its context, at the mean context of the decode.
* prefill roofline tokens/s = matmul FLOP/s / FLOPs per prompt token, where FLOPs per token =
  2 x (parameters of the linears) + causal attention (QK^T and PV over half the prompt on average)
  + the lm_head for the prompt's last token (spread over the prompt).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

EMBED = "model.embed_tokens.weight"
LM_HEAD = "lm_head.weight"
ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


def checkpoint_shapes(model_dir: str | Path) -> dict[str, tuple[int, ...]]:
    """``{name: shape}`` of every tensor in the checkpoint's safetensors files (headers only)."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                shapes[name] = tuple(f.get_slice(name).get_shape())
    return shapes


@dataclass(frozen=True)
class ModelFacts:
    """Shapes and parameter counts of one checkpoint (counts in elements, not bytes)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    matrix_params: int  # 2-D weights of the decoder layers (the linears)
    vector_params: int  # 1-D weights: norms, biases
    embed_params: int
    lm_head_params: int  # 0 when tied to the embedding
    total_params: int

    @classmethod
    def from_checkpoint(cls, model_dir: str | Path) -> ModelFacts:
        config = json.loads((Path(model_dir) / "config.json").read_text())
        return cls.from_shapes(config, checkpoint_shapes(model_dir))

    @classmethod
    def from_shapes(cls, config: dict, shapes: dict[str, tuple[int, ...]]) -> ModelFacts:
        heads = config["num_attention_heads"]
        head_dim = config.get("head_dim") or config["hidden_size"] // heads
        counts = {name: math.prod(shape) for name, shape in shapes.items()}
        other = {name: n for name, n in counts.items() if name not in (EMBED, LM_HEAD)}
        return cls(
            hidden=config["hidden_size"],
            layers=config["num_hidden_layers"],
            heads=heads,
            kv_heads=config.get("num_key_value_heads", heads),
            head_dim=head_dim,
            vocab=config["vocab_size"],
            tied=LM_HEAD not in shapes,
            matrix_params=sum(n for name, n in other.items() if len(shapes[name]) == 2),
            vector_params=sum(n for name, n in other.items() if len(shapes[name]) != 2),
            embed_params=counts[EMBED],
            lm_head_params=counts.get(LM_HEAD, 0),
            total_params=sum(counts.values()),
        )

    def as_dict(self) -> dict:
        return asdict(self)

    # ------------------------------------------------------------------ decode

    def decode_weight_bytes(self, batch: int, dtype: str) -> int:
        """Weight bytes one decode step reads: linears, norms, the whole lm_head, ``batch`` embedding rows."""
        lm_head = self.vocab * self.hidden  # the tied embedding, when tied: read whole as the lm_head
        return ITEMSIZE[dtype] * (self.matrix_params + self.vector_params + lm_head + batch * self.hidden)

    def kv_bytes_per_token(self, dtype: str) -> int:
        """Keys and values of one token over every layer."""
        return ITEMSIZE[dtype] * self.layers * 2 * self.kv_heads * self.head_dim

    def decode_kv_read_bytes(self, batch: int, mean_context_len: float, dtype: str) -> float:
        """KV bytes one decode step reads: every sequence's cache at ``mean_context_len`` tokens."""
        return batch * mean_context_len * self.kv_bytes_per_token(dtype)

    # ----------------------------------------------------------------- prefill

    def prefill_flops_per_token(self, prompt_len: int) -> float:
        """FLOPs per prompt token of a ``prompt_len``-token causal prefill (ideal kernels)."""
        linears = 2 * self.matrix_params
        # QK^T and PV: 2 * head_dim FLOPs each per (query, key) pair and head; a causal query sees
        # (prompt_len + 1) / 2 keys on average.
        attention = 4 * self.layers * self.heads * self.head_dim * (prompt_len + 1) / 2
        lm_head = 2 * self.vocab * self.hidden / prompt_len  # the last token only
        return linears + attention + lm_head


def decode_mean_context_len(prompt_len: int, output_len: int) -> float:
    """Mean context of the ``output_len`` decode steps after the first token.

    The step that makes output token k + 1 (k = 1 .. output_len) attends over prompt_len + k tokens.
    """
    return prompt_len + (output_len + 1) / 2


def decode_roofline(
    facts: dict, batch: int, prompt_len: int, output_len: int, dtype: str, copy_bytes_per_s: float
) -> dict:
    """Bytes one decode step reads and the step time / tokens/s the copy bandwidth allows."""
    model = ModelFacts(**facts)
    mean_context_len = decode_mean_context_len(prompt_len, output_len)
    weight_bytes = model.decode_weight_bytes(batch, dtype)
    kv_bytes = model.decode_kv_read_bytes(batch, mean_context_len, dtype)
    step_s = (weight_bytes + kv_bytes) / copy_bytes_per_s
    return {
        "weight_bytes": weight_bytes,
        "kv_read_bytes": kv_bytes,
        "mean_context_len": mean_context_len,
        "step_s": step_s,
        "tokens_per_s": batch / step_s,
    }


def prefill_roofline(facts: dict, prompt_len: int, matmul_flops_per_s: float) -> dict:
    flops_per_token = ModelFacts(**facts).prefill_flops_per_token(prompt_len)
    return {"flops_per_token": flops_per_token, "tokens_per_s": matmul_flops_per_s / flops_per_token}
