"""``serval gguf-to-hf FILE.gguf OUT_DIR``: a GGUF file written out as a Hugging Face checkpoint directory.

The directory holds float32 safetensors with the exact dequantization of the file's tensors (each
quantized block expanded as llama.cpp expands it, nothing rounded again), ``config.json`` with
``architectures``, ``tokenizer.json`` and ``tokenizer_config.json`` (the chat template inside),
``generation_config.json`` and a model card (``README.md``) naming the origin, the license and the
quantization the weights came from. The tensors are those ``LLM(model="FILE.gguf")`` loads: both read
the file through ``engine.model.gguf_file.GGUFFile``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

SUMMARY = "write a GGUF file out as a Hugging Face checkpoint directory (float32 safetensors, exact dequantization)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("gguf", help="the .gguf file")
    parser.add_argument("out", type=Path, help="the directory to write (created; existing files replaced)")


def run(args: argparse.Namespace) -> int:
    try:
        write_hf_directory(args.gguf, args.out)
    except (OSError, ValueError) as error:
        print(f"serval gguf-to-hf: {error}", file=sys.stderr)
        return 1
    print(f"wrote {args.out}")
    return 0


def write_hf_directory(
    gguf_path: str, out: Path, generation_defaults: dict[str, Any] | None = None, origin: str | None = None
) -> None:
    """Write the directory (see the module docstring). ``generation_defaults`` are added to the file's own
    generation config (sampling defaults the file does not carry); ``origin`` is the model card's provenance
    line (default: the file's path)."""
    from safetensors.torch import save_file

    from engine.model.gguf_file import GGUFFile

    source = GGUFFile(gguf_path)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {name: tensor.contiguous() for name, tensor in source.iter_weights()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = {key: value for key, value in source.hf_config.items() if not key.startswith("_")}
    _write_json(out / "config.json", {**config, "dtype": "float32"})
    generation = {**source.generation_config, **(generation_defaults or {})}
    if "pad_token_id" not in generation and config.get("pad_token_id") is not None:
        generation["pad_token_id"] = config["pad_token_id"]
    _write_json(out / "generation_config.json", generation)
    source.load_tokenizer().save_pretrained(str(out), save_jinja_files=False)
    (out / "README.md").write_text(_model_card(source.describe(), origin or os.path.abspath(gguf_path), generation))


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _model_card(info: dict[str, Any], origin: str, generation: dict[str, Any]) -> str:
    types = ", ".join(f"{count} {kind}" for kind, count in sorted(info["tensor_types"].items()))
    return (
        f"# {info['name']}\n\n"
        f"- Origin: {origin}\n"
        f"- Organization: {info['organization'] or 'unknown'}; license: {info['license'] or 'unknown'}\n"
        f"- Architecture: {info['architecture']} (llama.cpp's name)\n"
        f"- Weights: float32, the exact dequantization of the GGUF tensors ({types}); the quantization's "
        "error is in these weights: they are not the original float weights.\n"
        f"- Generation defaults (generation_config.json): {json.dumps(generation, sort_keys=True)}\n"
        "- Written by `serval gguf-to-hf` (serval/gguf_to_hf.py).\n"
    )
