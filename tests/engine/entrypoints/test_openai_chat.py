"""``/v1/chat/completions`` end to end: the official client against a real AsyncLLM (tiny Qwen2,
ChatML template), checked against the offline ``LLM.chat`` on the same checkpoint.

Covers the template (roles, text parts), greedy equality, streaming (role first, same text,
``include_usage``), ``max_completion_tokens`` / ``max_tokens`` / unset, ``n``, ``stop``, ``seed``
and logprobs with ``top_logprobs``; a model without a chat template (a 400 saying so, the request's
``chat_template`` and the server's ``--chat-template``).
"""

from __future__ import annotations

import pytest

from engine import SamplingParams
from tests.engine.entrypoints.conftest import ENGINE_KWARGS, MODEL

pytestmark = pytest.mark.usefixtures("engine_left_idle")

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name three colours."},
    {"role": "assistant", "content": "Red."},
    {"role": "user", "content": "More?"},
]
IGNORE_EOS = {"ignore_eos": True}


def offline_chat(offline, messages, max_tokens: int, **params):
    params = {"temperature": 0.0, "ignore_eos": True, **params}
    return offline.chat(messages, SamplingParams(max_tokens=max_tokens, **params), use_tqdm=False)[0]


def greedy_chat(client, max_tokens: int = 16, messages=MESSAGES, **kwargs):
    extra_body = {**IGNORE_EOS, **kwargs.pop("extra_body", {})}
    return client.chat.completions.create(
        model=MODEL, messages=messages, max_completion_tokens=max_tokens, temperature=0, extra_body=extra_body, **kwargs
    )


def test_greedy_chat_equals_the_offline_engine(client, offline):
    response = greedy_chat(client, 20)
    assert response.id.startswith("chatcmpl-") and response.object == "chat.completion"
    assert response.model == MODEL and response.created > 0
    reference = offline_chat(offline, MESSAGES, 20)
    [choice] = response.choices
    assert (choice.message.role, choice.message.content) == ("assistant", reference.outputs[0].text)
    assert (choice.index, choice.finish_reason, choice.logprobs) == (0, "length", None)
    usage = response.usage
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (
        len(reference.prompt_token_ids),
        20,
        len(reference.prompt_token_ids) + 20,
    )


def test_the_prompt_is_the_chat_template_with_a_generation_prompt(base_url, client, tokenizer):
    import httpx

    rendered = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    tokenized = httpx.post(f"{base_url}/tokenize", json={"model": MODEL, "messages": MESSAGES}).json()
    assert tokenized["tokens"] == tokenizer.encode(rendered, add_special_tokens=False)
    assert greedy_chat(client, 1).usage.prompt_tokens == tokenized["count"]


def test_text_parts_equal_the_joined_string(client):
    parts = [
        {"role": "user", "content": [{"type": "text", "text": "Name three"}, {"type": "text", "text": "colours."}]}
    ]
    joined = [{"role": "user", "content": "Name three\ncolours."}]
    assert (
        greedy_chat(client, 12, parts).choices[0].message.content
        == greedy_chat(client, 12, joined).choices[0].message.content
    )


def test_streamed_chat_equals_the_unstreamed_one(client):
    expected = greedy_chat(client, 24)
    chunks = list(greedy_chat(client, 24, stream=True, stream_options={"include_usage": True}))
    assert len({chunk.id for chunk in chunks}) == 1 and chunks[0].object == "chat.completion.chunk"
    first, *content_chunks, usage_chunk = chunks
    assert (first.choices[0].delta.role, first.choices[0].delta.content) == ("assistant", "")
    text = "".join(chunk.choices[0].delta.content or "" for chunk in content_chunks)
    assert text == expected.choices[0].message.content
    assert [chunk.choices[0].finish_reason for chunk in content_chunks][-1] == "length"
    assert all(chunk.choices[0].delta.role is None for chunk in content_chunks)
    assert usage_chunk.choices == [] and usage_chunk.usage.model_dump(
        include={"prompt_tokens", "completion_tokens"}
    ) == expected.usage.model_dump(include={"prompt_tokens", "completion_tokens"})


def test_streamed_chat_with_n(client):
    chunks = list(greedy_chat(client, 10, n=2, stream=True))
    roles = [choice.index for chunk in chunks for choice in chunk.choices if choice.delta.role == "assistant"]
    assert sorted(roles) == [0, 1]
    texts = {0: "", 1: ""}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    expected = greedy_chat(client, 10).choices[0].message.content
    assert texts == {0: expected, 1: expected}


@pytest.mark.slow  # generates up to the 2048-token context: 8-16 s
def test_token_limits(client, offline):
    assert greedy_chat(client, 5).usage.completion_tokens == 5
    deprecated = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=7, temperature=0, extra_body=IGNORE_EOS
    )
    assert deprecated.usage.completion_tokens == 7
    unset = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, extra_body=IGNORE_EOS)
    assert unset.usage.total_tokens == ENGINE_KWARGS["max_model_len"]  # up to the context length
    assert unset.choices[0].finish_reason == "length"


