"""The benchmark datasets (``serval.bench.datasets``) on the tiny checkpoint's tokenizer: exact random
lengths of ordinary tokens, reproducible seeds, shared prefixes, and vLLM's ShareGPT filter."""

from __future__ import annotations

import argparse
import json

import pytest

from serval.bench.datasets import add_dataset_arguments, sample_requests

ARCH = "qwen2"
NUM_SPECIAL_TOKENS = 5  # ids 0..4 in the tiny checkpoints' tokenizer


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoint):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_checkpoint(ARCH))


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_dataset_arguments(parser)
    return parser.parse_args(list(argv))


def test_random_lengths_are_exact_and_in_range(tokenizer):
    args = parse(
        "--num-prompts", "200", "--random-input-len", "40", "--random-output-len", "10", "--random-range-ratio", "0.5"
    )
    requests = sample_requests(args, tokenizer)
    assert len(requests) == 200
    for request in requests:
        assert isinstance(request.prompt, list) and len(request.prompt) == request.prompt_len
        assert 20 <= request.prompt_len <= 60 and 5 <= request.expected_output_len <= 15
    # The range is covered, not just one length.
    assert len({request.prompt_len for request in requests}) > 10


def test_random_without_range_has_fixed_lengths_and_no_special_ids(tokenizer):
    requests = sample_requests(
        parse("--num-prompts", "50", "--random-input-len", "64", "--random-output-len", "8"), tokenizer
    )
    assert {(request.prompt_len, request.expected_output_len) for request in requests} == {(64, 8)}
    token_ids = {token_id for request in requests for token_id in request.prompt}
    assert min(token_ids) >= NUM_SPECIAL_TOKENS and max(token_ids) < tokenizer.vocab_size


def test_random_is_reproducible_from_the_seed(tokenizer):
    def sample(seed: str):
        return sample_requests(
            parse("--num-prompts", "10", "--random-input-len", "16", "--random-range-ratio", "0.3", "--seed", seed),
            tokenizer,
        )

    assert sample("7") == sample("7")
    assert sample("7") != sample("8")


def test_random_prefix_len_is_shared_by_every_prompt(tokenizer):
    args = parse("--num-prompts", "8", "--random-input-len", "10", "--random-prefix-len", "6", "--seed", "2")
    requests = sample_requests(args, tokenizer)
    assert {request.prompt_len for request in requests} == {16} == {len(request.prompt) for request in requests}
    assert len({tuple(request.prompt[:6]) for request in requests}) == 1
    assert len({tuple(request.prompt[6:]) for request in requests}) == 8


def test_the_old_dataset_name_is_a_deprecated_alias(capsys):
    assert parse("--dataset-name", "prefix-repetition").dataset_name == "prefix_repetition"
    assert "--dataset-name prefix-repetition is deprecated; use prefix_repetition" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse("--dataset-name", "sonnet")


def test_random_range_ratio_of_one_is_refused(tokenizer):
    with pytest.raises(ValueError, match="range-ratio"):
        sample_requests(parse("--random-range-ratio", "1.0"), tokenizer)


def test_prefix_repetition_shares_prefixes(tokenizer):
    args = parse(
        "--dataset-name",
        "prefix_repetition",
        "--num-prompts",
        "12",
        "--prefix-repetition-prefix-len",
        "24",
        "--prefix-repetition-suffix-len",
        "8",
        "--prefix-repetition-num-prefixes",
        "3",
        "--prefix-repetition-output-len",
        "5",
    )
    requests = sample_requests(args, tokenizer)
    assert len(requests) == 12
    assert {(request.prompt_len, request.expected_output_len) for request in requests} == {(32, 5)}
    prefixes = [tuple(request.prompt[:24]) for request in requests]
    assert len(set(prefixes)) == 3 and all(prefixes.count(prefix) == 4 for prefix in prefixes)
    assert len({tuple(request.prompt[24:]) for request in requests}) == 12  # each suffix its own
    assert min(token_id for request in requests for token_id in request.prompt) >= NUM_SPECIAL_TOKENS
    assert sample_requests(args, tokenizer) == requests


def conversation(prompt: str, reply: str, first: str = "human") -> dict:
    second = "gpt" if first == "human" else "human"
    return {"conversations": [{"from": first, "value": prompt}, {"from": second, "value": reply}]}


def write_sharegpt(tmp_path, tokenizer) -> tuple[str, dict[str, str]]:
    """A ShareGPT file with one conversation per filter rule; returns its path and the usable prompt -> reply."""

    def words(count: int) -> str:
        return " ".join(["lorem"] * count)

    usable = {"tell me about " + words(10): words(20), "and now " + words(30): words(8)}
    entries = [conversation(prompt, reply) for prompt, reply in usable.items()]
    entries += [
        conversation("hi", words(20)),  # prompt under 4 tokens
        conversation(words(10), "ok"),  # reply under 4 tokens
        conversation(words(1100), words(10)),  # prompt over 1024 tokens
        conversation(words(1000), words(1100)),  # together over 2048 tokens
        conversation(words(10), words(10), first="gpt"),  # no human turn before a gpt reply
        {"conversations": [{"from": "human", "value": words(10)}]},
    ]  # no reply
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(entries))
    token_counts = {text: len(tokenizer(text).input_ids) for text in [words(10), words(1100), "hi", "ok"]}
    assert token_counts["hi"] < 4 and token_counts["ok"] < 4 and token_counts[words(1100)] > 1024
    return str(path), usable


def test_sharegpt_filters_like_vllm(tmp_path, tokenizer):
    path, usable = write_sharegpt(tmp_path, tokenizer)
    requests = sample_requests(
        parse("--dataset-name", "sharegpt", "--dataset-path", path, "--num-prompts", "2"), tokenizer
    )
    assert {request.prompt for request in requests} == set(usable)
    for request in requests:
        assert request.prompt_len == len(tokenizer(request.prompt).input_ids)
        assert request.expected_output_len == len(tokenizer(usable[request.prompt]).input_ids)


def test_sharegpt_output_len_override_and_oversampling(tmp_path, tokenizer):
    path, usable = write_sharegpt(tmp_path, tokenizer)
    args = parse(
        "--dataset-name", "sharegpt", "--dataset-path", path, "--num-prompts", "7", "--sharegpt-output-len", "3"
    )
    requests = sample_requests(args, tokenizer)
    assert len(requests) == 7
    # A fixed output length skips the reply's minimum: the short-reply pair is usable now.
    assert {request.prompt for request in requests} == set(usable) | {" ".join(["lorem"] * 10)}
    assert {request.expected_output_len for request in requests} == {3}
    assert sample_requests(args, tokenizer) == requests


def test_sharegpt_needs_a_path(tokenizer):
    with pytest.raises(ValueError, match="dataset-path"):
        sample_requests(parse("--dataset-name", "sharegpt"), tokenizer)
