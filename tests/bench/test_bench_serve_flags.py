"""``serval bench serve`` speaks ``vllm bench serve``'s flags (vLLM 0.32's names and defaults) and writes
its result keys, against the live in-process OpenAI server of ``tests/bench/conftest.py``; Serval's old
spellings still run, each with a one-line deprecation note."""

from __future__ import annotations

import argparse
import json
import math
import re
from urllib.parse import urlsplit

import pytest

from serval import cli
from serval.bench import serve, serve_args
from serval.bench.datasets import SampleRequest
from serval.bench.report import PER_REQUEST_KEYS
from serval.bench.request_funcs import Backend
from tests.bench.conftest import MODEL

pytestmark = pytest.mark.usefixtures("engine_left_idle")

OUTPUT_LEN = 6
# The summary keys of vLLM's result JSON (vllm/benchmarks/serve.py: main_async and benchmark) for the
# default --percentile-metrics and --metric-percentiles 99.
VLLM_KEYS = {
    "date",
    "endpoint_type",
    "backend",
    "label",
    "model_id",
    "tokenizer_id",
    "num_prompts",
    "request_rate",
    "burstiness",
    "max_concurrency",
    "duration",
    "completed",
    "failed",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "request_goodput",
    "output_throughput",
    "total_token_throughput",
    "max_concurrent_requests",
    *(f"{stat}_{name}_ms" for stat in ("mean", "median", "std", "p99") for name in ("ttft", "tpot", "itl", "e2el")),
}


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    return parser.parse_args(list(argv))


def load_flags(*extra: str) -> list[str]:
    return ["--num-prompts", "6", "--random-input-len", "24", "--random-output-len", str(OUTPUT_LEN), *extra]


def test_vllm_command_lines_parse_to_vllms_meaning():
    args = parse(
        *("--backend", "openai-chat", "--host", "10.0.0.7", "--port", "9001", "--endpoint", "/v1/chat/completions"),
        *("--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", "64"),
        *("--goodput", "ttft:500", "tpot:50", "--percentile-metrics", "ttft,tpot", "--metric-percentiles", "25,50,99"),
        *("--save-result", "--result-dir", "out", "--result-filename", "r.json", "--metadata", "tp=1", "run=a"),
        *("--request-rate", "8", "--burstiness", "0.5", "--max-concurrency", "16", "--temperature", "0"),
        *("--header", "x-trace=1", "--label", "mine", "--output-len", "32"),
    )
    assert args.backend is Backend.OPENAI_CHAT and args.dataset_name == "prefix_repetition"
    assert serve_args.api_url(args) == "http://10.0.0.7:9001/v1/chat/completions"
    assert args.goodput == [("ttft", 500.0), ("tpot", 50.0)]
    assert (args.percentile_metrics, args.metric_percentiles) == (["ttft", "tpot"], [25.0, 50.0, 99.0])
    assert args.save_result and (args.result_dir, args.result_filename) == ("out", "r.json")
    assert serve_args.parse_key_values(args.metadata, "--metadata") == {"tp": "1", "run": "a"}
    assert serve_args.sampling_fields(args) == {"temperature": 0.0}
    assert serve_args.request_headers(args)["x-trace"] == "1"
    serve_args.apply_general_lengths(args)
    assert args.prefix_repetition_output_len == 32 and args.prefix_repetition_prefix_len == 64
    # vLLM's defaults: no model (read from the server), completions, everything else unset.
    defaults = parse()
    assert defaults.model is None and defaults.backend is Backend.OPENAI and defaults.goodput is None
    assert serve_args.api_url(defaults) == "http://127.0.0.1:8000/v1/completions"
    assert (defaults.metric_percentiles, defaults.num_prompts, defaults.request_rate) == ([99.0], 1000, math.inf)
    assert serve_args.sampling_fields(defaults) == {} and not serve.is_saving(defaults)


