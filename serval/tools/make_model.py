"""``serval make-model``: write small random-weight Hugging Face checkpoints.

The machines running Serval cannot download weights, so tests and benchmarks
build their own checkpoints: a transformers config (from HF's own config
classes), deterministic random safetensors weights (see
:mod:`serval.tools.weights` for the init scheme) and a byte-level BPE
tokenizer trained on the local Python stdlib (see
:mod:`serval.tools.tokenizer_trainer`); the presets and the files besides the
weights are :mod:`serval.tools.checkpoint`'s.  The result loads offline with
``AutoModelForCausalLM.from_pretrained`` and ``AutoTokenizer.from_pretrained``.

Usage::

    serval make-model /tmp/llama-tiny --arch llama --size tiny
    serval make-model /tmp/llama-1b --size 1b --threads 2   # the benchmarks' 1B (4.3 GB of float32)
    python -m serval.tools.make_model /tmp/qwen-w1 --arch qwen2 --size w1 --dtype bfloat16
    python -m serval.tools.make_model /tmp/llama-8b --arch llama --size 8b --dtype bfloat16 \
        --max-shard-size 4000000000 --threads 16
    serval make-model assets/trained --train   # trained, not random: see serval/tools/train_model.py
    serval make-model /tmp/lora-a --lora /tmp/llama-tiny --lora-rank 8   # a PEFT adapter: serval/tools/make_adapter.py

``--train`` writes the trained target/draft pair (``serval-llama-10m``,
``serval-llama-draft``: the ``10m`` and ``draft`` presets) into PATH instead;
the committed pair in assets/trained is what ``make serve`` serves.

The ``8b`` preset has Llama-3-8B's shapes (16 GB in bfloat16), for GPU
benchmarks (``benchmarks/gpu_check.sh``); its vocabulary is partly reserved
tokens (see :mod:`serval.tools.checkpoint`). Generating 8B random values takes
minutes on one core; ``--threads`` generates tensors in parallel, with the same
bytes as one thread (each tensor has its own seeded generator), so it is not
part of the spec.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from serval.tools.checkpoint import ARCHS, DTYPES, SIZES, is_complete, mark_complete, write_skeleton
from serval.tools.make_adapter import add_lora_arguments, run_lora

SUMMARY = "Write a small random-weight Hugging Face checkpoint (offline, deterministic)."
SPEC_VERSION = 1


def _spec(arch, size, seed, dtype, max_shard_size, tie_word_embeddings, vocab_size) -> dict:
    return {
        "spec_version": SPEC_VERSION,
        "arch": arch,
        "size": size,
        "seed": seed,
        "dtype": dtype,
        "max_shard_size": max_shard_size,
        "vocab_size": vocab_size,
        "tie_word_embeddings": tie_word_embeddings,
    }


def make_model(
    path,
    arch: str = "llama",
    size: str = "tiny",
    seed: int = 0,
    dtype: str = "float32",
    max_shard_size: int | None = None,
    tie_word_embeddings: bool | None = None,
    force: bool = False,
    vocab_size: int | None = None,
    quiet: bool = False,
    threads: int = 1,
) -> Path:
    """Write a random-weight HF checkpoint to ``path`` and return it as a Path.

    Deterministic in ``(arch, size, seed, dtype, tie_word_embeddings,
    vocab_size)``.  Skips work when ``path`` already holds a complete
    checkpoint with the same spec, unless ``force``.  ``vocab_size`` overrides
    the preset's vocabulary (tokenizer and embedding alike). ``threads``
    generates that many tensors at once; the bytes do not depend on it.
    """
    if arch not in ARCHS or size not in SIZES or dtype not in DTYPES:
        raise ValueError(f"unknown arch/size/dtype: {arch!r}/{size!r}/{dtype!r}")
    path = Path(path)
    tie = ARCHS[arch][2] if tie_word_embeddings is None else tie_word_embeddings
    vocab = vocab_size or SIZES[size].vocab
    spec = _spec(arch, size, seed, dtype, max_shard_size, tie, vocab)
    if not force and is_complete(path, spec):
        if not quiet:
            print(f"serval make-model: {path} already up to date ({arch}/{size}, seed {seed})")
        return path
    from serval.tools.weights import write_weights

    config = write_skeleton(path, arch, size, dtype, tie, vocab)
    n_params = write_weights(path, config, seed, dtype, max_shard_size, threads=threads)
    mark_complete(path, {**spec, "num_parameters": n_params})
    if not quiet:
        tied = "tied" if config.tie_word_embeddings else "untied"
        print(f"serval make-model: {arch}/{size} {n_params / 1e6:.2f}M params ({tied}), {dtype}, seed {seed} -> {path}")
    return path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the ``make-model`` options on ``parser``."""
    parser.add_argument("path", type=Path, help="output checkpoint directory")
    parser.add_argument("--arch", choices=sorted(ARCHS), default="llama")
    parser.add_argument("--size", choices=list(SIZES), default="tiny")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=DTYPES, default="float32")
    parser.add_argument(
        "--max-shard-size",
        type=int,
        default=None,
        metavar="BYTES",
        help="split weights into shards of at most BYTES (default: one file)",
    )
    parser.add_argument("--vocab-size", type=int, default=None, help="override the preset's vocabulary size")
    parser.add_argument(
        "--tie-word-embeddings",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="default: tied for qwen2/qwen3/gemma3, untied for llama/mistral",
    )
    parser.add_argument("--force", action="store_true", help="rebuild even if up to date")
    parser.add_argument(
        "--train",
        action="store_true",
        help="instead: train the Llama target on the stdlib into PATH/serval-llama-10m, then distil the draft "
        "PATH/serval-llama-draft from it (minutes of CPU training; --seed applies, --arch/--size/--dtype do not)",
    )
    parser.add_argument(
        "--draft-only",
        action="store_true",
        help="with --train: keep the (up-to-date) target as it is and (re)make only the draft from it",
    )
    parser.add_argument(
        "--threads", type=int, default=1, help="generate this many tensors at once (same bytes as 1; default 1)"
    )
    add_lora_arguments(parser)


def run(args: argparse.Namespace) -> int:
    """Execute ``make-model`` for parsed ``args``; returns the exit code."""
    if args.lora is not None:
        return run_lora(args)
    if args.train:
        from serval.tools.train_model import train_pair

        train_pair(args.path, seed=args.seed, force=args.force, draft_only=args.draft_only)
        return 0
    make_model(
        args.path,
        arch=args.arch,
        size=args.size,
        seed=args.seed,
        dtype=args.dtype,
        max_shard_size=args.max_shard_size,
        tie_word_embeddings=args.tie_word_embeddings,
        force=args.force,
        vocab_size=args.vocab_size,
        threads=args.threads,
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point for ``python -m serval.tools.make_model``."""
    parser = argparse.ArgumentParser(prog="python -m serval.tools.make_model", description=SUMMARY)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
