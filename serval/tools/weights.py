"""Deterministic random weights for the ``make-model`` checkpoints.

Tensors are generated directly by Hugging Face parameter name (names and
shapes come from a meta-device instance of the HF model, so they are exactly
what ``from_pretrained`` expects) and written shard by shard with
safetensors, so even the ~0.4B ``w1`` preset never exists twice in memory.

Init scheme (why not the HF default): with HF's ``std=0.02`` everywhere the
logits of a random model are nearly flat, so greedy argmax ties flip on
float rounding noise and exact-token comparisons against transformers are
flaky.  Instead every tensor is scaled to keep activations at unit RMS:

* ``q/k/v/gate/up_proj``: ``N(0, 1/fan_in)`` -> unit-RMS outputs, attention
  scores of order 1 (softly peaked, not uniform).
* ``o_proj``/``down_proj`` (residual writers): ``N(0, 1/fan_in)`` as well;
  with pre-norm blocks the residual stream RMS then grows slowly, layer by
  layer.
* ``embed_tokens`` and ``lm_head``: ``N(0, (LOGIT_STD / sqrt(hidden))^2)``,
  so the final (unit-RMS) hidden state gives logits with std ~LOGIT_STD.
  Tied checkpoints share this tensor.
* norm weights: ``1 + N(0, 0.1^2)`` (not exactly 1.0, so an engine that
  forgets to apply a norm weight fails fidelity tests).  The final
  ``model.norm`` weight additionally gets random signs: with tied embeddings
  the residual stream still carries the current token's embedding ``e_x``,
  so ``logits[x] ~ |e_x|^2`` wins and greedy decoding copies the last token
  forever.  Random signs cancel that bias (sum_i s_i e_i^2 ~ 0), and greedy
  text varies.  A larger residual-writer gain helped less and inflated
  the residual stream.
* biases (Qwen2 q/k/v): ``N(0, 0.1^2)``.

On random prompts the top-1 vs top-2 logit gap is far above float32 noise
(tests/serval/test_make_model.py checks greedy agreement with transformers).

Every tensor uses its own ``torch.Generator`` seeded from ``(seed, name)``, so
the bytes do not depend on generation order or shard layout, nor on how many
tensors are generated at once (``threads``: torch's normal sampling runs on
one core per generator and releases the GIL, so threads scale it).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import zlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from safetensors.torch import save_file

LOGIT_STD = 4.0
NORM_JITTER = 0.1
BIAS_STD = 0.1
FINAL_NORM = "model.norm.weight"

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parameter_shapes(config) -> dict[str, tuple[int, ...]]:
    """Return ``{hf_name: shape}`` for the causal LM described by ``config``.

    Tied parameters appear once (under the embedding's name), exactly like
    ``save_pretrained`` writes them.
    """
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def _std_for(name: str, shape: tuple[int, ...], hidden: int) -> float:
    if name.endswith("embed_tokens.weight") or name.endswith("lm_head.weight"):
        return LOGIT_STD / math.sqrt(hidden)
    if name.endswith(".bias"):
        return BIAS_STD
    return 1.0 / math.sqrt(shape[-1])


def init_tensor(name: str, shape: tuple[int, ...], seed: int, hidden: int) -> torch.Tensor:
    """Deterministically generate the float32 tensor for parameter ``name``."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    values = torch.randn(shape, generator=gen, dtype=torch.float32)
    if name.endswith("norm.weight"):
        values = values.mul_(NORM_JITTER).add_(1.0)
        if name == FINAL_NORM:  # random signs: see the module docstring
            values.mul_(torch.randint(0, 2, shape, generator=gen).mul_(2).sub_(1))
        return values
    return values.mul_(_std_for(name, shape, hidden))


def _plan_shards(shapes: dict[str, tuple[int, ...]], itemsize: int, max_shard_size: int | None) -> list[list[str]]:
    shards: list[list[str]] = [[]]
    used = 0
    for name, shape in shapes.items():
        nbytes = math.prod(shape) * itemsize
        if max_shard_size and shards[-1] and used + nbytes > max_shard_size:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += nbytes
    return shards


def _shard_tensors(
    names: list[str], shapes, seed: int, hidden: int, dtype: torch.dtype, pool: ThreadPoolExecutor | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    def make(name: str) -> torch.Tensor:
        return init_tensor(name, shapes[name], seed, hidden).to(dtype).contiguous()

    yield from zip(names, pool.map(make, names) if pool is not None else map(make, names))


def write_weights(
    directory: Path, config, seed: int, dtype: str, max_shard_size: int | None = None, threads: int = 1
) -> int:
    """Write safetensors weights for ``config`` into ``directory``.

    A single ``model.safetensors`` unless ``max_shard_size`` (bytes) forces
    several ``model-0000i-of-0000n.safetensors`` plus the HF index file.
    ``threads`` > 1 generates that many tensors at once (same bytes).
    Returns the number of parameters written.
    """
    torch_dtype = _DTYPES[dtype]
    shapes = parameter_shapes(config)
    itemsize = torch.empty((), dtype=torch_dtype).element_size()
    shards = _plan_shards(shapes, itemsize, max_shard_size)
    weight_map: dict[str, str] = {}
    with ThreadPoolExecutor(threads) if threads > 1 else contextlib.nullcontext() as pool:
        for index, names in enumerate(shards, start=1):
            filename = (
                "model.safetensors" if len(shards) == 1 else f"model-{index:05d}-of-{len(shards):05d}.safetensors"
            )
            tensors = dict(_shard_tensors(names, shapes, seed, config.hidden_size, torch_dtype, pool))
            save_file(tensors, str(directory / filename), metadata={"format": "pt"})
            os.chmod(directory / filename, 0o644)  # safetensors creates files as 0600
            del tensors
            weight_map.update({name: filename for name in names})
    n_params = sum(math.prod(s) for s in shapes.values())
    if len(shards) > 1:
        index_doc = {
            "metadata": {"total_size": n_params * itemsize, "total_parameters": n_params},
            "weight_map": weight_map,
        }
        (directory / "model.safetensors.index.json").write_text(json.dumps(index_doc, indent=2, sort_keys=True) + "\n")
    return n_params
