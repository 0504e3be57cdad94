"""The app's /metrics merging (deployments/metrics_export.py) on hand-written node pages, no cluster."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from deployments.metrics_export import render, serval_families

NODE_A = """# HELP ray_serve_num_http_requests_total Serve's own.
# TYPE ray_serve_num_http_requests_total counter
ray_serve_num_http_requests_total{route="/"} 4.0
# HELP ray_serval_generation_tokens_total Tokens generated.
# TYPE ray_serval_generation_tokens_total counter
ray_serval_generation_tokens_total{NodeAddress="10.0.0.1",model_name="m",replica="a"} 12.0
# HELP ray_serval_e2e_request_latency_seconds End-to-end request latency.
# TYPE ray_serval_e2e_request_latency_seconds histogram
ray_serval_e2e_request_latency_seconds_bucket{NodeAddress="10.0.0.1",le="1.0",model_name="m",replica="a"} 1.0
ray_serval_e2e_request_latency_seconds_bucket{NodeAddress="10.0.0.1",le="+Inf",model_name="m",replica="a"} 2.0
ray_serval_e2e_request_latency_seconds_count{NodeAddress="10.0.0.1",model_name="m",replica="a"} 2.0
ray_serval_e2e_request_latency_seconds_sum{NodeAddress="10.0.0.1",model_name="m",replica="a"} 1.5
"""
NODE_B = """# HELP ray_serval_generation_tokens_total Tokens generated.
# TYPE ray_serval_generation_tokens_total counter
ray_serval_generation_tokens_total{NodeAddress="10.0.0.2",model_name="m",replica="b"} 30.0
# HELP ray_serval_num_requests_running Requests running.
# TYPE ray_serval_num_requests_running gauge
ray_serval_num_requests_running{NodeAddress="10.0.0.2",model_name="m",replica="b"} 3.0
"""


def samples_by_name(text: str) -> dict[str, list]:
    samples: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append(sample)
    return samples


def test_nodes_pages_merge_into_serval_families_without_rays_prefix():
    text = render(serval_families([NODE_A, NODE_B])).decode()
    samples = samples_by_name(text)
    assert set(samples) == {
        "serval_generation_tokens_total",
        "serval_e2e_request_latency_seconds_bucket",
        "serval_e2e_request_latency_seconds_count",
        "serval_e2e_request_latency_seconds_sum",
        "serval_num_requests_running",
    }
    assert sorted(s.labels["replica"] for s in samples["serval_generation_tokens_total"]) == ["a", "b"]
    assert sum(s.value for s in samples["serval_generation_tokens_total"]) == 42.0
    assert [s.labels["le"] for s in samples["serval_e2e_request_latency_seconds_bucket"]] == ["1.0", "+Inf"]
    # One HELP/TYPE per family, however many nodes report it.
    assert text.count("# TYPE serval_generation_tokens_total counter") == 1
    assert "ray_" not in text


def test_no_node_answering_gives_an_empty_page():
    assert render(serval_families([])) == b""
