"""``/v1/embeddings`` end to end: the official client against ``build_app(LocalModelRouter(...))`` on the real
AsyncLLM (tiny Qwen2) that also serves completions, checked against transformers' final hidden states pooled
as the engine pools them (the last token's, L2-normalized).

Covers text and token-id inputs, one or a batch (batched equals one by one), ``encoding_format`` float and
base64 (the same float32 vector), ``normalize``, ``truncate_prompt_tokens``, usage, generation and
embeddings interleaved on one engine, and bad input: a 400 (404 for an unknown model) in OpenAI's shape, the
server serving on. Every test leaves the engine idle with its KV free.
"""

from __future__ import annotations

import base64
import struct

import httpx
import pytest
import torch

from engine import SamplingParams
from tests.engine.entrypoints.conftest import ENGINE_KWARGS, MODEL

pytestmark = pytest.mark.usefixtures("engine_left_idle")

TEXTS = ("The quick brown fox", "def main():\n    return 0", "Paris is the capital of France.")
MAX_MODEL_LEN = ENGINE_KWARGS["max_model_len"]


@pytest.fixture(scope="module")
def hf_hidden(model_path):
    """``token_ids -> [len, hidden]``: transformers' final hidden states (the decoder stack with its last norm)."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(model_path, dtype=torch.float32).eval()

    def hidden(token_ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return model(torch.tensor([token_ids])).last_hidden_state[0]

    return hidden


def last_token_normalized(hidden: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.normalize(hidden[-1], dim=-1)


def assert_same_vector(vector, reference: torch.Tensor) -> None:
    vector = torch.tensor(vector, dtype=torch.float32)
    assert vector.shape == reference.shape
    assert torch.nn.functional.cosine_similarity(vector, reference, dim=0) > 0.9999
    torch.testing.assert_close(vector, reference, atol=1e-5, rtol=0)


def embed(base_url: str, **body) -> httpx.Response:
    return httpx.post(f"{base_url}/v1/embeddings", json={"model": MODEL, **body}, timeout=60)


def test_embeddings_equal_transformers_hidden_states_pooled_by_last_token(client, tokenizer, hf_hidden):
    response = client.embeddings.create(model=MODEL, input=list(TEXTS))  # the client asks for base64
    assert (response.object, response.model) == ("list", MODEL)
    assert [item.index for item in response.data] == [0, 1, 2]
    token_ids = [tokenizer.encode(text) for text in TEXTS]
    for item, ids in zip(response.data, token_ids):
        assert item.object == "embedding"
        assert_same_vector(item.embedding, last_token_normalized(hf_hidden(ids)))
    num_tokens = sum(map(len, token_ids))
    assert (response.usage.prompt_tokens, response.usage.total_tokens) == (num_tokens, num_tokens)


def test_a_batch_equals_its_inputs_one_by_one(client):
    batch = client.embeddings.create(model=MODEL, input=list(TEXTS)).data
    for text, item in zip(TEXTS, batch):
        [alone] = client.embeddings.create(model=MODEL, input=text).data
        torch.testing.assert_close(torch.tensor(item.embedding), torch.tensor(alone.embedding), atol=1e-6, rtol=0)


def test_float_and_base64_carry_the_same_float32_vector(base_url):
    floats = embed(base_url, input=TEXTS[0], encoding_format="float").json()["data"][0]["embedding"]
    encoded = embed(base_url, input=TEXTS[0], encoding_format="base64").json()["data"][0]["embedding"]
    raw = base64.b64decode(encoded)
    assert list(struct.unpack(f"<{len(raw) // 4}f", raw)) == floats
    assert embed(base_url, input=TEXTS[0]).json()["data"][0]["embedding"] == floats  # float is the default


def test_token_id_inputs_equal_their_texts(client, tokenizer):
    token_ids = [tokenizer.encode(text) for text in TEXTS[:2]]
    by_text = client.embeddings.create(model=MODEL, input=list(TEXTS[:2])).data
    by_ids = client.embeddings.create(model=MODEL, input=token_ids).data
    [one] = client.embeddings.create(model=MODEL, input=token_ids[0]).data
    for text_item, ids_item in zip(by_text, by_ids):
        torch.testing.assert_close(
            torch.tensor(text_item.embedding), torch.tensor(ids_item.embedding), atol=1e-6, rtol=0
        )
    torch.testing.assert_close(torch.tensor(one.embedding), torch.tensor(by_text[0].embedding), atol=1e-6, rtol=0)


def test_normalize_false_gives_the_raw_hidden_state(base_url, tokenizer, hf_hidden):
    body = embed(base_url, input=TEXTS[1], encoding_format="float", normalize=False).json()
    assert_same_vector(body["data"][0]["embedding"], hf_hidden(tokenizer.encode(TEXTS[1]))[-1])


def test_truncate_prompt_tokens_keeps_the_last_tokens(base_url, tokenizer):
    token_ids = tokenizer.encode(TEXTS[2])
    truncated = embed(base_url, input=token_ids, truncate_prompt_tokens=4, encoding_format="float").json()
    last_four = embed(base_url, input=token_ids[-4:], encoding_format="float").json()
    assert truncated["data"] == last_four["data"] and truncated["usage"]["prompt_tokens"] == 4
    long = [7] * (MAX_MODEL_LEN + 10)
    assert embed(base_url, input=long, truncate_prompt_tokens=-1).json()["usage"]["prompt_tokens"] == MAX_MODEL_LEN


def test_one_engine_serves_generation_and_embeddings_at_once(client, offline, tokenizer, hf_hidden):
    """A completion streams while embeddings of other prompts run in the same steps; neither changes the other."""
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=24)
    expected = offline.generate(TEXTS[0], params, use_tqdm=False)[0].outputs[0].text
    stream = client.completions.create(
        model=MODEL, prompt=TEXTS[0], max_tokens=24, temperature=0, stream=True, extra_body={"ignore_eos": True}
    )
    text = next(iter(stream)).choices[0].text
    [item] = client.embeddings.create(model=MODEL, input=TEXTS[2]).data
    text += "".join(chunk.choices[0].text for chunk in stream)
    assert text == expected
    assert_same_vector(item.embedding, last_token_normalized(hf_hidden(tokenizer.encode(TEXTS[2]))))


@pytest.mark.parametrize(
    "body, message",
    [
        ({"input": ""}, "The prompt is empty"),
        ({"input": []}, "input must not be empty"),
        ({"input": [[]]}, "The prompt is empty"),
        ({"input": 5}, "input must be a string, a list of strings"),
        ({"input": ["a", 1]}, "input must be a string, a list of strings"),
        ({"input": ["a"] * 2049}, "at most 2048"),
        ({"input": [7] * (MAX_MODEL_LEN + 1)}, "maximum context length is 2048"),
        ({"input": [10**9]}, "outside the vocabulary"),
        ({"input": [[5, 6, 7], [10**9]]}, "outside the vocabulary"),  # the good one queued: aborted, not leaked
        ({"input": "Hi", "encoding_format": "bytes"}, "encoding_format"),
        ({"input": "Hi", "dimensions": 8}, "does not support Matryoshka"),
        ({"input": "Hi", "dimensions": 0}, "dimensions"),
        ({"input": "Hi", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens must be -1"),
        ({"input": "Hi", "truncate_prompt_tokens": MAX_MODEL_LEN + 1}, "greater than max_model_len"),
    ],
)
def test_bad_input_is_a_400_and_the_server_keeps_serving(base_url, body, message):
    response = embed(base_url, **body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert message in error["message"] and error["type"] == "BadRequestError" and error["code"] == 400
    assert embed(base_url, input="Still serving").status_code == 200


def test_an_unknown_model_is_a_404(base_url):
    response = httpx.post(f"{base_url}/v1/embeddings", json={"model": "nope", "input": "Hi"})
    assert response.status_code == 404 and response.json()["error"]["param"] == "model"