def test_ignore_eos_is_off_by_default_except_on_random_as_in_vllm():
    request = SampleRequest([5, 6, 7], 3, 4)
    for argv, expected in [
        (["--dataset-name", "prefix_repetition"], False),
        (["--dataset-name", "sharegpt"], False),
        (["--dataset-name", "random"], True),  # vLLM forces ignore_eos on its random dataset
        (["--dataset-name", "random", "--no-ignore-eos"], False),
        (["--dataset-name", "prefix_repetition", "--ignore-eos"], True),
    ]:
        args = parse("--model", MODEL, *argv)
        payload = serve.make_sender(args).payload(request)
        assert payload.get("ignore_eos", False) is expected, argv
    completions = serve.make_sender(parse("--model", MODEL, "--top-k", "3")).payload(request)
    assert completions["prompt"] == [5, 6, 7] and completions["max_tokens"] == 4 and completions["top_k"] == 3
    assert "temperature" not in completions  # the server's default, as vLLM 0.32 sends it
    chat = serve.make_sender(parse("--model", MODEL, "--backend", "openai-chat")).payload(request)
    assert chat["messages"] == [{"role": "user", "content": [5, 6, 7]}] and chat["max_completion_tokens"] == 4


def test_model_comes_from_v1_models_and_the_json_has_vllms_keys(bench_url, model_path, tmp_path, monkeypatch):
    """No --model, no --tokenizer: the first card of GET /v1/models names both; vLLM's filename and keys."""
    monkeypatch.chdir(tmp_path)
    argv = ["bench", "serve", "--base-url", bench_url, "--max-concurrency", "3", "--disable-tqdm", "--save-result"]
    argv += load_flags("--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", "16")
    argv += ["--prefix-repetition-suffix-len", "8", "--prefix-repetition-output-len", str(OUTPUT_LEN)]
    assert cli.main([*argv, "--metadata", "commit=abc", "engine=serval"]) == 0
    [path] = tmp_path.glob("*.json")
    assert re.fullmatch(rf"openai-infqps-concurrency3-{MODEL}-\d{{8}}-\d{{6}}\.json", path.name)
    record = json.loads(path.read_text())
    assert VLLM_KEYS <= set(record), VLLM_KEYS - set(record)
    assert (record["model_id"], record["tokenizer_id"], record["backend"]) == (MODEL, model_path, "openai")
    assert (record["commit"], record["engine"]) == ("abc", "serval")
    assert (record["completed"], record["failed"], record["request_goodput"]) == (6, 0, None)
    assert record["ignore_eos"] is False and record["request_rate"] == "inf" and record["max_concurrency"] == 3
    assert record["total_input_tokens"] == 6 * 24
    assert not set(PER_REQUEST_KEYS) & set(record)  # the per-request lists need --save-detailed, as in vLLM
    assert (tmp_path / f"{path.stem}-latency-cdf.png").stat().st_size > 0


def test_chat_backend_streams_chat_completions(bench_url, model_path, tmp_path):
    host_port = urlsplit(bench_url)
    argv = ["bench", "serve", "--backend", "openai-chat", "--host", host_port.hostname, "--port", str(host_port.port)]
    argv += ["--result-dir", str(tmp_path), "--result-filename", "chat.json", "--save-detailed", "--disable-tqdm"]
    argv += load_flags("--max-concurrency", "3", "--ignore-eos", "--goodput", "e2el:600000")
    assert cli.main(argv) == 0
    record = json.loads((tmp_path / "chat.json").read_text())
    assert record["api_url"] == f"{bench_url}/v1/chat/completions" and record["endpoint_type"] == "openai-chat"
    assert (record["completed"], record["failed"]) == (6, 0)
    assert record["output_lens"] == [OUTPUT_LEN] * 6  # the server's usage counts
    # The input is the server's count: the chat template's tokens come on top of the 24 sampled ones.
    assert all(input_len > 24 for input_len in record["input_lens"])
    assert record["total_input_tokens"] == sum(record["input_lens"])
    assert all(0 < ttft <= latency for ttft, latency in zip(record["ttfts"], record["latencies"], strict=True))
    assert record["request_goodput"] == record["request_throughput"] and record["goodput_fraction"] == 1.0


