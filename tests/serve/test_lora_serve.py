"""Multi-LoRA through a real Ray Serve app (ingress + LLM servers), driven over HTTP by the official client.

One app, two models over the tiny llama checkpoint: ``tiny-lora`` (one replica) with a static adapter
(``lora_modules``: ``static``) and a dynamic directory (``dynamic``, a malformed ``broken``, and one above
``max_lora_rank``), and ``tiny-mux`` (two replicas, the dynamic directory only), where Serve's model
multiplexing keeps an adapter's requests on the replica holding it. Greedy tokens of each adapter equal the
offline ``LLM(enable_lora=True)`` for the same adapter and differ from the base model's.
"""

from __future__ import annotations

import re
import shutil
import time
from pathlib import Path

import httpx
import openai
import pytest

from serval.tools.make_adapter import make_lora_adapter
from tests.serve.cluster import deploy_and_wait, llm_config, serve_config

pytestmark = pytest.mark.slow  # three replicas to deploy and an offline reference: ~100 s at load 5

MODEL, MUX = "tiny-lora", "tiny-mux"
PROMPT = "The quick brown fox"
MAX_TOKENS = 12
MAX_LORA_RANK = 8


@pytest.fixture(scope="module")
def adapters(tiny_checkpoint, tmp_path_factory) -> dict[str, str]:
    """name -> directory: ``static`` outside the dynamic directory, the rest in it (``dynamic_dir``)."""
    base, root = tiny_checkpoint("llama"), tmp_path_factory.mktemp("lora_serve")
    made = {
        "static": make_lora_adapter(root / "static", base, rank=4, seed=11),
        "dynamic": make_lora_adapter(root / "dynamic_dir" / "dynamic", base, rank=8, alpha=8.0, seed=12),
        "too-big": make_lora_adapter(root / "dynamic_dir" / "too-big", base, rank=16, seed=13),
        "later": make_lora_adapter(root / "later", base, rank=2, seed=14),
        **{name: make_lora_adapter(root / "dynamic_dir" / name, base, rank=2, seed=15) for name in ("e1", "e2", "e3")},
    }
    broken = root / "dynamic_dir" / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text('{"r": 4, "lora_alpha": 8')  # cut short
    return {name: str(path) for name, path in made.items()} | {"dynamic_dir": str(root / "dynamic_dir")}


@pytest.fixture(scope="module")
def base_url(ray_head, tiny_checkpoint, adapters):
    base = tiny_checkpoint("llama")
    lora = {"max_loras": 2, "max_lora_rank": MAX_LORA_RANK}
    served = llm_config(MODEL, base, **lora)
    served["lora_config"] = {
        "dynamic_lora_loading_path": adapters["dynamic_dir"],
        "max_num_adapters_per_replica": 4,
        "lora_modules": {"static": adapters["static"]},
    }
    mux = llm_config(MUX, base, num_replicas=2, **lora)
    mux["deployment_config"]["ray_actor_options"] = {"num_cpus": 0.25}
    mux["lora_config"] = {"dynamic_lora_loading_path": adapters["dynamic_dir"]}
    deploy_and_wait(ray_head, serve_config(ray_head.http_port, [served, mux]))
    return ray_head.base_url


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def offline(tiny_checkpoint, adapters) -> dict[str | None, str]:
    """The greedy text of ``PROMPT`` offline: the base model (None) and each adapter by name."""
    from engine import LLM, SamplingParams
    from engine.lora_request import LoRARequest

    llm = LLM(tiny_checkpoint("llama"), dtype="float32", max_model_len=512, enable_lora=True, max_lora_rank=8)
    loras = [None] + [LoRARequest(name, i, adapters[name]) for i, name in enumerate(("static", "dynamic"), 1)]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate([PROMPT] * len(loras), params, use_tqdm=False, lora_request=loras)
    llm.shutdown()
    return {lora and lora.lora_name: out.outputs[0].text for lora, out in zip(loras, outputs, strict=True)}


def greedy(client: openai.OpenAI, model: str) -> str:
    """The greedy completion of ``PROMPT`` (``MAX_TOKENS`` tokens)."""
    completion = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True}
    )
    assert completion.usage.completion_tokens == MAX_TOKENS and completion.model == model  # vLLM names the adapter
    return completion.choices[0].text


