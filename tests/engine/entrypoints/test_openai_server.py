"""The server's other routes and its model routing: ``/v1/models``, ``/health``, ``/version``,
vLLM's ``/tokenize`` and ``/detokenize``, requests without ``model``, and HTTP errors (unknown
route, wrong method) in OpenAI's error shape."""

from __future__ import annotations

import httpx
import pytest

from tests.engine.entrypoints.conftest import ENGINE_KWARGS, MODEL, make_client, serve_models

pytestmark = pytest.mark.usefixtures("engine_left_idle")

MAX_MODEL_LEN = ENGINE_KWARGS["max_model_len"]
TEXT = "Hello, world! Ünïcödé and emoji 🦊."


def test_models_lists_the_served_model(client, model_path):
    [card] = client.models.list().data
    assert (card.id, card.object, card.owned_by) == (MODEL, "model", "serval")
    assert card.model_extra["max_model_len"] == MAX_MODEL_LEN and card.model_extra["root"] == model_path


def test_health_and_version(base_url):
    health = httpx.get(f"{base_url}/health")
    assert health.status_code == 200
    version = httpx.get(f"{base_url}/version")
    assert version.status_code == 200 and version.json()["version"]


def test_tokenize_and_detokenize_round_trip(base_url, tokenizer):
    tokenized = httpx.post(f"{base_url}/tokenize", json={"model": MODEL, "prompt": TEXT, "return_token_strs": True})
    assert tokenized.status_code == 200
    body = tokenized.json()
    assert body["tokens"] == tokenizer.encode(TEXT)
    assert (body["count"], body["max_model_len"]) == (len(body["tokens"]), MAX_MODEL_LEN)
    assert body["token_strs"] == tokenizer.convert_ids_to_tokens(body["tokens"])
    detokenized = httpx.post(f"{base_url}/detokenize", json={"model": MODEL, "tokens": body["tokens"]})
    assert detokenized.status_code == 200 and detokenized.json() == {"prompt": tokenizer.decode(body["tokens"])}
    plain = httpx.post(f"{base_url}/tokenize", json={"prompt": TEXT, "add_special_tokens": False}).json()
    assert plain["tokens"] == tokenizer.encode(TEXT, add_special_tokens=False) and plain["token_strs"] is None
    assert httpx.post(f"{base_url}/detokenize", json={"tokens": plain["tokens"]}).json()["prompt"] == TEXT


@pytest.mark.parametrize(
    "path, body, message",
    [
        ("/detokenize", {"tokens": [5, 100000]}, "outside the vocabulary"),
        ("/detokenize", {"tokens": "abc"}, "tokens"),
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/tokenize", {"messages": [{"role": "robot", "content": "x"}]}, "role"),
    ],
)
def test_tokenizer_routes_refuse_bad_input(base_url, path, body, message):
    response = httpx.post(f"{base_url}{path}", json=body)
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "BadRequestError" and message in response.json()["error"]["message"]


def test_a_request_without_model_goes_to_the_only_model(base_url):
    response = httpx.post(f"{base_url}/v1/completions", timeout=60, json={"prompt": "Hi", "max_tokens": 3})
    assert response.status_code == 200 and response.json()["model"] == MODEL


def test_two_models_are_routed_by_name_and_model_is_then_required(serving, engine):
    from engine.entrypoints.openai.serving import OpenAIServing

    other = OpenAIServing(engine, "alias")
    with serve_models({MODEL: serving, "alias": other}) as server:
        client = make_client(server.base_url)
        assert sorted(card.id for card in client.models.list().data) == sorted([MODEL, "alias"])
        assert client.completions.create(model="alias", prompt="Hi", max_tokens=2).model == "alias"
        response = httpx.post(
            f"{server.base_url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}]}
        )
        assert response.status_code == 400 and response.json()["error"]["param"] == "model"


def test_http_errors_use_openais_shape(base_url):
    missing = httpx.get(f"{base_url}/v1/nothing-here")
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "NotFoundError"
    wrong_method = httpx.get(f"{base_url}/v1/completions")
    assert wrong_method.status_code == 405 and wrong_method.json()["error"]["code"] == 405


class FailingRouter:
    """A ``ModelRouter`` whose model server fails: before any item, after the first one, or everywhere."""

    def model_ids(self) -> list[str]:
        return ["broken", "flaky"]

    async def call(self, model_id, endpoint, request):
        from engine.entrypoints.openai.streaming import SSEChunk

        if model_id == "broken":
            raise ConnectionError("the replica is gone")
        yield SSEChunk('data: {"partial": true}\n\n')
        raise ConnectionError("the replica died mid-stream")

    async def model_card(self, model_id):
        raise ConnectionError("the replica is gone")

    async def check_health(self, model_id):
        raise ConnectionError("the replica is gone")


def test_a_failing_model_server_gives_openai_errors():
    from engine.entrypoints.openai.api_server import build_app
    from tests.engine.entrypoints.conftest import ServerThread

    with ServerThread(build_app(FailingRouter())) as server:
        url = server.base_url
        broken = httpx.post(f"{url}/v1/completions", json={"model": "broken", "prompt": "Hi"})
        assert broken.status_code == 500 and "the replica is gone" in broken.json()["error"]["message"]
        flaky = httpx.post(f"{url}/v1/completions", json={"model": "flaky", "prompt": "Hi", "stream": True})
        assert flaky.status_code == 200
        events = [event for event in flaky.text.split("\n\n") if event]
        assert events[0] == 'data: {"partial": true}' and events[-1] == "data: [DONE]"
        assert "the replica died mid-stream" in events[-2] and events[-2].startswith('data: {"error": ')
        assert httpx.get(f"{url}/v1/models").status_code == 500
        assert httpx.get(f"{url}/health").status_code == 503
