"""One GGUF file (llama.cpp's format) as a model: its config, tokenizer, sampling defaults and weights.

vLLM reads a ``.gguf`` checkpoint the same way (``vllm serve ./model.gguf``): the file's metadata becomes a
Hugging Face config and tokenizer through transformers' GGUF support, and its tensors are read with the
``gguf`` package and dequantized when the model loads, each to float32 on the CPU, then cast by its
parameter's ``weight_loader`` to the engine's dtype.

* Tensor names: llama.cpp's (``blk.N.attn_q.weight``) are mapped back to Hugging Face's
  (``model.layers.N.self_attn.q_proj.weight``) by ``GGUF_TO_HF``; a name it does not know is passed on
  unchanged, so the loader reports it as unexpected.
* llama.cpp's converter permutes the rows of a Llama's q and k projections (its rope pairs neighbouring
  dimensions, Hugging Face's pairs the two halves); ``_unpermute`` undoes it, as transformers does. It leaves
  Gemma's alone, but stores Gemma's norm weights as 1 + w (its ``norm_shift``): 1 is taken off again, as
  transformers does, so that the model's norms compute Hugging Face's x * (1 + w).
* Types: those the ``gguf`` package dequantizes (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, the K-quants
  and others it lists); any other raises ``ValueError`` naming the tensor and its type before anything loads.
  Tensors stored as Q8_0, Q4_0, Q4_1, Q5_0 or Q5_1 can also be read as their block bytes (``stored_types``,
  ``iter_weights(blocks=...)``), which the quantized layers keep as they are; so can the K-quants (Q4_K,
  Q5_K, Q6_K: ``QuantType.super_block``).
"""

from __future__ import annotations

import gc
import mmap
import os
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np
import torch

from engine.model.quantization.blocks import QuantType, quantize

# llama.cpp's architecture name -> the Hugging Face class the engine builds for it.
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}
# Architectures whose q/k rows llama.cpp's converter permuted (its LlamaModel and subclasses).
_PERMUTED_QK = frozenset({"llama", "mistral"})
# llama.cpp's tensor names -> Hugging Face's (per decoder block: the part after ``blk.N.``).
GGUF_TO_HF = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
GGUF_BLOCK_TO_HF = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Where an architecture's block tensors differ from the above (Gemma's four norms a layer).
GGUF_ARCH_BLOCK_TO_HF = {
    "gemma3": {
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    },
}
# Architectures whose norm weights llama.cpp's converter stored as 1 + w.
_SHIFTED_NORMS = frozenset({"gemma3"})
# Tensors a GGUF file may carry that the config already expresses (llama3's rope frequencies).
_SKIPPED = frozenset({"rope_freqs.weight"})
# GGUF's general.sampling.* keys -> generation_config.json's names.
_SAMPLING_KEYS = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_k": "top_k",
    "general.sampling.top_p": "top_p",
    "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repetition_penalty",
}
_BLOCK_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")
_UNQUANTIZED = {"F32": np.float32, "F16": np.float16}