def test_embeddings_backend_times_whole_embedding_requests(bench_url, model_path, tmp_path, capsys):
    """vLLM's ``--backend openai-embeddings``: each prompt (the random dataset's token ids) is one non-streamed
    ``/v1/embeddings`` call; its latency is all there is to time (``--percentile-metrics`` e2el by default)."""
    argv = ["bench", "serve", "--backend", "openai-embeddings", "--base-url", bench_url, "--tokenizer", model_path]
    argv += ["--result-dir", str(tmp_path), "--result-filename", "embed.json", "--save-detailed", "--disable-tqdm"]
    argv += load_flags("--max-concurrency", "3", "--temperature", "0.5")  # sampling flags are not sent
    assert cli.main(argv) == 0
    record = json.loads((tmp_path / "embed.json").read_text())
    assert record["api_url"] == f"{bench_url}/v1/embeddings" and record["endpoint_type"] == "openai-embeddings"
    assert (record["completed"], record["failed"], record["first_errors"]) == (6, 0, [])
    assert record["input_lens"] == [24] * 6 and record["total_input_tokens"] == 6 * 24  # the server's usage
    assert record["output_lens"] == [0] * 6 and record["total_output_tokens"] == 0
    assert record["ttfts"] == record["latencies"] and all(latency > 0 for latency in record["latencies"])
    assert record["percentile_metrics"] == ["e2el"] and "mean_ttft_ms" not in record
    assert "End-to-end Latency" in capsys.readouterr().out


def test_goodput_counts_only_requests_within_every_slo(bench_url, model_path):
    def run(*goodput: str) -> dict:
        argv = ["--base-url", bench_url, "--model", MODEL, "--tokenizer", model_path, "--disable-tqdm"]
        return serve.benchmark(parse(*argv, *load_flags("--max-concurrency", "3", "--goodput", *goodput)))

    impossible = run("ttft:0.001", "e2el:600000")
    assert impossible["completed"] == 6 and (impossible["request_goodput"], impossible["goodput_fraction"]) == (0, 0)
    generous = run("ttft:600000", "tpot:600000")
    assert generous["request_goodput"] == generous["request_throughput"] and generous["goodput_fraction"] == 1.0
    assert generous["goodput_config"] == {"ttft": 600000.0, "tpot": 600000.0}
    # A limit between the fastest and the slowest TTFT: exactly the requests under it are good.
    ttfts_ms = sorted(ttft * 1e3 for ttft in generous["ttfts"])
    limit = (ttfts_ms[2] + ttfts_ms[3]) / 2
    split = run(f"ttft:{limit}")
    num_good = sum(ttft * 1e3 <= limit for ttft in split["ttfts"])
    assert split["request_goodput"] == pytest.approx(num_good / split["duration"])


def test_serval_old_spellings_still_run_with_a_deprecation_note(bench_url, model_path, tmp_path, capsys):
    argv = ["bench", "serve", "--url", bench_url, "--model", MODEL, "--slo", "ttft=600000,tpot=600000"]
    argv += ["--percentiles", "50,90", "--dataset-name", "prefix-repetition", "--prefix-repetition-prefix-len", "8"]
    argv += ["--prefix-repetition-suffix-len", "8", "--prefix-repetition-output-len", "4", "--num-prompts", "4"]
    argv += ["--result-dir", str(tmp_path), "--result-filename", "old.json", "--disable-tqdm"]
    assert cli.main(argv) == 0
    notes = capsys.readouterr().err
    for old, new in [("--url", "--base-url"), ("--slo", "--goodput"), ("--percentiles", "--metric-percentiles")]:
        assert f"{old} is deprecated; use {new}" in notes
    assert "prefix-repetition is deprecated; use prefix_repetition" in notes
    record = json.loads((tmp_path / "old.json").read_text())
    assert record["completed"] == 4 and record["goodput_fraction"] == 1.0
    assert record["dataset_name"] == "prefix_repetition" and record["p90_ttft_ms"] >= record["p50_ttft_ms"] > 0


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--backend", "openai-chat", "--endpoint", "/v1/completions"], "ending in 'chat/completions'"),
        (["--dataset-name", "sharegpt"], "needs --dataset-path: a local ShareGPT JSON file"),
        (["--dataset-path", "x.json"], "takes no --dataset-path"),
        (["--metadata", "novalue"], "--metadata takes KEY=VALUE"),
    ],
)
def test_settings_that_cannot_run_exit_2_with_the_reason(model_path, tmp_path, capsys, argv, message):
    base = ["bench", "serve", "--base-url", "http://127.0.0.1:9", "--model", MODEL, "--tokenizer", model_path]
    assert cli.main([*base, "--result-dir", str(tmp_path), *argv]) == 2
    assert message in capsys.readouterr().err and not list(tmp_path.iterdir())


def test_no_model_and_no_server_is_a_settings_error(capsys):
    assert cli.main(["bench", "serve", "--port", "9", "--request-timeout", "5"]) == 2
    assert "http://127.0.0.1:9/v1/models could not be read" in capsys.readouterr().err
