"""Byte-level BPE tokenizer trained offline on the Python standard library.

The corpus is the source text of the top-level ``*.py`` modules of the
running interpreter's stdlib, read in sorted order and capped at
``CORPUS_CHARS`` characters, so training is deterministic for a given Python
installation and fast enough to run again on every call, hence no on-disk
cache.

Token ids are the same for every architecture: the special tokens come first
(``<|begin_of_text|>``=0, ``<|endoftext|>``=1 (EOS), ``<|im_start|>``=2,
``<|im_end|>``=3, ``<|pad|>``=4), then the 256 byte-level symbols, then merges.
Llama/Mistral tokenizers prepend BOS; Qwen-style tokenizers do not (like the
real Qwen ones).

The normalizer/pre-tokenizer are exactly those of transformers'
``Qwen2Tokenizer`` (NFC, Qwen split regex, ByteLevel without regex), because
transformers 5 ignores ``tokenizer_class`` for ``model_type == "qwen2"`` and
rebuilds the pipeline from that class; matching it keeps ``tokenizer.json``
(what an engine loads with the ``tokenizers`` library) and ``AutoTokenizer``
in exact agreement.  EOS is named ``<|endoftext|>`` for the same reason: it is
``Qwen2Tokenizer``'s default unk token, which it would otherwise append as an
extra id beyond the model's vocabulary.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
PAD_TOKEN = "<|pad|>"
SPECIAL_TOKENS = [BOS_TOKEN, EOS_TOKEN, IM_START, IM_END, PAD_TOKEN]
BOS_ID, EOS_ID, IM_START_ID, IM_END_ID, PAD_ID = range(len(SPECIAL_TOKENS))

# Same regex as transformers.models.qwen2.tokenization_qwen2.PRETOKENIZE_REGEX.
PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"""
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
CORPUS_CHARS = 2_000_000

# ChatML. With ``tools``, a system turn lists them in <tools></tools> and asks for <tool_call> blocks (the
# Hermes / Qwen2.5 format the OpenAI layer parses); an assistant turn's ``tool_calls`` render as those
# blocks, and consecutive ``tool`` turns as <tool_response> blocks inside one user turn (as Qwen2.5's
# template does). Without tools, every turn is '<|im_start|>role\ncontent<|im_end|>\n'.
TOOLS_PREAMBLE = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
TOOL_CALL_INSTRUCTIONS = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}'
    "\n</tool_call>"
)
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- " + repr(TOOLS_PREAMBLE) + " }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- " + repr(TOOL_CALL_INSTRUCTIONS) + " + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if tools and loop.first and message['role'] == 'system' %}"
    "{%- elif message['role'] == 'assistant' and message['tool_calls'] is defined and message['tool_calls'] %}"
    "{{- '<|im_start|>assistant' }}"
    "{%- if message['content'] %}{{- '\\n' + message['content'] }}{%- endif %}"
    "{%- for tool_call in message['tool_calls'] %}"
    "{%- set call = tool_call['function'] if tool_call['function'] is defined else tool_call %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + call['name'] + '\", \"arguments\": ' + (call['arguments'] | tojson)"
    " + '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def stdlib_corpus(max_chars: int = CORPUS_CHARS) -> list[str]:
    """Return the training texts: stdlib module sources, sorted, size-capped."""
    root = Path(sysconfig.get_paths()["stdlib"])
    texts: list[str] = []
    total = 0
    for path in sorted(root.glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        texts.append(text[: max_chars - total])
        total += len(texts[-1])
        if total >= max_chars:
            break
    if not texts:
        raise RuntimeError(f"no Python sources found under {root}")
    return texts


def train_bpe(vocab_size: int):
    """Train a byte-level BPE ``tokenizers.Tokenizer`` with ``vocab_size`` ids."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(stdlib_corpus(), trainer=trainer)
    if tokenizer.get_vocab_size() != vocab_size:
        raise RuntimeError(
            f"BPE training produced {tokenizer.get_vocab_size()} tokens, expected {vocab_size}; corpus too small?"
        )
    return tokenizer


def build_hf_tokenizer(vocab_size: int, add_bos: bool, model_max_length: int = 4096):
    """Return a ``PreTrainedTokenizerFast`` ready for ``save_pretrained``."""
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    tokenizer = train_bpe(vocab_size)
    if add_bos:
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B", special_tokens=[(BOS_TOKEN, BOS_ID)]
        )
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS_TOKEN if add_bos else None,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        additional_special_tokens=[IM_START, IM_END],
        chat_template=CHAT_TEMPLATE,
        add_bos_token=add_bos,
        clean_up_tokenization_spaces=False,
        model_max_length=model_max_length,
    )