def test_stop_and_seeded_n(client, offline):
    full_text = offline_chat(offline, MESSAGES, 30).outputs[0].text
    stop = full_text[5:8]
    [choice] = greedy_chat(client, 30, stop=stop).choices
    assert (choice.message.content, choice.finish_reason) == (full_text[: full_text.index(stop)], "stop")

    def sample():
        response = client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_completion_tokens=12,
            n=2,
            temperature=1.0,
            seed=99,
            extra_body=IGNORE_EOS,
        )
        return [choice.message.content for choice in response.choices]

    first = sample()
    assert sample() == first and len(first) == 2
    reference = offline_chat(offline, MESSAGES, 12, temperature=1.0, seed=99, n=2)
    assert first == [completion.text for completion in reference.outputs]


def test_logprobs_with_top_logprobs(client, offline):
    response = greedy_chat(client, 8, logprobs=True, top_logprobs=3)
    reference = offline_chat(offline, MESSAGES, 8, logprobs=3).outputs[0]
    content = response.choices[0].logprobs.content
    assert len(content) == 8
    for entry, token_id, position in zip(content, reference.token_ids, reference.logprobs):
        assert entry.logprob == pytest.approx(position[token_id].logprob, abs=1e-4)
        assert entry.bytes == list(entry.token.encode())
        tops = [top.logprob for top in entry.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True)
        assert tops[0] == pytest.approx(entry.logprob, abs=1e-6)  # greedy picks the most likely token
    streamed = list(greedy_chat(client, 8, logprobs=True, top_logprobs=3, stream=True))
    streamed_content = [
        entry for chunk in streamed for choice in chunk.choices if choice.logprobs for entry in choice.logprobs.content
    ]
    assert [entry.token for entry in streamed_content] == [entry.token for entry in content]
    no_top = greedy_chat(client, 4, logprobs=True).choices[0].logprobs.content
    assert len(no_top) == 4 and all(entry.top_logprobs == [] for entry in no_top)


# A model without a chat template (a base model's, as Gemma 3 270M's file): the tiny model's tokenizer, its
# template removed. vLLM's answer: a 400 that says what works instead.
TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}<assistant>"


@pytest.fixture(scope="module")
def templateless_tokenizer(model_path, tmp_path_factory) -> str:
    import json
    import shutil
    from pathlib import Path

    path = tmp_path_factory.mktemp("no-chat-template")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(model_path) / name, path / name)
    config = json.loads((path / "tokenizer_config.json").read_text())
    assert config.pop("chat_template")
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return str(path)


def _serve_templateless(model_path: str, tokenizer: str, **overrides):
    from engine.entrypoints.openai.serving import OpenAIServing
    from tests.engine.entrypoints.conftest import make_async_llm, serve_models

    engine = make_async_llm(model_path, tokenizer=tokenizer, max_num_seqs=2, **overrides)
    return engine, serve_models({MODEL: OpenAIServing(engine, MODEL)})


def _chat(base_url: str, **body):
    import httpx

    body = {"model": MODEL, "messages": MESSAGES[:2], "max_tokens": 4, "temperature": 0, **body}
    return httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=60)


def _template_tokens(base_url: str, **body) -> int:
    import httpx

    response = httpx.post(f"{base_url}/tokenize", json={"model": MODEL, "messages": MESSAGES[:2], **body}, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["count"]


def test_a_model_without_a_chat_template_refuses_chats_unless_given_one(model_path, templateless_tokenizer):
    from engine.entrypoints.openai.chat_template import NO_CHAT_TEMPLATE
    from tests.engine.entrypoints.test_openai_errors import error_body

    engine, server = _serve_templateless(model_path, templateless_tokenizer)
    with server:
        response = _chat(server.base_url)
        assert response.status_code == 400
        error = error_body(response)
        assert error["type"] == "BadRequestError" and error["message"] == NO_CHAT_TEMPLATE
        assert "use /v1/completions, or pass chat_template" in error["message"]
        completion = _completion(server.base_url)
        assert completion.status_code == 200, completion.text
        given = _chat(server.base_url, chat_template=TEMPLATE)  # vLLM's request field
        assert given.status_code == 200, given.text
        assert given.json()["usage"]["prompt_tokens"] == _template_tokens(server.base_url, chat_template=TEMPLATE)
    engine.shutdown()


def test_the_servers_chat_template_file_replaces_the_tokenizers(model_path, templateless_tokenizer, tmp_path):
    """``--chat-template FILE`` (ModelConfig.chat_template): the tokenizer loads with it, so every chat uses it."""
    from engine.model.source import load_tokenizer

    template_file = tmp_path / "template.jinja"
    template_file.write_text(TEMPLATE)
    assert load_tokenizer(templateless_tokenizer, TEMPLATE).chat_template == TEMPLATE
    with pytest.raises(ValueError, match="is no Jinja template and no readable file"):
        load_tokenizer(templateless_tokenizer, str(tmp_path / "missing.jinja"))
    engine, server = _serve_templateless(model_path, templateless_tokenizer, chat_template=str(template_file))
    with server:
        response = _chat(server.base_url)
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["prompt_tokens"] == _template_tokens(server.base_url)
    engine.shutdown()


def _completion(base_url: str):
    import httpx

    body = {"model": MODEL, "prompt": "Name three colours.", "max_tokens": 4, "temperature": 0}
    return httpx.post(f"{base_url}/v1/completions", json=body, timeout=60)
