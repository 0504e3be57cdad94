"""``serval make-model``: write small random-weight Hugging Face checkpoints.

The machines running Serval cannot download weights, so tests and benchmarks
build their own checkpoints: a transformers config (from HF's own config
classes), deterministic random safetensors weights (see
:mod:`engine.tools.weights` for the init scheme) and a byte-level BPE
tokenizer trained on the local Python stdlib (see
:mod:`engine.tools.tokenizer_trainer`).  The result loads offline with
``AutoModelForCausalLM.from_pretrained`` and ``AutoTokenizer.from_pretrained``.

Usage::

    serval make-model /tmp/llama-tiny --arch llama --size tiny
    python -m engine.tools.make_model /tmp/qwen-w1 --arch qwen2 --size w1 --dtype bfloat16
    python -m engine.tools.make_model /tmp/llama-8b --arch llama --size 8b --dtype bfloat16 \
        --max-shard-size 4000000000 --threads 16
    serval make-model assets/trained --train   # trained, not random: see engine/tools/train_model.py
    serval make-model /tmp/lora-a --lora /tmp/llama-tiny --lora-rank 8   # a PEFT adapter: engine/lora/make_adapter.py

``--train`` writes the trained target/draft pair (``serval-llama-10m``,
``serval-llama-draft``: the ``10m`` and ``draft`` presets) into PATH instead;
the committed pair in assets/trained is what ``make serve`` serves.

The ``8b`` preset has Llama-3-8B's shapes (16 GB in bfloat16), for GPU
benchmarks (``benchmarks/gpu_check.sh``). Its 128256-token vocabulary is more
than BPE can learn from the stdlib corpus (about 27k merges), so its
tokenizer learns ``bpe_vocab`` tokens and fills the remaining ids with
``<|reserved_N|>`` entries: plain vocabulary entries that decode to their own
text but that no merge ever produces (Llama 3 likewise reserves ids it never
emits). Generating 8B random values takes minutes on one core; ``--threads``
generates tensors in parallel, with the same bytes as one thread (each tensor
has its own seeded generator), so it is not part of the spec.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from engine.lora.make_adapter import add_lora_arguments, run_lora

SUMMARY = "Write a small random-weight Hugging Face checkpoint (offline, deterministic)."
SPEC_FILE = "serval_model_spec.json"
SPEC_VERSION = 1
# Files a (re)build may delete from an existing output directory.
_OUTPUT_NAME = re.compile(
    r"config\.json|generation_config\.json|tokenizer(_config)?\.json|chat_template\.jinja"
    r"|special_tokens_map\.json|model(-\d{5}-of-\d{5})?\.safetensors(\.index\.json)?"
    r"|serval_model_spec\.json"
)
MAX_POSITION_EMBEDDINGS = 4096
DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class SizePreset:
    """Shape of one model size (head_dim = hidden // heads).

    ``bpe_vocab``: at most this many tokenizer ids are learned by BPE; the rest
    of ``vocab`` are reserved tokens (see the module docstring). None: all.
    """

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    bpe_vocab: int | None = None


SIZES: dict[str, SizePreset] = {
    "tiny": SizePreset(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, vocab=512),
    "small": SizePreset(hidden=128, layers=4, heads=4, kv_heads=2, intermediate=352, vocab=2048),
    "w2": SizePreset(hidden=256, layers=4, heads=4, kv_heads=2, intermediate=688, vocab=8192),
    "w1": SizePreset(hidden=896, layers=24, heads=14, kv_heads=2, intermediate=4864, vocab=16384),
    # Llama-3-8B's shapes: 8.03B parameters, untied.
    "8b": SizePreset(hidden=4096, layers=32, heads=32, kv_heads=8, intermediate=14336, vocab=128256, bpe_vocab=16384),
    # The trained pair (``--train``, engine/tools/train_model.py): a 10.0M target, untied, and a 1.42M tied
    # draft sharing its 8192-token vocabulary.
    "10m": SizePreset(hidden=256, layers=8, heads=4, kv_heads=2, intermediate=688, vocab=8192),
    "draft": SizePreset(hidden=128, layers=2, heads=4, kv_heads=2, intermediate=352, vocab=8192),
}
RESERVED_TOKEN = "<|reserved_{}|>"

# arch -> (config class, architectures entry, tied by default, tokenizer adds BOS, rope_theta).
# rope_theta follows the real families (not HF's 10000 default) so engines
# that hardcode it fail fidelity tests.
ARCHS: dict[str, tuple[str, str, bool, bool, float]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", False, True, 500000.0),
    "mistral": ("MistralConfig", "MistralForCausalLM", False, True, 1000000.0),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", True, False, 1000000.0),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", True, False, 1000000.0),
}


def build_config(
    arch: str, size: str, dtype: str = "float32", tie_word_embeddings: bool | None = None, vocab_size: int | None = None
):
    """Return the transformers ``PretrainedConfig`` for ``arch``/``size``."""
    import transformers

    from engine.tools.tokenizer_trainer import BOS_ID, EOS_ID, PAD_ID

    class_name, architecture, default_tie, _, rope_theta = ARCHS[arch]
    preset = SIZES[size]
    head_dim = preset.hidden // preset.heads
    kwargs = dict(
        hidden_size=preset.hidden,
        num_hidden_layers=preset.layers,
        num_attention_heads=preset.heads,
        num_key_value_heads=preset.kv_heads,
        intermediate_size=preset.intermediate,
        vocab_size=vocab_size or preset.vocab,
        max_position_embeddings=MAX_POSITION_EMBEDDINGS,
        rms_norm_eps=1e-6,
        tie_word_embeddings=default_tie if tie_word_embeddings is None else tie_word_embeddings,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        architectures=[architecture],
        dtype=dtype,
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
    )
    if arch in ("llama", "mistral", "qwen3"):
        kwargs["head_dim"] = head_dim  # Qwen3 otherwise defaults to 128
    if arch == "mistral":
        kwargs["sliding_window"] = None
    if arch == "qwen3":
        kwargs["attention_bias"] = False
    return getattr(transformers, class_name)(**kwargs)


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


def is_complete(path: Path, spec: dict) -> bool:
    """Whether ``path`` holds a finished checkpoint whose stored spec equals ``spec``.

    The spec file's ``num_parameters`` and ``measured`` (results, not inputs) are not compared.
    """
    spec_path = path / SPEC_FILE
    if not spec_path.is_file():
        return False
    stored = json.loads(spec_path.read_text())
    return {k: v for k, v in stored.items() if k not in ("num_parameters", "measured")} == spec


def _clear_output(path: Path) -> None:
    """Create ``path`` or empty it of checkpoint files; refuse to touch anything else."""
    path.mkdir(parents=True, exist_ok=True)
    entries = list(path.iterdir())
    foreign = [e.name for e in entries if not (e.is_file() and _OUTPUT_NAME.fullmatch(e.name))]
    if foreign:
        raise FileExistsError(f"{path} contains files make-model did not write: {sorted(foreign)[:5]}")
    for entry in entries:
        entry.unlink()


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
    from engine.tools.weights import write_weights

    config = write_skeleton(path, arch, size, dtype, tie, vocab)
    n_params = write_weights(path, config, seed, dtype, max_shard_size, threads=threads)
    # Written last: its presence marks the checkpoint as complete.
    (path / SPEC_FILE).write_text(json.dumps({**spec, "num_parameters": n_params}, indent=2) + "\n")
    if not quiet:
        tied = "tied" if config.tie_word_embeddings else "untied"
        print(f"serval make-model: {arch}/{size} {n_params / 1e6:.2f}M params ({tied}), {dtype}, seed {seed} -> {path}")
    return path


def write_skeleton(path: Path, arch: str, size: str, dtype: str, tie: bool, vocab_size: int):
    """Empty ``path`` (see ``_clear_output``), write everything but the weights; return the config.

    That is config.json, generation_config.json and the tokenizer files (chat template included).
    """
    _clear_output(path)
    config = build_config(arch, size, dtype, tie, vocab_size)
    config.save_pretrained(path)
    _write_generation_config(path, config)
    _write_tokenizer(path, arch, size, config.vocab_size)
    return config


def _write_tokenizer(path: Path, arch: str, size: str, vocab_size: int) -> None:
    """The byte-level BPE tokenizer: the preset's learned ids, then reserved ones up to ``vocab_size``."""
    from engine.tools.tokenizer_trainer import build_hf_tokenizer

    bpe_vocab = min(vocab_size, SIZES[size].bpe_vocab or vocab_size)
    tokenizer = build_hf_tokenizer(bpe_vocab, ARCHS[arch][3], MAX_POSITION_EMBEDDINGS)
    _reserve_vocab(tokenizer, vocab_size)
    # save_jinja_files=False keeps the chat template inside tokenizer_config.json
    # (transformers 5 would otherwise write a separate chat_template.jinja).
    tokenizer.save_pretrained(path, save_jinja_files=False)


def _reserve_vocab(tokenizer, vocab_size: int) -> None:
    """Grow ``tokenizer``'s BPE vocabulary to ``vocab_size`` ids with ``<|reserved_N|>`` entries, in place.

    No merge produces them, so encoding is unchanged; they decode to their
    own text (every character of the name is in the byte-level alphabet).
    """
    from tokenizers import Tokenizer

    backend = tokenizer.backend_tokenizer
    start = backend.get_vocab_size(with_added_tokens=False)
    if start >= vocab_size:
        return
    document = json.loads(backend.to_str())
    vocab = document["model"]["vocab"]
    if sorted(vocab.values()) != list(range(start)):
        raise RuntimeError("BPE vocabulary ids are not contiguous; cannot append reserved tokens")
    vocab.update({RESERVED_TOKEN.format(i): i for i in range(start, vocab_size)})
    backend.model = Tokenizer.from_str(json.dumps(document)).model


def _write_generation_config(path: Path, config) -> None:
    from transformers import GenerationConfig

    GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id
    ).save_pretrained(path)


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
        help="default: tied for qwen2/qwen3, untied for llama/mistral",
    )
    parser.add_argument("--force", action="store_true", help="rebuild even if up to date")
    parser.add_argument(
        "--train",
        action="store_true",
        help="instead: train the Llama target on the stdlib into PATH/serval-llama-10m, then distil the draft "
        "PATH/serval-llama-draft from it (about 14 minutes on 2 cores; --seed applies, --arch/--size/--dtype do not)",
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
        from engine.tools.train_model import train_pair

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
    """Entry point for ``python -m engine.tools.make_model``."""
    parser = argparse.ArgumentParser(prog="python -m engine.tools.make_model", description=SUMMARY)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
