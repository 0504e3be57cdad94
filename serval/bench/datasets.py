"""Benchmark request sets, as ``vllm bench``'s datasets draw them: ``random``, ``prefix_repetition``, ``sharegpt``
(vLLM's names; ``prefix-repetition`` is a deprecated alias).

``random`` and ``prefix_repetition`` prompts are token-id lists (the OpenAI completions API and the offline
engine both take them), so every input length is exact; their ids avoid the tokenizer's special tokens.
``sharegpt`` prompts are the first human turn of each conversation, as text.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from dataclasses import dataclass

DATASET_NAMES = ("random", "prefix_repetition", "sharegpt")
DEPRECATED_DATASET_NAMES = {"prefix-repetition": "prefix_repetition"}

# vLLM's ShareGPT filter: pairs outside these token bounds are skipped.
SHAREGPT_MIN_LEN = 4
SHAREGPT_MAX_PROMPT_LEN = 1024
SHAREGPT_MAX_TOTAL_LEN = 2048


@dataclass(frozen=True)
class SampleRequest:
    prompt: str | list[int]
    prompt_len: int
    expected_output_len: int


def dataset_name(text: str) -> str:
    """A ``--dataset-name``: a deprecated spelling is mapped to vLLM's, with a one-line note."""
    if text in DEPRECATED_DATASET_NAMES:
        print(
            f"serval bench: --dataset-name {text} is deprecated; use {DEPRECATED_DATASET_NAMES[text]}",
            file=sys.stderr,
        )
    return DEPRECATED_DATASET_NAMES.get(text, text)


def add_dataset_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds ``--dataset-name``, every dataset's flags, ``--num-prompts`` and ``--seed`` to ``parser``."""
    group = parser.add_argument_group("dataset")
    group.add_argument("--dataset-name", type=dataset_name, choices=DATASET_NAMES, default="random")
    group.add_argument("--num-prompts", type=int, default=1000, help="Number of requests to sample.")
    group.add_argument(
        "--seed", type=int, default=0, help="Seed of the sampled requests (and of bench serve's arrival times)."
    )
    group.add_argument("--random-input-len", type=int, default=1024)
    group.add_argument("--random-output-len", type=int, default=128)
    group.add_argument(
        "--random-range-ratio", type=float, default=0.0, help="Lengths are uniform in [len * (1 - r), len * (1 + r)]."
    )
    group.add_argument(
        "--random-prefix-len", type=int, default=0, help="Random tokens shared by every prompt, before its own."
    )
    group.add_argument("--prefix-repetition-prefix-len", type=int, default=256)
    group.add_argument("--prefix-repetition-suffix-len", type=int, default=256)
    group.add_argument("--prefix-repetition-num-prefixes", type=int, default=10)
    group.add_argument("--prefix-repetition-output-len", type=int, default=128)
    group.add_argument("--dataset-path", help="ShareGPT-format JSON file (for --dataset-name sharegpt).")
    group.add_argument(
        "--sharegpt-output-len",
        type=int,
        default=None,
        help="Output length of every ShareGPT request (default: the reply's token count).",
    )


def sample_requests(args: argparse.Namespace, tokenizer) -> list[SampleRequest]:
    """``args.num_prompts`` requests of ``args.dataset_name``, reproducible from ``args.seed``.

    ``tokenizer`` is a Hugging Face tokenizer: its vocabulary bounds the random token ids, and it counts
    ShareGPT tokens. Raises ``ValueError`` for impossible settings (a range ratio outside [0, 1), no
    ShareGPT path or no usable conversation in it).
    """
    rng = random.Random(args.seed)
    if args.dataset_name != "sharegpt" and args.dataset_path:
        raise ValueError(f"--dataset-name {args.dataset_name} takes no --dataset-path (sharegpt does)")
    if args.dataset_name == "random":
        return sample_random(
            rng,
            ordinary_token_ids(tokenizer),
            args.num_prompts,
            args.random_input_len,
            args.random_output_len,
            args.random_range_ratio,
            args.random_prefix_len,
        )
    if args.dataset_name == "prefix_repetition":
        return sample_prefix_repetition(
            rng,
            ordinary_token_ids(tokenizer),
            args.num_prompts,
            args.prefix_repetition_prefix_len,
            args.prefix_repetition_suffix_len,
            args.prefix_repetition_num_prefixes,
            args.prefix_repetition_output_len,
        )
    if not args.dataset_path:
        raise ValueError(
            "--dataset-name sharegpt needs --dataset-path: a local ShareGPT JSON file (nothing is downloaded), "
            'a list of {"conversations": [{"from": "human", "value": ...}, {"from": "gpt", "value": ...}]}'
        )
    return sample_sharegpt(rng, tokenizer, args.dataset_path, args.num_prompts, args.sharegpt_output_len)


