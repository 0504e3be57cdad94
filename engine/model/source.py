"""Where a model comes from: a Hugging Face directory or one GGUF file, behind one interface.

``open_model_source(path)`` returns a ``ModelSource``; every part of the engine that reads a checkpoint
(the architecture, the context length, the tokenizer, the EOS ids and sampling defaults, the weights)
goes through it, so ``LLM(model="x.gguf")``, ``serval serve x.gguf`` and ``model_source: x.gguf`` take
the same paths as a directory.

* A directory holding ``config.json`` is a Hugging Face checkpoint (``HFDirectory``: safetensors weights,
  ``generation_config.json`` when present, the tokenizer files).
* A file named ``*.gguf`` is llama.cpp's format (``engine.model.gguf_file.GGUFFile``: weights dequantized
  as they load; config, tokenizer and chat template from its metadata).
* Anything else raises ``ValueError`` saying what a model source is. Serval never downloads: an id such
  as ``org/name`` that is not a local path gets that said, with the way to fetch it.

A GGUF file is opened once per process (reading its metadata and converting its tokenizer take seconds).
"""

from __future__ import annotations

import functools
import glob
import json
import os
from collections.abc import Callable, Iterator, Mapping
from functools import cached_property
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from engine.model.quantization.blocks import QuantType

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class ModelSource(Protocol):
    """What the engine reads of a model, whatever holds it."""

    path: str

    @property
    def hf_config(self) -> dict[str, Any]:
        """config.json's dict (``architectures`` set)."""

    @property
    def generation_config(self) -> dict[str, Any]:
        """generation_config.json's dict (``eos_token_id``, sampling defaults); ``{}`` when there is none."""

    def load_tokenizer(self):
        """A transformers tokenizer (with the model's chat template when it has one)."""

    def stored_types(self) -> dict[str, str]:
        """Every weight's Hugging Face name -> the type it is stored as: a GGUF tensor type (``Q4_K``,
        ``F32``; ``QuantType.of_gguf`` names the block formats Serval multiplies) or a safetensors dtype."""

    def iter_weights(
        self, name_filter: Callable[[str], bool] | None = None, blocks: Mapping[str, QuantType] = {}
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """(Hugging Face tensor name, CPU tensor), one at a time; names ``name_filter`` refuses are never read.

        A tensor named in ``blocks`` comes as uint8 block bytes of that format (``engine.model.quantization
        .blocks``): as stored when it is stored so, else quantized from its values."""


class HFDirectory:
    """A Hugging Face checkpoint directory: ``config.json``, safetensors, tokenizer files."""

    def __init__(self, path: str) -> None:
        self.path = path

    @cached_property
    def hf_config(self) -> dict[str, Any]:
        return _read_json(os.path.join(self.path, "config.json"))

    @cached_property
    def generation_config(self) -> dict[str, Any]:
        path = os.path.join(self.path, "generation_config.json")
        return _read_json(path) if os.path.isfile(path) else {}

    def load_tokenizer(self):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.path)

    def safetensors_files(self) -> list[str]:
        """The checkpoint files (the index's shards, else the single file, else any *.safetensors)."""
        index = os.path.join(self.path, INDEX_FILE)
        if os.path.isfile(index):
            shards = sorted(set(_read_json(index)["weight_map"].values()))
            return [os.path.join(self.path, s) for s in shards]
        single = os.path.join(self.path, SINGLE_FILE)
        if os.path.isfile(single):
            return [single]
        files = sorted(glob.glob(os.path.join(self.path, "*.safetensors")))
        if not files:
            raise FileNotFoundError(f"no safetensors weights in {self.path!r}")
        return files

    def stored_types(self) -> dict[str, str]:
        from safetensors import safe_open

        types: dict[str, str] = {}
        for path in self.safetensors_files():
            with safe_open(path, framework="pt", device="cpu") as f:
                types.update((name, f.get_slice(name).get_dtype()) for name in f.keys())
        return types

    def iter_weights(
        self, name_filter: Callable[[str], bool] | None = None, blocks: Mapping[str, QuantType] = {}
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Read lazily with ``safe_open``: never a whole file at once."""
        from safetensors import safe_open

        from engine.model.quantization.blocks import quantize

        for path in self.safetensors_files():
            with safe_open(path, framework="pt", device="cpu") as f:
                for name in f.keys():
                    if name_filter is None or name_filter(name):
                        tensor = f.get_tensor(name)
                        yield name, tensor if name not in blocks else quantize(tensor, blocks[name])


def is_gguf_path(path: str) -> bool:
    return path.endswith(".gguf") and os.path.isfile(path)


def open_model_source(path: str) -> ModelSource:
    """The source at ``path`` (see the module docstring); ValueError when ``path`` is no model."""
    path = os.fspath(path)
    if is_gguf_path(path):
        return _open_gguf(os.path.abspath(path))
    if os.path.isfile(os.path.join(path, "config.json")):
        return HFDirectory(path)  # files read when asked: a directory's files may be rewritten
    raise ValueError(_not_a_model(path))


@functools.lru_cache(maxsize=4)
def _open_gguf(path: str) -> ModelSource:
    from engine.model.gguf_file import GGUFFile

    return GGUFFile(path)


def _not_a_model(path: str) -> str:
    if os.path.isdir(path):
        return f"{path!r} is not a model directory: it has no config.json."
    if os.path.exists(path):
        return f"{path!r} is neither a Hugging Face model directory nor a .gguf file."
    hint = ""
    if path.count("/") == 1 and not path.startswith((".", "/", "~")):
        hint = (
            f" Serval loads local models only and never downloads: fetch {path!r} first (for example "
            f"`huggingface-cli download {path} --local-dir models/{path.split('/')[1]}`) and pass that directory."
        )
    return f"{path!r} does not exist: a model is a Hugging Face checkpoint directory or a .gguf file.{hint}"


def load_tokenizer(path: str, chat_template: str | None = None):
    """The tokenizer of the model (or tokenizer directory) at ``path``: a .gguf file's embedded one, else
    ``AutoTokenizer.from_pretrained`` (a tokenizer directory needs no config.json); ``chat_template``
    (``ModelConfig.chat_template``, vLLM's ``--chat-template``: a template, or a file holding one), when given,
    replaces its own; a chat request's own ``chat_template`` wins over both."""
    if is_gguf_path(path):
        tokenizer = open_model_source(path).load_tokenizer()
    else:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(path)
    if chat_template is not None:
        tokenizer.chat_template = read_chat_template(chat_template)
    return tokenizer


def read_chat_template(value: str) -> str:
    """The template ``value`` is, or the one in the file it names; ValueError when it is neither."""
    if "{" in value:  # every Jinja template has a tag; no file name needs a brace
        return value
    try:
        with open(value, encoding="utf-8") as f:
            return f.read()
    except OSError as error:
        raise ValueError(f"chat_template {value!r} is no Jinja template and no readable file: {error}") from None


# generation_config.json's sampling keys -> SamplingParams' names (vLLM's ``--generation-config auto``).
SAMPLING_DEFAULT_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
}


def sampling_defaults(model: str, generation_config: str = "auto") -> dict[str, Any]:
    """The defaults (SamplingParams' names) for the sampling fields a request leaves unset.

    ``generation_config`` is ``ModelConfig.generation_config``: ``auto`` reads the model's, ``vllm`` gives
    none, anything else is a directory holding a generation_config.json. A request's own value always wins.
    """
    if generation_config == "vllm":
        return {}
    if generation_config == "auto":
        config = open_model_source(model).generation_config
    else:
        config = _read_json(os.path.join(generation_config, "generation_config.json"))
    return {name: config[key] for key, name in SAMPLING_DEFAULT_KEYS.items() if config.get(key) is not None}


def _read_json(path: str) -> dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        return json.load(f)
