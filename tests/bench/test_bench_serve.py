"""``serval bench serve`` against a live in-process OpenAI server (the tiny Qwen2 checkpoint behind
uvicorn, no Ray; ``tests/bench/conftest.py``): the CLI end to end, the files it writes, arrivals, errors,
goodput. vLLM's flag names and result keys: ``test_bench_serve_flags.py``."""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics

import pytest

from serval import cli
from serval.bench import serve
from tests.bench.conftest import MODEL

pytestmark = pytest.mark.usefixtures("engine_left_idle")

NUM_PROMPTS = 12
INPUT_LEN = 32
OUTPUT_LEN = 8
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def base_url(bench_url):
    return bench_url


def bench_argv(base_url: str, model_path: str | None, result_dir, *extra: str) -> list[str]:
    """``model_path`` None: no ``--tokenizer`` (the bench finds it from the served model's card)."""
    return [
        "bench",
        "serve",
        "--base-url",
        base_url,
        "--model",
        MODEL,
        *(["--tokenizer", model_path] if model_path else []),
        "--result-dir",
        str(result_dir),
        "--result-filename",
        "run.json",
        "--save-detailed",
        "--disable-tqdm",
        "--num-prompts",
        str(NUM_PROMPTS),
        "--random-input-len",
        str(INPUT_LEN),
        "--random-output-len",
        str(OUTPUT_LEN),
        *extra,
    ]


def bench_args(base_url: str, model_path: str | None, *extra: str) -> argparse.Namespace:
    """Parsed ``serval bench serve`` flags, for calling :func:`serve.benchmark` directly."""
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    return parser.parse_args(bench_argv(base_url, model_path, "unused")[2:] + list(extra))


def assert_all_completed(report: dict, num_requests: int, output_len: int) -> None:
    assert (report["completed"], report["failed"], report["first_errors"]) == (num_requests, 0, [])
    assert all(ttft <= e2el for ttft, e2el in zip(report["ttfts"], report["latencies"], strict=True))
    assert report["output_lens"] == [output_len] * num_requests  # ignore_eos: every request runs to max_tokens
    assert report["total_input_tokens"] == sum(report["input_lens"])
    assert report["total_output_tokens"] == num_requests * output_len


def test_random_run_writes_json_and_plots(base_url, model_path, tmp_path, capsys):
    argv = bench_argv(
        base_url,
        model_path,
        tmp_path,
        "--request-rate",
        "20",
        "--max-concurrency",
        "4",
        "--num-warmups",
        "2",
        "--metric-percentiles",
        "50,90,99",
    )
    assert cli.main(argv) == 0
    report = json.loads((tmp_path / "run.json").read_text())
    assert_all_completed(report, NUM_PROMPTS, OUTPUT_LEN)  # the warm-ups are not counted
    # Token-id prompts: the server counts (vLLM's input_lens) are the dataset's exact lengths.
    assert report["input_lens"] == [INPUT_LEN] * NUM_PROMPTS
    assert 1 <= report["max_concurrent_requests"] <= 4
    assert report["request_throughput"] == pytest.approx(NUM_PROMPTS / report["duration"])
    for name in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "p50", "p90", "p99"):
            assert report[f"{stat}_{name}_ms"] > 0
        assert report[f"p50_{name}_ms"] <= report[f"p99_{name}_ms"]
    assert report["request_goodput"] is None and report["request_rate"] == 20
    for name in ("run-latency-cdf.png", "run-throughput.png"):
        assert (tmp_path / name).read_bytes().startswith(PNG_SIGNATURE)
    printed = capsys.readouterr().out
    assert "Serving Benchmark Result" in printed and "Median TTFT (ms):" in printed
    assert str(tmp_path / "run.json") in printed and str(tmp_path / "run-throughput.png") in printed


def test_bursty_prefix_repetition_run(base_url, model_path, tmp_path):
    argv = bench_argv(
        base_url,
        model_path,
        tmp_path,
        "--dataset-name",
        "prefix_repetition",
        "--prefix-repetition-prefix-len",
        "48",
        "--prefix-repetition-suffix-len",
        "8",
        "--prefix-repetition-num-prefixes",
        "2",
        "--prefix-repetition-output-len",
        "4",
        "--request-rate",
        "40",
        "--burstiness",
        "0.5",
        "--seed",
        "3",
        "--ignore-eos",  # off by default for this dataset, as in vLLM
    )
    assert cli.main(argv) == 0
    report = json.loads((tmp_path / "run.json").read_text())
    assert_all_completed(report, NUM_PROMPTS, 4)
    assert report["input_lens"] == [56] * NUM_PROMPTS
    assert report["burstiness"] == 0.5
    # Requests go out at their arrival times, so the last starts well after the first.
    assert max(report["start_times"]) - min(report["start_times"]) > 0.05


