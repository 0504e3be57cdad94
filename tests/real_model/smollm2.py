"""What the SmolLM2-135M-Instruct fidelity tests share: the chat prompts, the engine arguments, and
transformers as the reference (its tokenizer's ``apply_chat_template``, ``generate(do_sample=False)``),
computed once per session (``functools.cache``) however many modules (offline, the OpenAI server,
speculative decoding, pipeline parallelism in tests/cluster/) compare against it.

The prompts mix a short factual answer, a poem, two answers full of multi-byte characters (CJK, emoji:
byte-level BPE splits those characters across tokens) and a copy task (n-gram speculation drafts from
the prompt). Every run is greedy, float32, ``MAX_NEW_TOKENS`` at most, stopped by ``<|im_end|>`` as
transformers stops.
"""

from __future__ import annotations

import functools

from tests.conftest import engine_kwargs

EOS_TOKEN_ID = 2  # <|im_end|>
DEFAULT_SYSTEM_PROMPT = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
MAX_NEW_TOKENS = 40
COPY_TEXT = "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog."

# One conversation per prompt; the default system prompt comes from the template unless one is given.
CONVERSATIONS: dict[str, list[dict]] = {
    "capital": [{"role": "user", "content": "What is the capital of France?"}],
    "haiku": [{"role": "user", "content": "Write a haiku about the sea."}],
    "cjk": [{"role": "user", "content": "Translate 'good morning, my friend' into Chinese, Japanese and French."}],
    "emoji": [{"role": "user", "content": "Reply with three emoji that describe summer, then explain each."}],
    "copy": [{"role": "user", "content": f"Repeat exactly: {COPY_TEXT}"}],
    "multi_turn": [
        {"role": "system", "content": "You are a concise assistant."},
        {"role": "user", "content": "Name a primary colour."},
        {"role": "assistant", "content": "Red."},
        {"role": "user", "content": "Name another one."},
    ],
}
NAMES = tuple(CONVERSATIONS)
CAPITAL_ANSWER = "The capital of France is Paris."

# A modest KV cache (80 blocks of 16 tokens, 59 MB: one max_model_len sequence, or every prompt at once).
ENGINE_KWARGS = engine_kwargs(max_model_len=1024, max_num_seqs=8, num_gpu_blocks_override=80)


@functools.cache
def hf_tokenizer(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def template_ids(path: str, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
    """transformers' ``apply_chat_template`` token ids (the reference for every prompt the engine gets)."""
    encoding = hf_tokenizer(path).apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    ids = encoding["input_ids"] if hasattr(encoding, "keys") else encoding
    return [int(token_id) for token_id in ids]


@functools.cache
def _hf_greedy_all(path: str, max_new_tokens: int) -> dict[str, tuple[int, ...]]:
    """Every conversation's reference, computed at once; the model is dropped afterwards (only the ids stay)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    # One thread: on the 2-core machine with other processes busy, two made this token-by-token decode up
    # to 20x slower (OpenMP threads spinning); one keeps it near 0.1 s a token.
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    references = {}
    try:
        with torch.no_grad():
            for name, messages in CONVERSATIONS.items():
                prompt_ids = template_ids(path, messages)
                output = model.generate(
                    torch.tensor([prompt_ids]),
                    attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                    do_sample=False,
                    temperature=None,
                    top_p=None,
                    max_new_tokens=max_new_tokens,
                    eos_token_id=EOS_TOKEN_ID,
                    pad_token_id=EOS_TOKEN_ID,
                )
                references[name] = tuple(int(token_id) for token_id in output[0, len(prompt_ids) :])
    finally:
        torch.set_num_threads(num_threads)
    return references


def hf_greedy(path: str, name: str, max_new_tokens: int = MAX_NEW_TOKENS) -> list[int]:
    """transformers' ``generate(do_sample=False)`` on ``CONVERSATIONS[name]``: the new token ids, ending with
    ``<|im_end|>`` when the model ended its turn within ``max_new_tokens`` (one prompt at a time, no padding;
    every conversation's computed on the first call, once per session)."""
    return list(_hf_greedy_all(path, max_new_tokens)[name])


def hf_decode(path: str, token_ids) -> str:
    """The reference text of output tokens: what the engine's detokenizer must produce (specials skipped)."""
    return hf_tokenizer(path).decode(list(token_ids), skip_special_tokens=True)


def greedy_params(max_tokens: int = MAX_NEW_TOKENS, **extra):
    from engine import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **extra)


def assert_greedy_equals_transformers(path: str, name: str, completion) -> list[int]:
    """``completion`` (a ``CompletionOutput`` of conversation ``name``) holds transformers' greedy tokens and
    their text; returns those tokens."""
    expected = hf_greedy(path, name)
    assert completion.token_ids == expected
    assert completion.text == hf_decode(path, expected)
    return expected
