"""`serval bench tune` on a live app: a 2x2 sweep redeploys the app per point and picks the best one."""

from __future__ import annotations

import json

import yaml

from serval.cli import main as serval_main
from tests.serve.cluster import app_status, deploy_and_wait, llm_config, serve_config

LLAMA = "tiny-llama"
ORIGINAL_MAX_NUM_SEQS = 64


def test_tune_sweeps_two_by_two_and_restores_the_original_config(ray_head, tiny_checkpoint, tmp_path):
    config = serve_config(ray_head.http_port, [llm_config(LLAMA, tiny_checkpoint("llama"),
                                                          max_num_seqs=ORIGINAL_MAX_NUM_SEQS)])
    deploy_and_wait(ray_head, config)
    config_path = tmp_path / "serve.yaml"
    config_path.write_text(yaml.safe_dump(config))
    result_dir = tmp_path / "results"
    exit_code = serval_main([
        "bench", "tune", "--config", str(config_path), "--address", ray_head.dashboard_url,
        "--url", ray_head.base_url, "--model", LLAMA, "--tokenizer", tiny_checkpoint("llama"),
        "--max-num-seqs", "2", "8", "--max-num-batched-tokens", "512", "1024",
        "--random-input-len", "32", "--random-output-len", "8", "--num-prompts", "12",
        "--max-concurrency", "8", "--slo", "ttft=60000,tpot=10000", "--disable-tqdm",
        "--result-dir", str(result_dir)])
    assert exit_code == 0

    [json_path] = result_dir.glob("tune-*.json")
    record = json.loads(json_path.read_text())
    points = record["points"]
    assert sorted((p["max_num_seqs"], p["max_num_batched_tokens"]) for p in points) == \
        [(2, 512), (2, 1024), (8, 512), (8, 1024)]
    assert all(p["error"] is None and p["num_failed"] == 0 and p["output_throughput"] > 0 for p in points)
    assert all(set(p["latencies_ms"]) == {"ttft", "tpot"} for p in points)
    within = [p for p in points if p["is_within_slo"]]
    assert record["best"] == max(within, key=lambda p: p["output_throughput"])
    assert (result_dir / f"{json_path.stem}-frontier.png").stat().st_size > 10_000

    # The user's deployment is back as it was.
    deployed = app_status(ray_head)
    assert deployed["status"] == "RUNNING"
    engine_kwargs = deployed["deployed_app_config"]["args"]["llm_configs"][0]["engine_kwargs"]
    assert engine_kwargs["max_num_seqs"] == ORIGINAL_MAX_NUM_SEQS and "max_num_batched_tokens" not in engine_kwargs