def test_arrival_offsets_follow_the_gamma_process():
    rate = 10.0
    for burstiness in (0.5, 1.0, 4.0):
        offsets = serve.arrival_offsets(4000, rate, burstiness, random.Random(0))
        intervals = [later - earlier for earlier, later in zip(offsets, offsets[1:])]
        assert offsets[0] == 0.0 and min(intervals) >= 0
        assert statistics.fmean(intervals) == pytest.approx(1 / rate, rel=0.1)
        # A gamma interval's squared coefficient of variation is 1 / shape.
        cv2 = statistics.pvariance(intervals) / statistics.fmean(intervals) ** 2
        assert cv2 == pytest.approx(1 / burstiness, rel=0.15)
    assert serve.arrival_offsets(3, math.inf, 1.0, random.Random(0)) == [0.0, 0.0, 0.0]


def test_wrong_model_fails_every_request_without_raising(base_url, model_path, tmp_path):
    argv = bench_argv(base_url, model_path, tmp_path, "--max-concurrency", "4")
    argv[argv.index(MODEL)] = "no-such-model"
    assert cli.main(argv) == 1
    report = json.loads((tmp_path / "run.json").read_text())
    assert (report["completed"], report["failed"]) == (0, NUM_PROMPTS)
    assert (
        len(report["first_errors"]) == 1
        and report["first_errors"][0].startswith("HTTP 404")
        and "no-such-model" in report["first_errors"][0]
    )
    assert report["errors"] == report["first_errors"] * NUM_PROMPTS
    assert report["total_output_tokens"] == 0 and report["mean_ttft_ms"] == 0.0
    assert (tmp_path / "run-latency-cdf.png").stat().st_size > 0


def test_unreachable_server_is_a_failed_run(model_path, tmp_path):
    args = bench_args("http://127.0.0.1:9", model_path, "--num-prompts", "3", "--request-timeout", "5")
    report = serve.benchmark(args)
    assert (report["completed"], report["failed"]) == (0, 3)
    assert report["first_errors"][0].startswith("ConnectError")


def test_goodput_under_slos(base_url, model_path):
    impossible = serve.benchmark(
        bench_args(base_url, model_path, "--num-prompts", "6", "--max-concurrency", "3", "--goodput", "ttft:0.001")
    )
    assert impossible["completed"] == 6
    assert (impossible["request_goodput"], impossible["goodput_fraction"]) == (0.0, 0.0)
    generous = serve.benchmark(
        bench_args(
            base_url,
            model_path,
            "--num-prompts",
            "6",
            "--max-concurrency",
            "3",
            "--goodput",
            "ttft:600000",
            "tpot:600000",
            "e2el:600000",
        )
    )
    assert generous["request_goodput"] == generous["request_throughput"] and generous["goodput_fraction"] == 1.0
    assert generous["goodput_config"] == {"ttft": 600000.0, "tpot": 600000.0, "e2el": 600000.0}


def test_the_tokenizer_comes_from_the_served_models_card_without_tokenizer(base_url, model_path, tmp_path):
    """No ``--tokenizer`` and a model id that is no directory: the card's ``root`` (GET /v1/models) is."""
    assert cli.main(bench_argv(base_url, None, tmp_path, "--num-prompts", "4", "--max-concurrency", "4")) == 0
    report = json.loads((tmp_path / "run.json").read_text())
    assert report["tokenizer_id"] == model_path and report["model_id"] == MODEL
    assert_all_completed(report, 4, OUTPUT_LEN)


def test_no_tokenizer_to_find_is_a_settings_error(base_url, tmp_path, capsys):
    argv = bench_argv(base_url, None, tmp_path)
    argv[argv.index(MODEL)] = "no-such-model"
    assert cli.main(argv) == 2
    error = capsys.readouterr().err
    assert "no card with a root for 'no-such-model'" in error and MODEL in error and "--tokenizer" in error
    with pytest.raises(ValueError, match="could not be read"):
        serve.resolve_model(bench_args("http://127.0.0.1:9", None, "--request-timeout", "5"))
