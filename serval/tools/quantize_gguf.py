"""``serval quantize-gguf SRC.gguf OUT.gguf --type Q8_0``: a GGUF file with its linear weights re-encoded.

Every 2-D linear weight of a transformer block (``blk.N.attn_q/attn_k/attn_v/attn_output`` and
``blk.N.ffn_gate/ffn_up/ffn_down``) is written in ``--type`` (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, or F32 for a
float reference), and the token embedding (``token_embd.weight``) in ``--embedding-type`` when given (by default
it is kept as stored). Every other tensor (norms, an untied ``output.weight``) is copied byte for byte, in
the source's order, and so is every metadata field (architecture keys, tokenizer, chat template) but
``general.file_type``, which is set to the llama.cpp file type that names ``--type`` (as llama-quantize
does), so llama.cpp's tools load and describe the output as they do any file.

Re-encoding starts from the stored values: a tensor is dequantized (``gguf.quants.dequantize``) and
quantized again with gguf's quantizer (``gguf.quants.quantize``, bit-identical to llama.cpp's). The
original float weights are not in a quantized file, so a Q8_0 file made from a Q4_1 file holds Q4_1's
values re-encoded (Q4_1's error plus Q8_0's), not a Q8_0 quantization of the original model; an F32 file
holds the source's exact dequantization. A tensor already in the requested type is copied unchanged.

Usage::

    serval quantize-gguf models/smollm2-135m-instruct.gguf /tmp/smollm2-q8_0.gguf --type Q8_0
    python -m serval.tools.quantize_gguf SRC.gguf OUT.gguf --type F32 --embedding-type F32
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass
from pathlib import Path

SUMMARY = (
    "write a GGUF file with its linear weights (and optionally the embedding) re-encoded in "
    "Q8_0/Q4_0/Q4_1/Q5_0/Q5_1/F32"
)

# The output types, by GGUF's name (GGMLQuantizationType) -> llama.cpp's general.file_type (LlamaFileType).
TYPES = {
    "F32": "ALL_F32",
    "Q8_0": "MOSTLY_Q8_0",
    "Q4_0": "MOSTLY_Q4_0",
    "Q4_1": "MOSTLY_Q4_1",
    "Q5_0": "MOSTLY_Q5_0",
    "Q5_1": "MOSTLY_Q5_1",
}
LINEAR = re.compile(r"blk\.\d+\.(attn_q|attn_k|attn_v|attn_output|ffn_gate|ffn_up|ffn_down)\.weight")
EMBEDDING = "token_embd.weight"
FILE_TYPE_KEY = "general.file_type"
# Fields the writer writes itself: the header's (GGUF.*), the architecture (its constructor's argument) and
# the alignment (passed to it, so the data offsets follow it).
WRITER_OWNED = ("general.architecture", "general.alignment")


@dataclass(frozen=True)
class Plan:
    """What to write: ``linear_type`` for the block linears, ``embedding_type`` (None: as stored) for the
    token embedding; both GGUF type names of ``TYPES``."""

    linear_type: str
    embedding_type: str | None = None

    def target(self, name: str) -> str | None:
        """The type tensor ``name`` is written in; None to copy it as stored."""
        if LINEAR.fullmatch(name):
            return self.linear_type
        if name == EMBEDDING:
            return self.embedding_type
        return None


# What the gguf package cannot write (the K-quants and llama.cpp's mixes of them): llama.cpp's quantizer does.
K_QUANT_HINT = (
    "{name} is written by llama.cpp's quantizer, not here: llama-quantize IN.gguf OUT.gguf {name} (best from a"
    " float32 file: serval quantize-gguf IN.gguf F32.gguf --type F32 --embedding-type F32); Serval serves the"
    " result's blocks as stored (docs/quantization.md)"
)


def output_type(name: str) -> str:
    """``--type``'s value: one of ``TYPES``; a K-quant type or mix (Q4_K, Q4_K_M, ...) names llama.cpp's tool."""
    name = name.upper()
    if name in TYPES:
        return name
    if re.fullmatch(r"Q[2-6]_K(_[SML])?", name):
        raise argparse.ArgumentTypeError(K_QUANT_HINT.format(name=name))
    raise argparse.ArgumentTypeError(f"invalid choice: {name!r} (choose from {', '.join(TYPES)})")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("source", type=Path, help="the .gguf file to read")
    parser.add_argument("out", type=Path, help="the .gguf file to write (replaced if it exists)")
    parser.add_argument(
        "--type",
        required=True,
        type=output_type,
        metavar="{" + ",".join(TYPES) + "}",
        help="the type of every block linear weight (the K-quants: llama.cpp's quantizer, which says how)",
    )
    parser.add_argument(
        "--embedding-type",
        type=str.upper,
        choices=list(TYPES),
        default=None,
        help="the type of the token embedding (default: kept as stored)",
    )


def run(args: argparse.Namespace) -> int:
    if args.source.resolve() == args.out.resolve():
        print("serval quantize-gguf: the output must not be the source file", file=sys.stderr)
        return 1
    try:
        counts = quantize_gguf(args.source, args.out, Plan(args.type, args.embedding_type))
    except (OSError, ValueError) as error:
        print(f"serval quantize-gguf: {error}", file=sys.stderr)
        return 1
    summary = ", ".join(f"{count} {kind}" for kind, count in sorted(counts.items()))
    print(f"wrote {args.out} ({summary})")
    return 0


def quantize_gguf(source: Path, out: Path, plan: Plan) -> dict[str, int]:
    """Write ``out`` from ``source`` as ``plan`` says (the module docstring); returns tensor type -> count of
    the output. ValueError for a source that is no GGUF file or a weight the target type cannot hold."""
    import gguf

    reader = _open_reader(source)
    architecture = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(out), architecture)
    if "general.alignment" in reader.fields:
        writer.data_alignment = int(reader.fields["general.alignment"].contents())
    try:
        _copy_metadata(reader, writer, plan)
        counts = _add_tensors(reader, writer, plan)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()
    return counts


def _open_reader(source: Path):
    import gguf

    try:
        reader = gguf.GGUFReader(str(source))
    except ValueError as error:  # the reader's own message names what is wrong (magic, version)
        raise ValueError(f"{source} is not a GGUF file: {error}") from None
    if reader.endianess != gguf.GGUFEndian.LITTLE:  # the quantizers and the writer here are little-endian
        raise ValueError(f"{source} is a big-endian GGUF file; only little-endian files are read")
    return reader


def _copy_metadata(reader, writer, plan: Plan) -> None:
    """Every key-value field as the source stores it (value and type), ``general.file_type`` excepted."""
    import gguf

    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name in WRITER_OWNED:
            continue
        if field.name == FILE_TYPE_KEY:
            writer.add_file_type(gguf.LlamaFileType[TYPES[plan.linear_type]])
            continue
        value_type = field.types[0]
        sub_type = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), value_type, sub_type=sub_type)
    if FILE_TYPE_KEY not in reader.fields:
        writer.add_file_type(gguf.LlamaFileType[TYPES[plan.linear_type]])


def _add_tensors(reader, writer, plan: Plan) -> dict[str, int]:
    """Adds every tensor, in the source's order, re-encoded where ``plan`` says; returns type -> count."""
    import gguf

    counts: dict[str, int] = {}
    for tensor in reader.tensors:
        stored = tensor.tensor_type
        target = plan.target(tensor.name)
        data = tensor.data
        if target is not None and target != stored.name:
            data = reencode(tensor.name, data, stored, gguf.GGMLQuantizationType[target])
            stored = gguf.GGMLQuantizationType[target]
        writer.add_tensor(tensor.name, data, raw_dtype=stored)
        counts[stored.name] = counts.get(stored.name, 0) + 1
    return counts


def reencode(name: str, data, stored, target):
    """The tensor ``data`` (as the reader gives it: float rows, or uint8 rows of blocks) of type ``stored``
    in type ``target``: dequantized to float32, then quantized. ValueError when it is not 2-D with rows of
    whole blocks of ``target``."""
    import numpy as np
    from gguf.quants import dequantize, quantize

    values = np.ascontiguousarray(dequantize(data, stored), dtype=np.float32)
    if values.ndim != 2:
        raise ValueError(f"tensor {name!r} has shape {values.shape}: only 2-D weights are re-encoded")
    block, _ = _block_size(target)
    if values.shape[1] % block:
        raise ValueError(
            f"tensor {name!r} has rows of {values.shape[1]} weights: {target.name} needs a multiple of {block}"
        )
    return quantize(values, target)


def _block_size(qtype) -> tuple[int, int]:
    from gguf.constants import GGML_QUANT_SIZES

    return GGML_QUANT_SIZES[qtype]


def main(argv: list[str] | None = None) -> int:
    """Entry point for ``python -m serval.tools.quantize_gguf``."""
    parser = argparse.ArgumentParser(prog="python -m serval.tools.quantize_gguf", description=SUMMARY)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
