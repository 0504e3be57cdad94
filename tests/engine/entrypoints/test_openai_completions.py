"""``/v1/completions`` end to end: the official client against ``build_app(LocalModelRouter(...))``
on a real AsyncLLM (tiny Qwen2), checked against the offline ``LLM`` on the same checkpoint.

Covers text and token-id prompts, batches x ``n`` (choice numbering, usage), streaming (same text
as unstreamed, ``include_usage``), stop strings, stop token ids and vLLM's other sampling extras,
logprobs, echo, seeds and ``max_tokens: null``; every test leaves the engine idle with its KV free.
"""

from __future__ import annotations

import httpx
import pytest

from engine import SamplingParams
from tests.engine.entrypoints.conftest import ENGINE_KWARGS, MODEL

pytestmark = pytest.mark.usefixtures("engine_left_idle")

PROMPTS = ("The quick brown fox", "def main():\n")
MAX_MODEL_LEN = ENGINE_KWARGS["max_model_len"]


def offline_completion(offline, prompt, max_tokens: int, **params):
    params = {"temperature": 0.0, "ignore_eos": True, **params}
    return offline.generate(prompt, SamplingParams(max_tokens=max_tokens, **params), use_tqdm=False)[0].outputs[0]


def greedy(client, prompt, max_tokens: int, **extra_body):
    return client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, extra_body={"ignore_eos": True, **extra_body}
    )


def streamed_choices(client, **kwargs) -> tuple[dict[int, str], dict[int, str], list]:
    """(text per choice index, finish_reason per choice index, all chunks) of a streamed completion."""
    texts: dict[int, str] = {}
    finish_reasons: dict[int, str] = {}
    chunks = list(client.completions.create(model=MODEL, stream=True, **kwargs))
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            if choice.finish_reason is not None:
                assert choice.index not in finish_reasons, "a choice finished twice"
                finish_reasons[choice.index] = choice.finish_reason
    return texts, finish_reasons, chunks


def test_greedy_text_equals_the_offline_engine(client, offline, tokenizer):
    response = greedy(client, PROMPTS[0], 24)
    assert response.id.startswith("cmpl-") and response.object == "text_completion"
    assert response.model == MODEL and response.created > 0
    [choice] = response.choices
    assert choice.text == offline_completion(offline, PROMPTS[0], 24).text
    assert (choice.index, choice.finish_reason) == (0, "length")
    num_prompt_tokens = len(tokenizer.encode(PROMPTS[0]))
    usage = response.usage
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (
        num_prompt_tokens,
        24,
        num_prompt_tokens + 24,
    )


def test_a_token_id_prompt_equals_its_text(client, tokenizer):
    token_ids = tokenizer.encode(PROMPTS[1])
    assert greedy(client, token_ids, 16).choices[0].text == greedy(client, PROMPTS[1], 16).choices[0].text


