"""A prompt the Ray ingress rendered and tokenized to route it (``deployments.routing_hints``) is served by the
replica's chat / completion serving as is: the same response, token for token, and no chat template or
tokenizer call on the replica's side (counted through a subclass of the model's real tokenizer)."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from deployments.kv_index import RoutingHint
from deployments.routing_hints import PromptTokenizer, make_hint, precomputed_prompt
from engine.entrypoints.openai.call_options import CallOptions, PrecomputedPrompt
from engine.entrypoints.openai.endpoints import Endpoint
from engine.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from engine.entrypoints.openai.serving_chat import ChatServing
from engine.entrypoints.openai.serving_completion import CompletionServing
from engine.model.source import load_tokenizer
from tests.conftest import wait_until_idle
from tests.engine.entrypoints.conftest import MODEL

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name three colours, then three more."},
]
TOKENIZING_METHODS = ("encode", "apply_chat_template", "__call__")


def counting_tokenizer(path: str):
    """The model's own tokenizer class, counting the calls that render or tokenize a prompt."""
    base = type(load_tokenizer(path))

    def counted(name: str):
        def method(self, *args, **kwargs):
            self.calls[name] += 1
            return getattr(base, name)(self, *args, **kwargs)

        return method

    counting = type("CountingTokenizer", (base,), {name: counted(name) for name in TOKENIZING_METHODS})
    tokenizer = counting.from_pretrained(path)
    tokenizer.calls = Counter()
    return tokenizer


async def _items(iterator) -> list:
    return [item async for item in iterator]


def serve_once(iterator):
    [response] = asyncio.run(_items(iterator))
    assert not hasattr(response, "error"), response
    return response


@pytest.fixture
def servings(engine, model_path):
    """A chat and a completion serving on the session's engine, both prompting through a counting tokenizer."""
    tokenizer = counting_tokenizer(model_path)
    chat, completion = ChatServing(engine, MODEL), CompletionServing(engine, MODEL)
    chat.tokenizer = completion.tokenizer = tokenizer
    yield chat, completion, tokenizer
    wait_until_idle(engine)


@pytest.fixture(scope="module")
def ingress_tokenizer(model_path) -> PromptTokenizer:
    """What the ingress tokenizes with: its own copy of the model's tokenizer."""
    return PromptTokenizer(load_tokenizer(model_path))


def test_a_chat_prompt_from_the_ingress_is_not_rendered_or_tokenized_again(servings, ingress_tokenizer):
    chat, _, tokenizer = servings
    request = ChatCompletionRequest(
        model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0, ignore_eos=True, logprobs=True, top_logprobs=2
    )
    hint = make_hint(ingress_tokenizer, Endpoint.CHAT, request, None)
    plain = serve_once(chat.chat(request))
    assert tokenizer.calls["apply_chat_template"] == 1 and tokenizer.calls["encode"] == 1  # the counter counts
    tokenizer.calls.clear()
    hinted = serve_once(chat.chat(request, CallOptions(precomputed=precomputed_prompt(Endpoint.CHAT, hint))))
    assert not +tokenizer.calls, tokenizer.calls
    assert_same_chat_choices(hinted.choices, plain.choices)
    assert hinted.usage == plain.usage and hinted.usage.prompt_tokens == len(hint.prompt_token_ids)


def test_completions_use_the_ingress_tokens_for_the_first_prompt_only(servings, ingress_tokenizer):
    _, completion, tokenizer = servings
    request = CompletionRequest(
        model=MODEL, prompt=["The colours are", "Counting: one, two"], max_tokens=8, temperature=0, logprobs=1
    )
    hint = make_hint(ingress_tokenizer, Endpoint.COMPLETIONS, request, "session-1")
    plain = serve_once(completion.completions(request))
    tokenizer.calls.clear()
    hinted = serve_once(
        completion.completions(request, CallOptions(precomputed=precomputed_prompt(Endpoint.COMPLETIONS, hint)))
    )
    assert tokenizer.calls == Counter(encode=1)  # the second prompt's: the hint covers the first
    assert_same_choices(hinted.choices, plain.choices)
    assert hinted.usage == plain.usage


def assert_same_choices(got, expected) -> None:
    """The same text and tokens, with the same logprobs up to float rounding: two prompts of one request may
    share a decode step or not (the second is added a moment later), and a batch of one row and one of two
    round their matmuls differently (a CI run saw 1e-7)."""
    assert [(c.index, c.text, c.finish_reason, c.logprobs.tokens, c.logprobs.text_offset) for c in got] == [
        (c.index, c.text, c.finish_reason, c.logprobs.tokens, c.logprobs.text_offset) for c in expected
    ]
    for choice, reference in zip(got, expected, strict=True):
        assert choice.logprobs.token_logprobs == pytest.approx(reference.logprobs.token_logprobs, abs=1e-5)
        for top, reference_top in zip(choice.logprobs.top_logprobs, reference.logprobs.top_logprobs, strict=True):
            assert top == pytest.approx(reference_top, abs=1e-5)


def assert_same_chat_choices(got, expected) -> None:
    """The same message and tokens, each token's logprobs equal up to float rounding: the second request's
    prompt hits the prefix cache, so its last prompt rows are computed in a smaller matmul than the first's,
    which MKL's AVX-512 kernels round differently (an Intel AVX-512 CPU: other last bits, the same tokens)."""

    def tokens(choices):
        return [(c.index, c.message, c.finish_reason, [t.token for t in c.logprobs.content]) for c in choices]

    def logprobs(choices):
        return [[[t.logprob, *(top.logprob for top in t.top_logprobs)] for t in c.logprobs.content] for c in choices]

    assert tokens(got) == tokens(expected)
    for row, reference in zip(logprobs(got), logprobs(expected), strict=True):
        assert row == [pytest.approx(values, abs=1e-5) for values in reference]


def test_the_served_prompt_is_the_precomputed_one(servings, ingress_tokenizer):
    """Evidence without counting: given another prompt's tokens, the serving answers that prompt."""
    _, completion, tokenizer = servings
    other = CompletionRequest(model=MODEL, prompt="Counting: one, two", max_tokens=6, temperature=0)
    request = other.model_copy(update={"prompt": "The colours are"})
    other_tokens = ingress_tokenizer.prompt(Endpoint.COMPLETIONS, other).token_ids
    expected = serve_once(completion.completions(other))
    tokenizer.calls.clear()
    served = serve_once(completion.completions(request, CallOptions(precomputed=PrecomputedPrompt(other_tokens))))
    assert not +tokenizer.calls
    assert served.choices[0].text == expected.choices[0].text
    assert served.usage.prompt_tokens == len(other_tokens)


def test_what_a_hint_lends_the_replica():
    tokens = [5, 6, 7]
    chat_hint = make_hint(None, Endpoint.CHAT, None, "session-1")  # no tokenizer: a session-only hint
    assert chat_hint.prompt_token_ids is None and precomputed_prompt(Endpoint.CHAT, chat_hint) is None
    assert precomputed_prompt(Endpoint.CHAT, RoutingHint(tokens)) is None  # chat needs the rendered text too
    assert precomputed_prompt(Endpoint.CHAT, RoutingHint(tokens, prompt_text="t")) == PrecomputedPrompt(tokens, "t")
    assert precomputed_prompt(Endpoint.COMPLETIONS, RoutingHint(tokens)) == PrecomputedPrompt(tokens)
    assert precomputed_prompt(Endpoint.TOKENIZE, RoutingHint(tokens)) is None
    assert precomputed_prompt(Endpoint.COMPLETIONS, None) is None
