"""Observability end to end: `serval bench serve` loads a live app while a real Prometheus scrapes it.

Prometheus runs the shipped config (``configs/prometheus/prometheus.yml``):
every Ray node found through Ray's service-discovery file, and the app's own
``GET /metrics``. The load is the benchmark client itself, on a shared-prefix
dataset (prefix-cache hits) against a deliberately small KV pool
(preemptions), plus a few bad requests (HTTP errors), so that every panel of
the Grafana dashboard has something to show. Then every panel's query runs
against Prometheus' HTTP API and must return data.
"""

from __future__ import annotations

import json
import math
import re
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from serval.cli import main as serval_main
from serval.dashboard import load_dashboard, panel_queries_by_row
from tests.serve.cluster import deploy_and_wait, llm_config, serve_config
from tests.serve.prometheus import PrometheusServer

LLAMA = "tiny-llama"
NUM_PROMPTS = 80
REQUEST_RATE = 4
OUTPUT_LEN = 48
# Dashboard variables as Grafana would substitute them for this app.
RATE_WINDOW = "1m"


@pytest.fixture(scope="module")
def app(ray_head, tiny_checkpoint):
    # 40 blocks of 16 tokens: far fewer than 16 running requests of ~110 tokens need, so the engine preempts.
    config = llm_config(
        LLAMA, tiny_checkpoint("llama"), max_num_seqs=16, num_gpu_blocks_override=40, enable_prefix_caching=True
    )
    deploy_and_wait(ray_head, serve_config(ray_head.http_port, [config]))
    return ray_head


@pytest.fixture(scope="module")
def prometheus(app, tmp_path_factory):
    with PrometheusServer(tmp_path_factory.mktemp("prometheus"), app.http_port) as server:
        yield server


def bench_serve(app, checkpoint: str, result_dir, name: str, *load_flags: str) -> tuple[int, dict]:
    """(exit code, JSON record) of one `serval bench serve` run of the shared-prefix dataset."""
    exit_code = serval_main(
        [
            "bench",
            "serve",
            "--base-url",
            app.base_url,
            "--model",
            LLAMA,
            "--tokenizer",
            checkpoint,
            "--dataset-name",
            "prefix_repetition",
            "--prefix-repetition-prefix-len",
            "64",
            "--prefix-repetition-suffix-len",
            "16",
            "--prefix-repetition-num-prefixes",
            "4",
            "--prefix-repetition-output-len",
            str(OUTPUT_LEN),
            "--seed",
            "0",
            "--ignore-eos",
            "--save-detailed",
            "--disable-tqdm",
            "--result-dir",
            str(result_dir),
            "--result-filename",
            f"{name}.json",
            *load_flags,
        ]
    )
    return exit_code, json.loads((result_dir / f"{name}.json").read_text())


@pytest.fixture(scope="module")
def bench_run(app, prometheus, tiny_checkpoint, tmp_path_factory):
    """A burst (16 at once: preemptions), then the measured run: a steady rate for about 20 s, so that
    it spans several of Ray's metric exports; a few bad requests (HTTP errors) during it."""
    result_dir = tmp_path_factory.mktemp("bench")
    burst_exit_code, _ = bench_serve(
        app, tiny_checkpoint("llama"), result_dir, "burst", "--num-prompts", "32", "--max-concurrency", "16"
    )
    assert burst_exit_code == 0
    with ThreadPoolExecutor(1) as pool:
        bad_requests = pool.submit(send_bad_requests, app.base_url)
        measured = bench_serve(
            app,
            tiny_checkpoint("llama"),
            result_dir,
            "steady",
            "--num-prompts",
            str(NUM_PROMPTS),
            "--request-rate",
            str(REQUEST_RATE),
            "--max-concurrency",
            "16",
        )
        bad_requests.result()
    return measured


def send_bad_requests(base_url: str) -> None:
    for body in ({"model": "no-such-model", "prompt": "hi"}, {"model": LLAMA, "prompt": "hi", "max_tokens": -1}):
        for _ in range(3):
            assert httpx.post(f"{base_url}/v1/completions", json=body, timeout=30).status_code >= 400
            time.sleep(1)


def test_bench_serve_against_the_live_app(bench_run):
    exit_code, record = bench_run
    assert exit_code == 0
    assert (record["completed"], record["failed"]) == (NUM_PROMPTS, 0)
    assert record["output_lens"] == [OUTPUT_LEN] * NUM_PROMPTS
    assert NUM_PROMPTS / REQUEST_RATE / 2 < record["duration"]
    assert all(ttft <= e2e for ttft, e2e in zip(record["ttfts"], record["latencies"]))
    assert record["total_input_tokens"] == NUM_PROMPTS * (64 + 16)
    assert 0 < record["median_tpot_ms"] < record["median_e2el_ms"]