def ordinary_token_ids(tokenizer) -> list[int]:
    """The base vocabulary's ids minus the special tokens' (BOS, EOS, chat markers would distort the load)."""
    # all_special_ids lists only the named roles (EOS, pad, ...); an added special token without a role
    # (a BOS the tokenizer never adds) shows only in added_tokens_decoder.
    special_ids = set(tokenizer.all_special_ids)
    special_ids.update(token_id for token_id, token in tokenizer.added_tokens_decoder.items() if token.special)
    return [token_id for token_id in range(tokenizer.vocab_size) if token_id not in special_ids]


def sample_random(
    rng: random.Random,
    token_ids: list[int],
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    prefix_len: int = 0,
) -> list[SampleRequest]:
    """Prompts of random ordinary tokens: ``prefix_len`` shared ones, then their own, of a length drawn
    uniformly in ``[len * (1 - r), len * (1 + r)]`` (vLLM's random dataset)."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    prefix = rng.choices(token_ids, k=prefix_len)
    requests = []
    for _ in range(num_prompts):
        prompt = prefix + rng.choices(token_ids, k=_draw_length(rng, input_len, range_ratio))
        requests.append(SampleRequest(prompt, len(prompt), _draw_length(rng, output_len, range_ratio)))
    return requests


def _draw_length(rng: random.Random, length: int, range_ratio: float) -> int:
    low = max(int(length * (1 - range_ratio)), 1)
    return rng.randint(low, max(int(length * (1 + range_ratio)), low))


def sample_prefix_repetition(
    rng: random.Random,
    token_ids: list[int],
    num_prompts: int,
    prefix_len: int,
    suffix_len: int,
    num_prefixes: int,
    output_len: int,
) -> list[SampleRequest]:
    """``num_prefixes`` random prefixes, each shared by about ``num_prompts / num_prefixes`` prompts that end
    in their own random suffix; shuffled, so requests with the same prefix interleave."""
    if num_prefixes < 1:
        raise ValueError(f"--prefix-repetition-num-prefixes must be at least 1, got {num_prefixes}")
    prefixes = [rng.choices(token_ids, k=prefix_len) for _ in range(num_prefixes)]
    requests = []
    for index in range(num_prompts):
        prompt = prefixes[index % num_prefixes] + rng.choices(token_ids, k=suffix_len)
        requests.append(SampleRequest(prompt, len(prompt), output_len))
    rng.shuffle(requests)
    return requests


def sample_sharegpt(
    rng: random.Random, tokenizer, path: str, num_prompts: int, output_len: int | None
) -> list[SampleRequest]:
    """The first (human, gpt) pair of shuffled ShareGPT conversations, filtered by vLLM's length rule.

    With fewer usable pairs than ``num_prompts``, pairs are drawn again at random (vLLM oversamples too).
    """
    with open(path, encoding="utf-8") as file:
        conversations = [entry["conversations"] for entry in json.load(file)]
    rng.shuffle(conversations)
    requests = []
    for conversation in conversations:
        pair = first_exchange(conversation)
        if pair is None:
            continue
        prompt, reply = pair
        prompt_len = len(tokenizer(prompt).input_ids)
        reply_len = len(tokenizer(reply).input_ids) if output_len is None else output_len
        if is_valid_sharegpt_pair(prompt_len, reply_len, is_output_len_fixed=output_len is not None):
            requests.append(SampleRequest(prompt, prompt_len, reply_len))
            if len(requests) == num_prompts:
                return requests
    if not requests:
        raise ValueError(f"{path}: no conversation passes the ShareGPT length filter")
    return requests + rng.choices(requests, k=num_prompts - len(requests))


def first_exchange(conversation: list[dict]) -> tuple[str, str] | None:
    """(first human turn, the gpt reply right after it), or None when the conversation has no such pair."""
    for turn, next_turn in zip(conversation, conversation[1:]):
        if turn.get("from") == "human" and next_turn.get("from") == "gpt":
            return turn["value"], next_turn["value"]
    return None


def is_valid_sharegpt_pair(prompt_len: int, output_len: int, is_output_len_fixed: bool = False) -> bool:
    """vLLM's rule: prompt and reply of at least 4 tokens (a fixed output length skips the reply's check),
    a prompt of at most 1024, both together at most 2048."""
    if prompt_len < SHAREGPT_MIN_LEN or prompt_len > SHAREGPT_MAX_PROMPT_LEN:
        return False
    if not is_output_len_fixed and output_len < SHAREGPT_MIN_LEN:
        return False
    return prompt_len + output_len <= SHAREGPT_MAX_TOTAL_LEN