def hf_tensor_name(gguf_name: str, architecture: str) -> str:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight`` (in ``architecture``, llama.cpp's
    name); unknown names unchanged."""
    match = _BLOCK_NAME.match(gguf_name)
    if match is not None:
        index, part, kind = match.groups()
        parts = {**GGUF_BLOCK_TO_HF, **GGUF_ARCH_BLOCK_TO_HF.get(architecture, {})}
        if part in parts:
            return f"model.layers.{index}.{parts[part]}.{kind}"
        return gguf_name
    stem, _, kind = gguf_name.rpartition(".")
    return f"{GGUF_TO_HF[stem]}.{kind}" if stem in GGUF_TO_HF else gguf_name


def _unpermute(rows: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (``LlamaModel.permute`` in its converter)."""
    half_pairs = rows.shape[0] // num_heads // 2
    return rows.reshape(num_heads, half_pairs, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def _free_parse() -> None:
    """Frees a dropped ``gguf.GGUFReader`` now: its fields refer to each other, so only the cycle collector
    frees them, and until then the next parse takes memory of its own."""
    gc.collect()


@dataclass(frozen=True)
class _StoredTensor:
    """Where one tensor lies in the file, kept from the first parse (``iter_weights`` maps its bytes with no
    parse of its own)."""

    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF's order: the fastest-varying dim first
    data_offset: int
    n_bytes: int

    def data(self, mapping: np.ndarray) -> np.ndarray:
        """Its values (F32, F16) or block bytes [..., row bytes] in ``mapping`` (the file's bytes), as a
        ``gguf.GGUFReader`` tensor's ``data``: rows first."""
        from gguf.quants import quant_shape_to_byte_shape

        raw = mapping[self.data_offset : self.data_offset + self.n_bytes]
        rows_first = tuple(reversed(self.shape))
        kind = self.tensor_type.name
        if kind in _UNQUANTIZED:
            return raw.view(_UNQUANTIZED[kind]).reshape(rows_first)
        return raw.reshape(quant_shape_to_byte_shape(rows_first, self.tensor_type))


def _drop_pages(mapping: np.memmap, tensor: _StoredTensor) -> None:
    """Unmaps ``tensor``'s bytes, read, from this process: its resident memory would otherwise hold the whole
    file beside the weights read out of it until the reader goes. The page cache keeps them; a read maps them
    back."""
    mapping = getattr(mapping, "_mmap", None)  # numpy's memmap of the whole file, from offset 0
    if mapping is None or not hasattr(mapping, "madvise"):
        return
    start = tensor.data_offset // mmap.PAGESIZE * mmap.PAGESIZE
    mapping.madvise(mmap.MADV_DONTNEED, start, tensor.data_offset + tensor.n_bytes - start)


class GGUFFile:
    """A ``.gguf`` file read as a model source (see the module docstring); metadata is read once.

    What it keeps of the parse is small: the single-valued fields and each tensor's name, type, shape and
    place. A parsed ``gguf.GGUFReader`` costs far more than the file's metadata (about 166 MB for SmolLM2's
    98 MB file: a numpy view per token of its vocabulary and merges; seconds to build for Gemma's 262,144
    tokens), and an open file is cached for the process's life (``engine.model.source``); each later parse
    (transformers' config and tokenizer) is freed before the next one starts (``_free_parse``), so that no two
    are held at once."""

    def __init__(self, path: str) -> None:
        import gguf

        self.path = path
        reader = gguf.GGUFReader(path)
        self._fields = {key: field.contents() for key, field in reader.fields.items() if len(field.data) == 1}
        self._tensors = [
            _StoredTensor(t.name, t.tensor_type, tuple(int(n) for n in t.shape), int(t.data_offset), int(t.n_bytes))
            for t in reader.tensors
        ]
        del reader
        _free_parse()
        self._check_types()

    def _field(self, key: str, default: Any = None) -> Any:
        return self._fields.get(key, default)

    @property
    def gguf_architecture(self) -> str:
        return self._field("general.architecture")

    def _check_types(self) -> None:
        from gguf.quants import _type_traits

        for tensor in self._tensors:
            kind = tensor.tensor_type
            if kind.name not in _UNQUANTIZED and kind not in _type_traits:
                raise ValueError(
                    f"{self.path}: tensor {tensor.name!r} is stored as GGUF type {kind.name}, which Serval "
                    f"cannot dequantize (supported: F32, F16, {', '.join(t.name for t in _type_traits)})."
                )

    @cached_property
    def hf_config(self) -> dict[str, Any]:
        """The Hugging Face ``config.json`` dict transformers derives from the metadata, with ``architectures``."""
        from transformers import AutoConfig

        arch = self.gguf_architecture
        if arch not in ARCHITECTURES:
            raise ValueError(
                f"{self.path}: GGUF architecture {arch!r} is not supported; supported: {', '.join(ARCHITECTURES)}"
            )
        directory, name = os.path.split(os.path.abspath(self.path))
        config = AutoConfig.from_pretrained(directory, gguf_file=name).to_dict()
        _free_parse()  # transformers' parse of the metadata
        return {**config, "architectures": [ARCHITECTURES.get(config.get("model_type"), ARCHITECTURES[arch])]}

    @cached_property
    def generation_config(self) -> dict[str, Any]:
        """Special token ids and the file's ``general.sampling.*`` defaults, in generation_config.json's names."""
        config = {
            key: self._field(f"tokenizer.ggml.{key}")
            for key in ("bos_token_id", "eos_token_id")
            if self._field(f"tokenizer.ggml.{key}") is not None
        }
        for gguf_key, name in _SAMPLING_KEYS.items():
            if (value := self._field(gguf_key)) is not None:
                config[name] = value
        return config

    def load_tokenizer(self):
        """transformers' conversion of the embedded vocabulary, merges and chat template."""
        from transformers import AutoTokenizer

        directory, name = os.path.split(os.path.abspath(self.path))
        tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
        _free_parse()  # transformers' parse of the metadata
        return tokenizer

    def stored_types(self) -> dict[str, str]:
        """Hugging Face name -> its GGUF tensor type (``Q4_K``, ``F32``, ...)."""
        arch = self.gguf_architecture
        return {hf_tensor_name(t.name, arch): t.tensor_type.name for t in self._tensors if t.name not in _SKIPPED}

    def iter_weights(
        self, name_filter: Callable[[str], bool] | None = None, blocks: Mapping[str, QuantType] = {}
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """(Hugging Face name, CPU tensor), one tensor at a time, in the file's order: float32 values, or
        block bytes for the names in ``blocks`` (as stored, or quantized from the dequantized values).

        The tensors are read through a mapping of the file of their own, dropped at the end, and each tensor's
        pages are unmapped once it is read: the file is never resident beside the weights."""
        from tqdm import tqdm

        arch = self.gguf_architecture
        permuted, shifted_norms = arch in _PERMUTED_QK, arch in _SHIFTED_NORMS
        heads = {
            "q_proj": self.hf_config["num_attention_heads"],
            "k_proj": self.hf_config.get("num_key_value_heads") or self.hf_config["num_attention_heads"],
        }
        mapping = np.memmap(self.path, mode="r")
        tensors = tqdm(self._tensors, desc=f"Reading {os.path.basename(self.path)}", unit="tensor")
        for tensor in tensors:
            name = hf_tensor_name(tensor.name, arch)
            if tensor.name in _SKIPPED or (name_filter is not None and not name_filter(name)):
                continue
            values = self._read(tensor, tensor.data(mapping), blocks.get(name))  # a copy
            _drop_pages(mapping, tensor)
            projection = name.split(".")[-2]
            if permuted and projection in heads:
                values = _unpermute(values, heads[projection])  # rows: of values or of blocks alike
            if shifted_norms and name.endswith("norm.weight"):
                values = values - np.float32(1)  # float32 norms, never blocks (the quantization plan's)
            yield name, torch.from_numpy(np.ascontiguousarray(values))
        del mapping, tensors

    @classmethod
    def _read(cls, tensor: _StoredTensor, data: np.ndarray, qtype: QuantType | None) -> np.ndarray:
        """The tensor as float32 values, or as ``qtype``'s block bytes [rows, row_bytes] when asked."""
        if qtype is not None and QuantType.of_gguf(tensor.tensor_type.name) is qtype:
            return np.array(data).reshape(tensor.shape[-1], -1)  # a copy: the file is read-only
        values = cls._dequantize(tensor, data)
        return values if qtype is None else quantize(torch.from_numpy(values), qtype).numpy()

    @staticmethod
    def _dequantize(tensor: _StoredTensor, data: np.ndarray) -> np.ndarray:
        """The tensor's values as float32, in Hugging Face's (rows, columns) order."""
        from gguf.quants import dequantize

        shape = tuple(reversed(tensor.shape))  # GGUF lists the fastest-varying dim first
        if tensor.tensor_type.name in _UNQUANTIZED:
            values = np.asarray(data).astype(np.float32)
        else:
            values = dequantize(np.asarray(data), tensor.tensor_type).astype(np.float32, copy=False)
        return values.reshape(shape)

    @property
    def num_tensors(self) -> int:
        return len(self._tensors)

    def describe(self) -> dict[str, Any]:
        """What a model card names: the model, its license, and how many tensors each GGUF type holds."""
        types: dict[str, int] = {}
        for tensor in self._tensors:
            types[tensor.tensor_type.name] = types.get(tensor.tensor_type.name, 0) + 1
        return {
            "name": self._field("general.name"),
            "organization": self._field("general.organization"),
            "license": self._field("general.license"),
            "architecture": self.gguf_architecture,
            "tensor_types": types,
        }
