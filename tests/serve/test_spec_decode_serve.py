"""One Serve app with speculative decoding (a draft model, the YAML's engine_kwargs shape): streams carry
exactly the greedy tokens the engine gives without speculation, usage counts them, and the replica's stats
and /metrics report the drafts."""

from __future__ import annotations

import time

import httpx
import openai
import pytest
from ray import serve

from tests.serve.cluster import deploy_and_wait, llm_config, serve_config

pytestmark = pytest.mark.slow

MODEL = "llama-spec"
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def app(ray_head, tiny_checkpoint):
    checkpoint = tiny_checkpoint("llama")
    speculative_config = {"model": checkpoint, "num_speculative_tokens": 3}  # the target drafts for itself
    config = serve_config(ray_head.http_port, [llm_config(MODEL, checkpoint, speculative_config=speculative_config)])
    deploy_and_wait(ray_head, config)
    return ray_head.base_url, checkpoint


def greedy_offline(checkpoint: str, prompt: str) -> str:
    from engine import LLM, SamplingParams

    llm = LLM(model=checkpoint, dtype="float32", max_model_len=512)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    text = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].text
    llm.shutdown()
    return text


def test_streams_carry_the_non_speculative_tokens_and_usage_counts_them(app):
    base_url, checkpoint = app
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=120)
    prompt = "def load(self, path):\n    with open(path) as f:"
    stream = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    text = "".join(chunk.choices[0].text for chunk in chunks if chunk.choices)
    finish = [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices and chunk.choices[0].finish_reason]
    assert text == greedy_offline(checkpoint, prompt)
    assert finish == ["length"]
    assert chunks[-1].usage.completion_tokens == MAX_TOKENS
    assert chunks[-1].usage.prompt_tokens > 0


def test_replica_stats_and_metrics_report_the_drafts(app):
    base_url, _ = app
    stats = serve.get_deployment_handle(f"LLMServer:{MODEL}", app_name="llm").stats.remote().result()
    spec = stats["spec_decoding"]
    assert spec["num_draft_tokens"] > 0 and spec["num_accepted_tokens"] >= 0.98 * spec["num_draft_tokens"], spec
    deadline = time.monotonic() + 60  # Ray's metrics agent exports every few seconds
    while True:
        text = httpx.get(f"{base_url}/metrics", timeout=30).text
        accepted = [line for line in text.splitlines() if line.startswith("serval_spec_decode_num_accepted_tokens")]
        if accepted or time.monotonic() > deadline:
            break
        time.sleep(2)
    assert accepted and all(f'model_name="{MODEL}"' in line for line in accepted), accepted
