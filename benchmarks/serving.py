"""Online serving latency: Serval through Ray Serve vs the in-process AsyncLLM vs the peer's OpenAI server.

The same closed-loop load runs against each target: N streamed completions of IN random token ids and
OUT generated tokens (greedy, EOS ignored), at most C in flight. Per request it records the time to the
first token (TTFT) and the mean time per output token after it (TPOT). Each target runs in its own
subprocess; the result is a table of p50/p99 TTFT and TPOT, a JSON record and a latency-CDF plot under
results/.

    python benchmarks/serving.py --model models/tiny-llama                 # inproc, serve, vllm
    python benchmarks/serving.py --model models/tiny-llama --targets inproc serve --concurrency 8 32

Targets: ``inproc`` drives ``AsyncLLM.generate`` directly (no HTTP); ``serve`` deploys the model with
``deployments.app:build_openai_app`` on a fresh local Ray head (loopback) and streams through the ingress;
``vllm`` starts ``../shared/peers/vllm_cpu_server.sh`` (its own venv under /tmp) and streams through its
OpenAI server. HTTP targets are driven by the same httpx client code.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # before Ray is imported: keep 127.0.0.1 loopback
ROOT = Path(__file__).resolve().parent.parent
PEERS = ROOT.parent / "shared" / "peers"
sys.path.insert(0, str(ROOT))


@dataclass
class RequestResult:
    ttft_s: float
    tpot_s: float
    num_tokens: int


def make_prompts(num_prompts: int, input_len: int, vocab_size: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(10, vocab_size - 10) for _ in range(input_len)] for _ in range(num_prompts)]


def result_of(start: float, first_token_time: float, last_token_time: float, num_tokens: int) -> RequestResult:
    tpot = (last_token_time - first_token_time) / max(num_tokens - 1, 1)
    return RequestResult(first_token_time - start, tpot, num_tokens)


async def closed_loop(one_request, prompts: list[list[int]], concurrency: int) -> tuple[list[RequestResult], float]:
    """Runs ``one_request(prompt)`` for every prompt, at most ``concurrency`` at once, printing progress."""
    semaphore = asyncio.Semaphore(concurrency)
    results: list[RequestResult] = []
    start = time.perf_counter()

    async def run(prompt):
        async with semaphore:
            results.append(await one_request(prompt))
            if len(results) % max(len(prompts) // 10, 1) == 0:
                print(f"    {len(results)}/{len(prompts)} requests, {time.perf_counter() - start:.1f} s", flush=True)

    await asyncio.gather(*(run(p) for p in prompts))
    return results, time.perf_counter() - start


async def load_inproc(args, prompts) -> tuple[list[RequestResult], float]:
    from engine import AsyncLLM, EngineArgs, SamplingParams
    from engine.sampling_params import RequestOutputKind

    engine = AsyncLLM.from_engine_args(EngineArgs(model=args.model, **engine_kwargs(args)))
    params = SamplingParams(
        temperature=0.0, max_tokens=args.output_len, ignore_eos=True, output_kind=RequestOutputKind.DELTA
    )
    counter = iter(range(1 << 30))

    async def one(prompt):
        start, arrivals, num_tokens = time.perf_counter(), [], 0
        async for output in engine.generate({"prompt_token_ids": prompt}, params, f"bench-{next(counter)}"):
            arrivals.append(time.perf_counter())
            num_tokens += len(output.outputs[0].token_ids)
        return result_of(start, arrivals[0], arrivals[-1], num_tokens)

    try:
        await closed_loop(one, prompts[: args.concurrency], args.concurrency)  # warm-up
        return await closed_loop(one, prompts, args.concurrency)
    finally:
        engine.shutdown()


async def load_http(base_url: str, model: str, args, prompts) -> tuple[list[RequestResult], float]:
    import httpx

    async def one(prompt):
        body = {
            "model": model,
            "prompt": prompt,
            "max_tokens": args.output_len,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        start, arrivals, num_tokens = time.perf_counter(), [], 0
        async with client.stream("POST", f"{base_url}/v1/completions", json=body) as response:
            response.raise_for_status()
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    if chunk["choices"]:  # a chunk of tokens (its text may be empty: half a character)
                        arrivals.append(time.perf_counter())
                    if chunk.get("usage"):
                        num_tokens = chunk["usage"]["completion_tokens"]
        return result_of(start, arrivals[0], arrivals[-1], num_tokens)

    limits = httpx.Limits(max_connections=args.concurrency + 8, max_keepalive_connections=args.concurrency + 8)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        await closed_loop(one, prompts[: args.concurrency], args.concurrency)  # warm-up
        return await closed_loop(one, prompts, args.concurrency)


def engine_kwargs(args) -> dict:
    return {"max_model_len": 4096, "max_num_seqs": 256, **json.loads(args.engine_kwargs)}


def wait_http_ok(url: str, timeout_s: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} not up after {timeout_s:.0f} s")
        time.sleep(1)


def run_serve(args, prompts, separate_ingress: bool) -> tuple[list[RequestResult], float]:
    """``separate_ingress``: through an OpenAiIngress deployment, else straight to the LLM replica."""
    from serval.launcher import lifecycle as launcher

    gcs_port, dashboard_port, http_port = launcher.free_port(), launcher.free_port(), launcher.free_port()
    launcher.start_ray_head(gcs_port, dashboard_port, num_cpus=None, object_store_bytes=256 << 20)
    try:
        config = {
            "proxy_location": "HeadOnly",
            "http_options": {"host": "127.0.0.1", "port": http_port},
            "applications": [
                {
                    "name": "llm",
                    "route_prefix": "/",
                    "import_path": "deployments.app:build_openai_app",
                    "args": {
                        "llm_configs": [
                            {
                                "model_loading_config": {
                                    "model_id": "bench",
                                    "model_source": os.path.abspath(args.model),
                                },
                                "engine_kwargs": engine_kwargs(args),
                                "deployment_config": {
                                    "num_replicas": 1,
                                    "max_ongoing_requests": 512,
                                    "ray_actor_options": {"num_cpus": args.replica_num_cpus},
                                },
                            }
                        ],
                        "separate_ingress": separate_ingress,
                    },
                }
            ],
        }
        launcher.deploy(config, launcher.dashboard_url(dashboard_port))
        launcher.wait_until_running(launcher.dashboard_url(dashboard_port), ["llm"], timeout_s=600)
        return asyncio.run(load_http(f"http://127.0.0.1:{http_port}", "bench", args, prompts))
    finally:
        launcher.stop_cluster(dashboard_port)


def run_vllm(args, prompts) -> tuple[list[RequestResult], float]:
    port = 8100 + random.Random().randrange(500)
    model = os.path.abspath(args.model)
    server = subprocess.Popen(
        [str(PEERS / "vllm_cpu_server.sh"), model, str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        wait_http_ok(f"http://127.0.0.1:{port}/health", timeout_s=600)
        return asyncio.run(load_http(f"http://127.0.0.1:{port}", model, args, prompts))
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=60)


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def summarize(results: list[RequestResult]) -> dict:
    ttfts = [r.ttft_s * 1e3 for r in results]
    tpots = [r.tpot_s * 1e3 for r in results]
    return {
        "p50_ttft_ms": percentile(ttfts, 50),
        "p99_ttft_ms": percentile(ttfts, 99),
        "p50_tpot_ms": percentile(tpots, 50),
        "p99_tpot_ms": percentile(tpots, 99),
        "num_requests": len(results),
        "ttft_ms": ttfts,
        "tpot_ms": tpots,
    }


def run_target(target: str, args) -> dict:
    """In this process: one target at one concurrency, summarized."""
    from transformers import AutoTokenizer

    vocab_size = AutoTokenizer.from_pretrained(args.model).vocab_size
    prompts = make_prompts(args.num_requests, args.input_len, vocab_size)
    if target == "inproc":
        results, elapsed = asyncio.run(load_inproc(args, prompts))
    elif target in ("serve", "serve-ingress"):
        results, elapsed = run_serve(args, prompts, separate_ingress=target == "serve-ingress")
    else:
        results, elapsed = run_vllm(args, prompts)
    assert all(r.num_tokens == args.output_len for r in results), "a stream came back short"
    summary = summarize(results)
    summary["output_tok_per_s"] = sum(r.num_tokens for r in results) / elapsed
    return summary


def plot(records: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib not installed: no plot; pip install matplotlib)")
        return False
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for label, summary in records.items():
        for ax, key in zip(axes, ("ttft_ms", "tpot_ms")):
            values = sorted(summary[key])
            ax.plot(values, [(i + 1) / len(values) for i in range(len(values))], label=label)
    axes[0].set_xscale("log")  # TTFTs span orders of magnitude across targets and loads
    for ax, title in zip(axes, ("time to first token (ms, log scale)", "time per output token (ms)")):
        ax.set_xlabel(title)
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="models/tiny-llama")
    parser.add_argument(
        "--targets",
        nargs="+",
        default=["inproc", "serve", "vllm"],
        choices=["inproc", "serve", "serve-ingress", "vllm"],
    )
    parser.add_argument("--replica-num-cpus", type=float, default=1.0, help="serve: the LLM replica's num_cpus.")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[16])
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--engine-kwargs", default="{}", help="JSON of extra EngineArgs for inproc and serve.")
    parser.add_argument("--plot-from", metavar="JSON", help="Only redraw the plot of an earlier results/*.json.")
    parser.add_argument("--run-one", nargs=2, metavar=("TARGET", "CONCURRENCY"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.plot_from:
        records = json.loads(Path(args.plot_from).read_text())["results"]
        plot(records, Path(args.plot_from).with_suffix(".png"))
        return
    if args.run_one:
        args.concurrency = int(args.run_one[1])
        print("RESULT " + json.dumps(run_target(args.run_one[0], args)), flush=True)
        return

    records = {}
    for concurrency in args.concurrency:
        for target in args.targets:
            print(f"== {target}, concurrency {concurrency}", flush=True)
            command = [
                sys.executable,
                __file__,
                "--model",
                args.model,
                "--num-requests",
                str(args.num_requests),
                "--input-len",
                str(args.input_len),
                "--output-len",
                str(args.output_len),
                "--engine-kwargs",
                args.engine_kwargs,
                "--replica-num-cpus",
                str(args.replica_num_cpus),
                "--run-one",
                target,
                str(concurrency),
            ]
            output = subprocess.run(command, check=True, stdout=subprocess.PIPE, text=True).stdout
            print("".join(line + "\n" for line in output.splitlines() if not line.startswith("RESULT ")), end="")
            records[f"{target} c={concurrency}"] = json.loads(output.split("RESULT ", 1)[1])
    print(f"\n{'target':<20} {'p50 TTFT':>10} {'p99 TTFT':>10} {'p50 TPOT':>10} {'p99 TPOT':>10} {'tok/s':>8}")
    for label, s in records.items():
        print(
            f"{label:<20} {s['p50_ttft_ms']:>8.1f}ms {s['p99_ttft_ms']:>8.1f}ms {s['p50_tpot_ms']:>8.2f}ms "
            f"{s['p99_tpot_ms']:>8.2f}ms {s['output_tok_per_s']:>8.0f}"
        )
    out_dir = ROOT / "results"
    out_dir.mkdir(exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    record = {
        "args": vars(args),
        "machine": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "results": records,
    }
    (out_dir / f"serving-{stamp}.json").write_text(json.dumps(record, indent=1))
    if plot(records, out_dir / f"serving-{stamp}.png"):
        print(f"plot: results/serving-{stamp}.png")


if __name__ == "__main__":
    main()
