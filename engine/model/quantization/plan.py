"""Which layers of a model keep their weights in block formats, decided before the checkpoint loads.

``plan_quantization(model, stored_types, packed, quantization)`` returns a ``QuantizationPlan``: module name ->
format (the layers to ``quantize_as``) and checkpoint tensor name -> format (what the source must yield as
block bytes: ``ModelSource.iter_weights(..., blocks=...)``); its ``describe`` is the load's one-line account
(what is kept as blocks, what is dequantized). ``quantization`` is ``ModelConfig.quantization``:

* ``"gguf"``: every linear, embedding and LM head whose checkpoint tensors are stored in formats Serval
  multiplies (``QuantType``: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, the K-quants) keeps them. A packed layer (qkv,
  gate_up) whose parts are stored in different ones keeps each part in its own (``parted.PartedBlockMethod``:
  the module maps to its shard id -> format); one with a part in another type is dequantized to the model's
  dtype, as is every norm.
* ``"int8"``: every linear layer (not the embedding and LM head, as vLLM's weight-only modes) is quantized
  to Q8_0 as it loads.
* ``"none"``: nothing kept quantized. ``None``: ``"gguf"`` if the source stores any such block, else none.

A tied LM head follows its embedding.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from engine.model.layers.linear import LinearBase
from engine.model.loader import map_checkpoint_name
from engine.model.quantization.block_method import BlockQuantLinearMethod
from engine.model.quantization.blocks import QuantType
from engine.model.quantization.parted import PartedBlockMethod

_WEIGHT = ".weight"
FLOAT_TYPES = frozenset({"F64", "F32", "F16", "BF16"})  # stored types that hold values, not blocks


@dataclass(frozen=True)
class QuantizationPlan:
    modules: dict[str, QuantType | tuple] = field(default_factory=dict)  # a tuple: ((shard id, format), ...)
    checkpoint: dict[str, QuantType] = field(default_factory=dict)

    def apply(self, model: nn.Module, compute_dtype: torch.dtype) -> None:
        """Gives each planned module its block method (modules in registration order: an embedding
        before the LM head tied to it); one method per format, or per set of parts' formats."""
        methods = {
            kept: PartedBlockMethod(dict(kept), compute_dtype)
            if isinstance(kept, tuple)
            else BlockQuantLinearMethod(kept, compute_dtype)
            for kept in set(self.modules.values())
        }
        for name, module in model.named_modules():
            if name in self.modules:
                module.quantize_as(methods[self.modules[name]])

    def describe(self, stored_types: Mapping[str, str], wanted: Callable[[str], bool]) -> str:
        """The checkpoint tensors this rank loads (``wanted``), counted by stored type and what becomes of
        them: ``kept as blocks: Q4_K 97, Q6_K 11; dequantized: Q2_K 1; float: F32 37``."""
        counts: dict[str, Counter] = {"kept as blocks": Counter(), "dequantized": Counter(), "float": Counter()}
        for name, kind in stored_types.items():
            if wanted(name):
                fate = (
                    "kept as blocks" if name in self.checkpoint else "float" if kind in FLOAT_TYPES else "dequantized"
                )
                counts[fate][kind] += 1
        return "; ".join(
            f"{fate}: " + ", ".join(f"{kind} {n}" for kind, n in sorted(kinds.items()))
            for fate, kinds in counts.items()
            if kinds
        )


def plan_quantization(
    model: nn.Module, stored_types: Mapping[str, str], packed: list, quantization: str | None
) -> QuantizationPlan:
    """The plan (module docstring) for ``model``; ``stored_types``: the source's checkpoint name -> stored type
    (``ModelSource.stored_types()``); ``packed``: the model's packed-module table."""
    stored = {name: QuantType.of_gguf(kind) for name, kind in stored_types.items()}
    if quantization is None:
        quantization = "gguf" if any(stored.values()) else "none"
    if quantization == "none":
        return QuantizationPlan()
    if quantization == "gguf" and not any(stored.values()):
        raise ValueError(
            "quantization='gguf' needs a .gguf model storing Q8_0, Q4_0, Q4_1, Q5_0 or Q5_1 weights; this one "
            "stores none (quantization='int8' quantizes a float checkpoint as it loads)"
        )
    targets = _targets(model, stored, packed)
    if quantization == "int8":
        linears = {name for name, m in model.named_modules() if isinstance(m, LinearBase)}
        chosen = {ckpt: QuantType.Q8_0 for ckpt, (module, _) in targets.items() if module in linears}
    else:
        chosen = _kept_modules(stored, targets, dict(model.named_modules()))
    plan = QuantizationPlan(_module_formats(chosen, targets), chosen)
    lm_head = getattr(model, "lm_head", None)
    embed = plan.modules.get("model.embed_tokens")
    if embed is not None and lm_head is not None and lm_head.is_tied:
        plan.modules["lm_head"] = embed
    return plan


def _targets(model: nn.Module, stored: Mapping[str, object], packed: list) -> dict[str, tuple[str, object]]:
    """Checkpoint weight name -> (the model module that loads it, its shard id), this stage's weights only."""
    modules = dict(model.named_modules())
    targets = {}
    for stage_name, ckpt in model.stage_weights((n, n) for n in stored):  # the checkpoint name rides along
        if not stage_name.endswith(_WEIGHT):
            continue
        name, shard_id = map_checkpoint_name(stage_name, packed)
        module = name.removesuffix(_WEIGHT)
        if hasattr(modules.get(module), "quantize_as"):
            targets[ckpt] = (module, shard_id)
    return targets


def _kept_modules(
    stored: Mapping[str, QuantType | None], targets: dict[str, tuple[str, object]], modules: dict[str, nn.Module]
) -> dict[str, QuantType]:
    """The checkpoint weights of modules whose every part is stored in a block format whose blocks this rank's
    shard holds whole (a row-parallel shard of 128 columns cannot keep 256-weight super-blocks)."""
    parts: dict[str, list[str]] = {}
    for ckpt, (module, _) in targets.items():
        parts.setdefault(module, []).append(ckpt)
    chosen = {}
    for module, names in parts.items():
        width = getattr(modules[module], "in_features", None)
        if all(stored[n] is not None and (width is None or width % stored[n].block_weights == 0) for n in names):
            chosen.update((name, stored[name]) for name in names)
    return chosen


def _module_formats(
    chosen: dict[str, QuantType], targets: dict[str, tuple[str, object]]
) -> dict[str, QuantType | tuple]:
    """Module -> its format, or for a packed module whose parts differ, ((shard id, format), ...)."""
    parts: dict[str, dict] = {}
    for ckpt, qtype in chosen.items():
        module, shard_id = targets[ckpt]
        parts.setdefault(module, {})[shard_id] = qtype
    return {
        module: next(iter(formats.values())) if len(set(formats.values())) == 1 else tuple(formats.items())
        for module, formats in parts.items()
    }
