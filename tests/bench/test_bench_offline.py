"""``serval bench throughput`` and ``serval bench latency`` end to end on the tiny llama checkpoint."""

from __future__ import annotations

import json

import pytest

from serval import cli

ENGINE_FLAGS = [
    "--dtype",
    "float32",
    "--max-model-len",
    "64",
    "--device",
    "cpu",
    "--kv-cache-memory-bytes",
    str(4 << 20),
]


@pytest.fixture
def serval_main(monkeypatch):
    """``serval.cli.main`` with only the offline bench commands, so other subcommands' imports don't matter here."""
    monkeypatch.setattr(
        cli,
        "SUBCOMMANDS",
        {
            path: module
            for path, module in cli.SUBCOMMANDS.items()
            if path in {("bench", "throughput"), ("bench", "latency")}
        },
    )
    return cli.main


@pytest.mark.slow  # a whole offline benchmark: ~20 s
def test_throughput_counts_every_token(tiny_checkpoint, serval_main, tmp_path, capsys):
    num_prompts, input_len, output_len = 5, 12, 6
    output_json = tmp_path / "throughput.json"
    assert (
        serval_main(
            [
                "bench",
                "throughput",
                "--model",
                tiny_checkpoint("llama"),
                *ENGINE_FLAGS,
                "--num-prompts",
                str(num_prompts),
                "--random-input-len",
                str(input_len),
                "--random-output-len",
                str(output_len),
                "--output-json",
                str(output_json),
            ]
        )
        == 0
    )

    result = json.loads(output_json.read_text())
    assert result["num_requests"] == num_prompts
    assert result["total_num_tokens"] == num_prompts * (input_len + output_len)
    assert result["total_output_tokens"] == num_prompts * output_len
    assert result["elapsed_time"] > 0
    assert result["tokens_per_second"] == pytest.approx(result["total_num_tokens"] / result["elapsed_time"])
    assert result["output_tokens_per_second"] < result["tokens_per_second"]
    assert "Throughput: " in capsys.readouterr().out


def test_throughput_rejects_unknown_engine_kwarg(tiny_checkpoint, serval_main, capsys):
    assert (
        serval_main(
            [
                "bench",
                "throughput",
                "--model",
                tiny_checkpoint("llama"),
                *ENGINE_FLAGS,
                "--num-prompts",
                "1",
                "--engine-kwargs",
                '{"no_such_field": 1}',
            ]
        )
        == 1
    )
    assert "no_such_field" in capsys.readouterr().err


@pytest.mark.slow  # a whole offline benchmark: ~20 s
def test_latency_reports_each_iteration(tiny_checkpoint, serval_main, tmp_path):
    output_json = tmp_path / "latency.json"
    assert (
        serval_main(
            [
                "bench",
                "latency",
                "--model",
                tiny_checkpoint("llama"),
                *ENGINE_FLAGS,
                "--batch-size",
                "3",
                "--input-len",
                "8",
                "--output-len",
                "4",
                "--num-iters-warmup",
                "1",
                "--num-iters",
                "2",
                "--output-json",
                str(output_json),
                "--plot",
            ]
        )
        == 0
    )

    result = json.loads(output_json.read_text())
    latencies = result["latencies"]
    assert len(latencies) == 2 and all(latency > 0 for latency in latencies)
    assert set(result["percentiles"]) == {"10", "25", "50", "75", "90", "99"}
    assert min(latencies) <= result["percentiles"]["50"] <= max(latencies)
    assert result["avg_latency"] == pytest.approx(sum(latencies) / 2)
    assert output_json.with_suffix(".png").read_bytes().startswith(b"\x89PNG")
