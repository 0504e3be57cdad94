"""The checkpoint files every model maker writes: size presets, config, tokenizer, and the spec file.

``serval make-model`` (:mod:`serval.tools.make_model`, random weights) and ``--train``
(:mod:`serval.tools.train_model`, trained weights) both build a directory with
:func:`write_skeleton` (config.json, generation_config.json, the tokenizer of
:mod:`serval.tools.tokenizer_trainer`), add their weights, and write the spec file last
(:func:`mark_complete`); :func:`is_complete` is their shared up-to-date check.

The ``8b`` preset's 128256-token vocabulary is more than BPE can learn from the stdlib corpus
(about 27k merges), so its tokenizer learns ``bpe_vocab`` tokens and fills the remaining ids
with ``<|reserved_N|>`` entries: plain vocabulary entries that decode to their own text but
that no merge ever produces (Llama 3 likewise reserves ids it never emits).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

SPEC_FILE = "serval_model_spec.json"
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
    ``tied``: the preset's own default for tied embeddings (the real model's); None: the arch's.
    """

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    bpe_vocab: int | None = None
    tied: bool | None = None


SIZES: dict[str, SizePreset] = {
    "tiny": SizePreset(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, vocab=512),
    "small": SizePreset(hidden=128, layers=4, heads=4, kv_heads=2, intermediate=352, vocab=2048),
    "w2": SizePreset(hidden=256, layers=4, heads=4, kv_heads=2, intermediate=688, vocab=8192),
    "w1": SizePreset(hidden=896, layers=24, heads=14, kv_heads=2, intermediate=4864, vocab=16384),
    # Llama-3-8B's shapes: 8.03B parameters, untied.
    "8b": SizePreset(hidden=4096, layers=32, heads=32, kv_heads=8, intermediate=14336, vocab=128256, bpe_vocab=16384),
    # Llama-3.2-1B's shapes with SmolLM2's vocabulary size: 1.07B parameters, tied (the benchmarks' 1B model).
    "1b": SizePreset(
        hidden=2048, layers=16, heads=32, kv_heads=8, intermediate=8192, vocab=49152, bpe_vocab=16384, tied=True
    ),
    # The trained pair (``--train``, serval/tools/train_model.py): a 10.0M target, untied, and a 1.42M tied
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
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", True, True, 1000000.0),
}
# Gemma 3's sliding layers (every other one here): their rope base and window. The window is wider than any
# prompt the tests give a tiny model, until the attention backends honour windows.
GEMMA3_LOCAL_ROPE_THETA = 10000.0
GEMMA3_SLIDING_WINDOW = 1024


def build_config(
    arch: str, size: str, dtype: str = "float32", tie_word_embeddings: bool | None = None, vocab_size: int | None = None
):
    """Return the transformers ``PretrainedConfig`` for ``arch``/``size``."""
    import transformers

    from serval.tools.tokenizer_trainer import BOS_ID, EOS_ID, PAD_ID

    class_name, architecture, default_tie, _, rope_theta = ARCHS[arch]
    preset = SIZES[size]
    default_tie = default_tie if preset.tied is None else preset.tied
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
    if arch == "gemma3":
        kwargs.update(_gemma3_kwargs(preset, head_dim, rope_theta))
    return getattr(transformers, class_name)(**kwargs)


def _gemma3_kwargs(preset: SizePreset, head_dim: int, rope_theta: float) -> dict:
    """Gemma 3's own fields, each set off its default (a score scale other than head_dim's, two rope bases)."""
    return dict(
        head_dim=head_dim,
        query_pre_attn_scalar=head_dim * 3 // 2,
        sliding_window=GEMMA3_SLIDING_WINDOW,
        layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(preset.layers)],
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": rope_theta},
            "sliding_attention": {"rope_type": "default", "rope_theta": GEMMA3_LOCAL_ROPE_THETA},
        },
    )


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


def mark_complete(path: Path, record: dict) -> None:
    """Write ``record`` (the spec, plus results) as ``path``'s spec file: last, as it marks the checkpoint complete."""
    (path / SPEC_FILE).write_text(json.dumps(record, indent=2) + "\n")


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
    from serval.tools.tokenizer_trainer import build_hf_tokenizer

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