def post(base_url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{base_url}{path}", json=body, timeout=120)


def test_each_adapter_equals_the_offline_engine_in_both_name_forms(client, offline):
    assert offline["static"] != offline[None] and offline["dynamic"] != offline[None]
    assert greedy(client, MODEL) == offline[None]
    for name in ("static", "dynamic"):
        assert greedy(client, f"{MODEL}:{name}") == offline[name], name  # Ray Serve LLM's form
        assert greedy(client, name) == offline[name], name  # vLLM's form
    stream = client.chat.completions.create(
        model="dynamic", messages=[{"role": "user", "content": "Hi"}], max_tokens=4, stream=True
    )
    assert [chunk.choices[0].finish_reason for chunk in stream if chunk.choices][-1] == "length"


def test_models_lists_the_adapters_with_their_parent(client, adapters):
    greedy(client, f"{MODEL}:dynamic")  # held now, listed by name; the directory's others as <model>:<name>
    cards = {card.id: card for card in client.models.list().data}
    assert {MODEL, MUX, "static", "dynamic", f"{MODEL}:broken", f"{MODEL}:too-big"} <= set(cards)
    assert cards["static"].parent == MODEL and cards["static"].root == adapters["static"]
    assert cards["dynamic"].parent == MODEL and cards["dynamic"].root == adapters["dynamic"]
    assert cards[MODEL].parent is None and cards[f"{MUX}:dynamic"].parent == MUX


def test_load_use_unload_a_dynamic_adapter(base_url, client, adapters, offline):
    body = {"lora_name": "later", "lora_path": adapters["later"], "model": MODEL}
    loaded = post(base_url, "/v1/load_lora_adapter", body)
    assert loaded.status_code == 200 and loaded.text == "Success: LoRA adapter 'later' added successfully."
    again = post(base_url, "/v1/load_lora_adapter", body)
    assert again.status_code == 400 and "has already been loaded" in again.json()["error"]["message"]
    later = greedy(client, "later")
    assert later != offline[None] and greedy(client, f"{MODEL}:later") == later
    assert "later" in {card.id for card in client.models.list().data}
    unloaded = post(base_url, "/v1/unload_lora_adapter", {"lora_name": "later", "model": MODEL})
    assert unloaded.status_code == 200 and unloaded.text == "Success: LoRA adapter 'later' removed successfully."
    with pytest.raises(openai.NotFoundError):
        greedy(client, "later")
    gone = post(base_url, "/v1/unload_lora_adapter", {"lora_name": "later", "model": MODEL})
    assert gone.status_code == 404 and gone.json()["error"]["message"] == "The lora adapter 'later' cannot be found."


def test_an_adapter_rewritten_in_place_and_loaded_again_serves_its_new_weights(base_url, client, adapters, offline):
    """Same name, same path, new files (a retrained adapter copied over the old one), unloaded and loaded
    again: a new adapter to the engine's slots, host LRU and prefix cache (its content digest differs), so
    the greedy text is the new weights' (the "static" adapter's files), never the old's cached KV or weights."""
    path = Path(adapters["dynamic_dir"]).parent / "rewritten"
    shutil.copytree(adapters["later"], path)
    body = {"lora_name": "rewritten", "lora_path": str(path), "model": MODEL}
    unload = {"lora_name": "rewritten", "model": MODEL}
    assert post(base_url, "/v1/load_lora_adapter", body).status_code == 200
    before = greedy(client, "rewritten")  # its prompt's blocks now cached under the name
    assert before != offline["static"]
    assert post(base_url, "/v1/unload_lora_adapter", unload).status_code == 200
    shutil.rmtree(path)
    shutil.copytree(adapters["static"], path)
    assert post(base_url, "/v1/load_lora_adapter", body).status_code == 200
    assert greedy(client, "rewritten") == offline["static"]
    assert post(base_url, "/v1/unload_lora_adapter", unload).status_code == 200


def test_every_bad_adapter_is_a_clean_error_and_the_replica_serves_on(base_url, client, adapters, offline):
    for model in ("nowhere", f"{MODEL}:nowhere", "../static"):
        response = post(base_url, "/v1/completions", {"model": model, "prompt": PROMPT, "max_tokens": 2})
        assert response.status_code == 404, (model, response.text)
        assert response.json()["error"] == {
            "message": f"The model `{model}` does not exist.",
            "type": "NotFoundError",
            "param": "model",
            "code": 404,
        }
    for model, problem in (("broken", "unreadable"), (f"{MODEL}:too-big", "above max_lora_rank (8)")):
        response = post(base_url, "/v1/completions", {"model": model, "prompt": PROMPT, "max_tokens": 2})
        assert response.status_code == 400 and problem in response.json()["error"]["message"], response.text
    for path, problem in (
        (str(Path(adapters["dynamic_dir"]) / "broken"), "unreadable"),
        (adapters["too-big"], "above max_lora_rank (8)"),
        ("/nonexistent/adapter", "no adapter_config.json"),
    ):
        response = post(base_url, "/v1/load_lora_adapter", {"lora_name": "bad", "lora_path": path, "model": MODEL})
        assert response.status_code == 400 and problem in response.json()["error"]["message"], response.text
    missing = post(base_url, "/v1/load_lora_adapter", {"lora_name": "bad", "model": MODEL})
    assert missing.status_code == 400 and "lora_path" in missing.json()["error"]["message"]
    assert greedy(client, MODEL) == offline[None]
    assert greedy(client, "static") == offline["static"]


def test_past_max_num_adapters_the_least_recently_used_is_dropped_and_loads_again(base_url, client, offline):
    """``tiny-lora`` holds at most 4 adapters (``static`` for good): three more push ``dynamic`` out, and its
    next request checks it in again."""
    greedy(client, "dynamic")
    for name in ("e1", "e2", "e3"):
        greedy(client, f"{MODEL}:{name}")
    held = [card.id for card in client.models.list().data if card.parent == MODEL and ":" not in card.id]
    assert sorted(held) == ["e1", "e2", "e3", "static"], held
    assert greedy(client, "dynamic") == offline["dynamic"]
    deadline = time.monotonic() + 60  # Ray's metrics agent exports every few seconds
    while (evictions := lora_series(base_url, "serval_lora_adapter_evictions", MODEL)) < 2:
        assert time.monotonic() < deadline, f"serval_lora_adapter_evictions: {evictions}"
        time.sleep(2)
    assert lora_series(base_url, "serval_lora_adapters_loaded", MODEL) == 4
    # The engine's own side: five adapters went through its two device slots (max_loras) in this test alone.
    while (swaps := lora_series(base_url, "serval_lora_slot_swaps", MODEL)) < 3:
        assert time.monotonic() < deadline, f"serval_lora_slot_swaps: {swaps}"
        time.sleep(2)


def lora_series(base_url: str, name: str, model: str) -> float:
    """The sum of ``name``'s samples for ``model`` in the app's ``/metrics``."""
    lines = httpx.get(f"{base_url}/metrics", timeout=30).text.splitlines()
    pattern = re.compile(rf'^{name}(_total)?{{[^}}]*model_name="{model}"[^}}]*}} (\S+)$')
    return sum(float(match[2]) for line in lines if (match := pattern.match(line)))


def serval_lora_requests(base_url: str, model: str, adapter: str) -> dict[str, float]:
    """replica -> ``serval_lora_requests`` for ``adapter`` of ``model``, from the app's ``/metrics``."""
    counts = {}
    for line in httpx.get(f"{base_url}/metrics", timeout=30).text.splitlines():
        if line.startswith("serval_lora_requests") and f'adapter="{adapter}"' in line:
            if f'model_name="{model}"' in line:
                counts[re.search(r'replica="([^"]+)"', line)[1]] = float(line.rsplit(" ", 1)[1])
    return counts


def test_an_adapters_requests_stay_on_the_replica_holding_it(base_url, client, offline):
    """Two idle replicas: without multiplexing Serve would spread these evenly at random; with it, the first
    request's replica reports the adapter and takes every later one."""
    assert greedy(client, f"{MUX}:dynamic") == offline["dynamic"]
    time.sleep(1.0)  # the replica reports what it holds every 0.1 s; the ingress's router hears it
    for _ in range(8):
        assert greedy(client, f"{MUX}:dynamic") == offline["dynamic"]
    deadline = time.monotonic() + 60  # Ray's metrics agent exports every few seconds
    while sum((counts := serval_lora_requests(base_url, MUX, "dynamic")).values()) < 9:
        assert time.monotonic() < deadline, f"serval_lora_requests did not count the requests: {counts}"
        time.sleep(2)
    assert sorted(counts.values()) in ([9.0], [0.0, 9.0]), counts