def test_a_batch_times_n_numbers_choices_per_prompt_and_counts_each_prompt_once(client, offline, tokenizer):
    response = greedy(client, list(PROMPTS), 8, n=2)
    assert [choice.index for choice in response.choices] == [0, 1, 2, 3]
    for choice in response.choices:
        assert choice.text == offline_completion(offline, PROMPTS[choice.index // 2], 8).text
    num_prompt_tokens = sum(len(tokenizer.encode(prompt)) for prompt in PROMPTS)
    assert (response.usage.prompt_tokens, response.usage.completion_tokens) == (num_prompt_tokens, 4 * 8)
    token_batch = greedy(client, [tokenizer.encode(prompt) for prompt in PROMPTS], 8)
    assert [choice.text for choice in token_batch.choices] == [response.choices[0].text, response.choices[2].text]


def test_streamed_text_equals_the_unstreamed_text_and_usage_comes_last(client, tokenizer):
    expected = greedy(client, PROMPTS[0], 32).choices[0].text
    texts, finish_reasons, chunks = streamed_choices(
        client,
        prompt=PROMPTS[0],
        max_tokens=32,
        temperature=0,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    assert texts == {0: expected} and finish_reasons == {0: "length"}
    assert len({chunk.id for chunk in chunks}) == 1 and chunks[0].id.startswith("cmpl-")
    *content_chunks, usage_chunk = chunks
    assert usage_chunk.choices == [] and all(chunk.usage is None for chunk in content_chunks)
    num_prompt_tokens = len(tokenizer.encode(PROMPTS[0]))
    assert (usage_chunk.usage.prompt_tokens, usage_chunk.usage.completion_tokens, usage_chunk.usage.total_tokens) == (
        num_prompt_tokens,
        32,
        num_prompt_tokens + 32,
    )


def test_a_stream_ends_with_done_and_sends_no_usage_unless_asked(base_url):
    with httpx.stream(
        "POST",
        f"{base_url}/v1/completions",
        timeout=60,
        json={"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 8, "stream": True},
    ) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        body = response.read().decode()
    events = [event for event in body.split("\n\n") if event]
    assert all(event.startswith("data: ") for event in events)
    assert events[-1] == "data: [DONE]" and 'usage": {' not in body


def test_a_streamed_batch_with_n_matches_the_unstreamed_one(client):
    expected = greedy(client, list(PROMPTS), 12, n=2)
    texts, finish_reasons, _ = streamed_choices(
        client, prompt=list(PROMPTS), n=2, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    assert texts == {choice.index: choice.text for choice in expected.choices}
    assert finish_reasons == {index: "length" for index in range(4)}


@pytest.mark.parametrize("include_stop", [False, True])
@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_string_ends_the_text(client, offline, include_stop, stream):
    full_text = offline_completion(offline, PROMPTS[0], 40).text
    stop = full_text[6:9]
    first = full_text.index(stop)
    expected = full_text[: first + len(stop)] if include_stop else full_text[:first]
    kwargs = dict(
        prompt=PROMPTS[0],
        max_tokens=40,
        temperature=0,
        stop=[stop],
        extra_body={"ignore_eos": True, "include_stop_str_in_output": include_stop},
    )
    if stream:
        texts, finish_reasons, _ = streamed_choices(client, **kwargs)
        assert (texts[0], finish_reasons[0]) == (expected, "stop")
    else:
        [choice] = client.completions.create(model=MODEL, **kwargs).choices
        assert (choice.text, choice.finish_reason, choice.model_extra["stop_reason"]) == (expected, "stop", stop)


@pytest.mark.parametrize(
    "extras",
    [
        {"min_tokens": 6, "top_k": 1, "temperature": 1.0},
        {"repetition_penalty": 1.5, "presence_penalty": 0.5, "frequency_penalty": 0.5},
        {"min_p": 0.2, "top_p": 0.9, "temperature": 0.8, "seed": 11},
        {"ignore_eos": False, "skip_special_tokens": False},
    ],
)
def test_vllm_sampling_extras_match_the_offline_engine(client, offline, extras):
    body = {"temperature": 0.0, "ignore_eos": True, **extras}
    response = client.completions.create(
        model=MODEL, prompt=PROMPTS[1], max_tokens=20, temperature=body.pop("temperature"), extra_body=body
    )
    reference = offline_completion(offline, PROMPTS[1], 20, **extras)
    assert response.choices[0].text == reference.text
    assert response.choices[0].finish_reason == reference.finish_reason


def test_stop_token_ids_and_logit_bias(client, offline, tokenizer):
    reference = offline_completion(offline, PROMPTS[0], 20)
    stop_token = reference.token_ids[4]
    first = reference.token_ids.index(stop_token)
    [choice] = greedy(client, PROMPTS[0], 20, stop_token_ids=[stop_token]).choices
    assert (choice.finish_reason, choice.model_extra["stop_reason"]) == ("stop", stop_token)
    assert choice.text == tokenizer.decode(reference.token_ids[:first])
    forced = tokenizer.encode(" fox", add_special_tokens=False)[-1]
    [choice] = greedy(client, PROMPTS[0], 5, logit_bias={str(forced): 100}).choices
    assert choice.text == tokenizer.decode([forced] * 5)


def test_logprobs_match_the_offline_engine(client, offline, tokenizer):
    reference = offline_completion(offline, PROMPTS[0], 10, logprobs=2)
    [choice] = client.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=10, temperature=0, logprobs=2, extra_body={"ignore_eos": True}
    ).choices
    logprobs = choice.logprobs
    assert logprobs.tokens == [tokenizer.decode([token_id]) for token_id in reference.token_ids]
    for position, token_id, token_logprob, top in zip(
        reference.logprobs, reference.token_ids, logprobs.token_logprobs, logprobs.top_logprobs
    ):
        assert token_logprob == pytest.approx(position[token_id].logprob, abs=1e-4)
        assert 2 <= len(top) <= 3 and max(top.values()) == pytest.approx(token_logprob, abs=1e-6)  # greedy
    assert logprobs.text_offset == [sum(map(len, logprobs.tokens[:i])) for i in range(10)]


def test_streamed_logprobs_continue_the_text_offsets(client):
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=PROMPTS[0],
            max_tokens=10,
            temperature=0,
            logprobs=1,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    tokens, offsets = [], []
    for chunk in chunks:
        for choice in chunk.choices:
            tokens += choice.logprobs.tokens
            offsets += choice.logprobs.text_offset
    assert len(tokens) == 10
    assert offsets[0] == 0 and all(later >= earlier for earlier, later in zip(offsets, offsets[1:]))


def test_echo_prepends_the_prompt_and_its_logprobs(client, tokenizer):
    plain = greedy(client, PROMPTS[0], 6).choices[0].text
    [choice] = greedy(client, PROMPTS[0], 6, echo=True).choices
    assert choice.text == PROMPTS[0] + plain
    token_ids = tokenizer.encode(PROMPTS[1])
    [choice] = client.completions.create(
        model=MODEL,
        prompt=token_ids,
        max_tokens=6,
        temperature=0,
        echo=True,
        logprobs=1,
        extra_body={"ignore_eos": True},
    ).choices
    assert choice.text.startswith(tokenizer.decode(token_ids))
    assert len(choice.logprobs.tokens) == len(token_ids) + 6
    assert choice.logprobs.token_logprobs[0] is None and choice.logprobs.top_logprobs[0] is None
    assert all(value is not None and value <= 0 for value in choice.logprobs.token_logprobs[1:])
    texts, _, _ = streamed_choices(
        client, prompt=PROMPTS[0], max_tokens=6, temperature=0, echo=True, extra_body={"ignore_eos": True}
    )
    assert texts == {0: PROMPTS[0] + plain}


def test_seeded_sampling_is_reproducible(client):
    def sample():
        response = client.completions.create(
            model=MODEL,
            prompt=PROMPTS[0],
            max_tokens=16,
            temperature=1.0,
            seed=1234,
            n=3,
            extra_body={"ignore_eos": True},
        )
        return [choice.text for choice in response.choices]

    first = sample()
    assert sample() == first and len(set(first)) > 1  # child i uses seed + i


def test_max_tokens_null_generates_up_to_the_context_length(base_url):
    prompt = [5 + i % 500 for i in range(MAX_MODEL_LEN - 40)]
    response = httpx.post(
        f"{base_url}/v1/completions",
        timeout=60,
        json={"model": MODEL, "prompt": prompt, "max_tokens": None, "temperature": 0, "ignore_eos": True},
    )
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["usage"]["completion_tokens"] == 40 and body["usage"]["total_tokens"] == MAX_MODEL_LEN
    assert body["choices"][0]["finish_reason"] == "length"


def test_cache_salt_priority_and_unknown_fields_are_accepted(client):
    expected = greedy(client, PROMPTS[0], 8).choices[0].text
    salted = greedy(client, PROMPTS[0], 8, cache_salt="tenant-a", priority=1, some_future_field={"x": 1})
    assert salted.choices[0].text == expected