def test_prometheus_scrapes_every_ray_node_and_the_app(prometheus, bench_run):
    targets = prometheus.targets()
    assert {target["labels"]["job"] for target in targets} == {"ray", "serval"}
    assert all(target["scrapeUrl"].startswith("http://127.0.0.1:") for target in targets)
    deadline = time.monotonic() + 30
    while not all(target["health"] == "up" for target in targets):
        assert time.monotonic() < deadline, [(t["scrapeUrl"], t["health"], t["lastError"]) for t in targets]
        time.sleep(1)
        targets = prometheus.targets()


def substitute_variables(expr: str) -> str:
    """What Grafana sends for ``expr`` with this app selected and Prometheus scraping every second."""
    expr = expr.replace("$__rate_interval", RATE_WINDOW).replace("${__rate_interval}", RATE_WINDOW)
    expr = re.sub(r"\$\{?model_name\}?", LLAMA, expr)
    assert "$" not in expr, f"a variable the test does not know: {expr}"
    return expr


def has_finite_value(vector: list[dict]) -> bool:
    return any(math.isfinite(float(sample["value"][1])) for sample in vector)


def test_every_dashboard_panel_query_returns_data(prometheus, bench_run):
    # The disaggregated-prefill row needs a PD app (tests/serve/test_pd_serve.py checks its series), the
    # KV-aware routing row a KV-routed deployment (tests/serve/test_kv_routing.py checks its series), the
    # speculative decoding row an engine with speculative_config
    # (tests/engine/spec_decode/test_spec_decode_metrics.py checks
    # its series are the ones deployments/metrics.py exports). Request migrations need a replica killed
    # mid-request (tests/serve/test_migration.py reads serval_migrations off the app's /metrics); LoRA
    # adapters a lora_config (tests/serve/test_lora_serve.py reads serval_lora_requests off /metrics); the
    # autoscaling row a TTFTPolicy deployment (tests/serve/test_autoscaling.py reads its series off /metrics).
    queries = [
        (title, expr)
        for row, row_queries in panel_queries_by_row(load_dashboard()).items()
        if row not in ("Disaggregated prefill", "KV-aware routing", "Speculative decoding", "Autoscaling (TTFTPolicy)")
        for title, expr in row_queries
        if title not in ("Request migrations", "LoRA adapters")
    ]
    assert len(queries) >= 15
    deadline = time.monotonic() + 90  # Ray's agents export every few seconds; Prometheus scrapes every second
    while True:
        empty = [
            (title, expr)
            for title, expr in queries
            if not has_finite_value(prometheus.query(substitute_variables(expr)))
        ]
        if not empty:
            return
        assert time.monotonic() < deadline, f"panels without data: {empty}"
        time.sleep(3)


def test_app_metrics_endpoint_serves_every_replica_family(app, prometheus, bench_run):
    text = httpx.get(f"{app.base_url}/metrics", timeout=30).text
    families = set(re.findall(r"^# TYPE (\S+) ", text, flags=re.MULTILINE))
    for name in (
        "serval_num_requests_running",
        "serval_kv_cache_usage_perc",
        "serval_generation_tokens_total",
        "serval_prompt_tokens_total",
        "serval_request_success_total",
        "serval_num_preemptions_total",
        "serval_prefix_cache_hits_total",
        "serval_time_to_first_token_seconds",
        "serval_e2e_request_latency_seconds",
        "serval_request_decode_time_seconds",
    ):
        assert name in families, f"{name} missing from the app's /metrics: {sorted(families)}"
    assert not [name for name in families if not name.startswith("serval_")]
    samples = [line for line in text.splitlines() if line and not line.startswith("#")]
    # Earlier tests' models may share this Ray session: every sample is labelled, this app's are there.
    assert all('model_name="' in line and 'replica="' in line for line in samples)
    assert any(f'model_name="{LLAMA}"' in line for line in samples)
    # Prometheus got the same totals from the app as from Ray's agents.
    deadline = time.monotonic() + 90  # as above: Ray's agents export every few seconds, later under load
    query = 'sum by (job) ({__name__=~"(ray_)?serval_generation_tokens_total"})'
    while True:
        totals = {sample["metric"]["job"]: float(sample["value"][1]) for sample in prometheus.query(query)}
        # Earlier tests' replicas of this model may still be counted: the two jobs agree, and include this run.
        # (Neither job scraped yet is not agreement: it read as such, then failed on totals["ray"].)
        if "ray" in totals and totals["ray"] == totals.get("serval") and totals["ray"] >= NUM_PROMPTS * OUTPUT_LEN:
            return
        assert time.monotonic() < deadline, totals
        time.sleep(2)
