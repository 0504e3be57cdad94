"""The device check's speed phases (hardware, kernels, checkpoint, decode, prefill) and the helpers every
phase shares; each phase runs in its own process and returns a JSON-able record.

Every phase reads its sizes from :mod:`benchmarks.gpu_check.settings` (full or smoke) and the work
directory (the checkpoint, the parity records); ``report`` judges the records. The registry of
phases is in ``__main__``; the parity phases are in :mod:`benchmarks.gpu_check.parity`, the
quantized kernels' in :mod:`benchmarks.gpu_check.quant`.
"""

from __future__ import annotations

import json
import os
import random
import time
from pathlib import Path

from benchmarks.gpu_check.settings import Settings

REPO_ROOT = Path(__file__).resolve().parents[2]
KERNEL_TEST_FILES = (
    "tests/engine/kernels/test_triton_kernels.py",
    "tests/engine/kernels/test_triton_quant.py",
    "tests/engine/worker/test_cuda_graphs.py",
)
FIRST_ORDINARY_TOKEN = 5  # ids 0..4 are the checkpoint tokenizer's special tokens
BLOCK_SIZE = 16
KV_CACHE_SLACK = 1.25  # the KV pool holds this much more than the longest batch needs


def checkpoint_dir(work: Path, settings: Settings) -> Path:
    return work / settings.checkpoint_dirname


def log(message: str) -> None:
    print(f"gpu_check: {message}", flush=True)


def write_record(work: Path, phase: str, record: dict) -> None:
    """``work/phases/PHASE.json``: the phase's record (also partial ones, should a timeout cut the phase short)."""
    (work / "phases").mkdir(parents=True, exist_ok=True)
    (work / "phases" / f"{phase}.json").write_text(json.dumps(record, indent=1) + "\n")


# ---------------------------------------------------------------------------- hardware


def run_hardware(settings: Settings, work: Path, deadline: float) -> dict:
    """The ceilings: copy bandwidth (bytes read + written / s) and bf16 matmul FLOP/s."""
    import torch

    from benchmarks.gpu_check import device as dev

    record = {"device_info": dev.describe(settings.device)}
    log(f"device: {record['device_info'].get('name')}")
    record.update(dev.copy_bandwidth(settings.device, settings.copy_bytes, settings.bench_warmup, settings.bench_reps))
    log(f"copy: {record['copy_bytes_per_s'] / 1e12:.3f} TB/s (read + write, {settings.copy_bytes >> 20} MiB)")
    if dev.is_cuda(settings.device):
        torch.cuda.empty_cache()
    record.update(dev.matmul_throughput(settings.device, settings.matmul_n, settings.bench_warmup, settings.bench_reps))
    log(f"matmul: {record['matmul_flops_per_s'] / 1e12:.2f} TFLOP/s (bf16, n={settings.matmul_n})")
    return record


# ----------------------------------------------------------------------------- kernels


class _OutcomeCounter:
    """A pytest plugin that counts test outcomes and keeps the ids of the failures."""

    def __init__(self) -> None:
        self.counts = {"passed": 0, "failed": 0, "skipped": 0, "errors": 0}
        self.failures: list[str] = []

    def pytest_runtest_logreport(self, report) -> None:
        if report.when == "call" or report.outcome != "passed":
            key = "errors" if report.when != "call" and report.outcome == "failed" else report.outcome
            self.counts[key] += 1
            if report.outcome == "failed":
                self.failures.append(report.nodeid)

    def pytest_collectreport(self, report) -> None:
        if report.outcome == "failed":
            self.counts["errors"] += 1
            self.failures.append(f"collecting {report.nodeid}")


def run_kernels(settings: Settings, work: Path, deadline: float) -> dict:
    """The Triton kernel tests and the CUDA graph tests, natively on the GPU (interpreted on a CPU).

    Their tolerance is the kernels' target: 1e-2 relative error against the torch references in bf16.
    """
    import pytest

    files = [f for f in KERNEL_TEST_FILES if (REPO_ROOT / f).is_file()]
    counter = _OutcomeCounter()
    os.chdir(REPO_ROOT)
    exit_code = int(pytest.main(["-q", "-p", "no:cacheprovider", *files], plugins=[counter]))
    log(f"pytest exit code {exit_code}: {counter.counts}")
    return {
        "files": files,
        "exit_code": exit_code,
        **counter.counts,
        "failures": counter.failures[:20],
        "all_passed": exit_code == 0 and counter.counts["passed"] > 0,
    }


# -------------------------------------------------------------------------- checkpoint


def run_checkpoint(settings: Settings, work: Path, deadline: float) -> dict:
    """Makes the random checkpoint (``python -m serval.tools.make_model``'s code); skipped when up to date."""
    from serval.tools.make_model import make_model

    path = checkpoint_dir(work, settings)
    spec_file = path / "serval_model_spec.json"  # written last; left alone when the checkpoint is up to date
    spec_mtime = spec_file.stat().st_mtime_ns if spec_file.is_file() else None
    begin = time.perf_counter()
    make_model(
        path,
        arch=settings.arch,
        size=settings.size,
        seed=settings.seed,
        dtype=settings.checkpoint_dtype,
        max_shard_size=settings.max_shard_size_bytes,
        threads=settings.threads,
    )
    seconds = time.perf_counter() - begin
    spec = json.loads(spec_file.read_text())
    reused = spec_file.stat().st_mtime_ns == spec_mtime
    weight_bytes = sum(p.stat().st_size for p in path.glob("*.safetensors"))
    log(
        f"checkpoint: {spec['num_parameters'] / 1e6:.1f}M parameters, {weight_bytes / 1e6:.1f} MB "
        f"in {seconds:.1f} s ({settings.threads} threads) -> {path}"
    )
    return {
        "path": str(path),
        "num_parameters": spec["num_parameters"],
        "weight_bytes": weight_bytes,
        "make_s": seconds,
        "threads": settings.threads,
        "reused": reused,
        "spec": spec,
    }


# ------------------------------------------------------------------------- engine use


def model_facts(settings: Settings, work: Path) -> dict:
    from benchmarks.gpu_check.rooflines import ModelFacts

    return ModelFacts.from_checkpoint(checkpoint_dir(work, settings)).as_dict()


def random_prompts(seed: int, lengths, vocab_size: int) -> list[list[int]]:
    """Random token ids (no special tokens), one list per length."""
    rng = random.Random(seed)
    return [[rng.randrange(FIRST_ORDINARY_TOKEN, vocab_size) for _ in range(n)] for n in lengths]


def make_llm(settings: Settings, work: Path, dtype: str, max_num_seqs: int, max_model_len: int, **engine_kwargs):
    """One engine on the checkpoint: prefix caching off, a KV pool sized for ``max_num_seqs`` full sequences."""
    from benchmarks.gpu_check.rooflines import ModelFacts
    from engine.llm import LLM

    facts = ModelFacts(**model_facts(settings, work))
    kv_cache_bytes = int(KV_CACHE_SLACK * max_num_seqs * (max_model_len + BLOCK_SIZE) * facts.kv_bytes_per_token(dtype))
    kwargs = dict(
        dtype=dtype,
        device=settings.device,
        attention_backend=settings.attention_backend,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        block_size=BLOCK_SIZE,
        enable_prefix_caching=False,
        kv_cache_memory_bytes=kv_cache_bytes,
        seed=settings.seed,
    )
    kwargs.update(engine_kwargs)
    log(f"LLM({', '.join(f'{k}={v}' for k, v in kwargs.items())})")
    begin = time.perf_counter()
    llm = LLM(str(checkpoint_dir(work, settings)), **kwargs)
    log(f"engine ready in {time.perf_counter() - begin:.1f} s")
    return llm, {"engine_kwargs": kwargs, "engine_init_s": time.perf_counter() - begin}


def timed_generate(llm, prompts: list[list[int]], max_tokens: int, **params) -> tuple[float, list]:
    """Seconds of one ``llm.generate`` of the prompts (greedy, EOS ignored) and its outputs."""
    from engine.sampling_params import SamplingParams

    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **params)
    requests = [{"prompt_token_ids": ids} for ids in prompts]
    begin = time.perf_counter()
    outputs = llm.generate(requests, sampling, use_tqdm=False)
    seconds = time.perf_counter() - begin
    lengths = {len(o.outputs[0].token_ids) for o in outputs}
    if lengths != {max_tokens}:
        raise RuntimeError(f"asked for {max_tokens} tokens per request, got lengths {sorted(lengths)}")
    return seconds, outputs


# ------------------------------------------------------------------------------ decode


def measure_decode_step(llm, prompts: list[list[int]], output_len: int) -> dict:
    """Seconds per decode step at ``len(prompts)`` sequences.

    step = (time(generate 1 + N tokens) - time(generate 1 token)) / N, after a warm-up generate of
    1 + N tokens (Triton compiles per shape, graphs are captured at start); the 1-token time is the
    better of two.
    """
    timed_generate(llm, prompts, 1 + output_len)  # warm-up
    first_token_s = min(timed_generate(llm, prompts, 1)[0] for _ in range(2))
    total_s = timed_generate(llm, prompts, 1 + output_len)[0]
    step_s = (total_s - first_token_s) / output_len
    return {
        "batch": len(prompts),
        "prompt_len": len(prompts[0]),
        "output_len": output_len,
        "first_token_s": first_token_s,
        "total_s": total_s,
        "step_s": step_s,
        "tokens_per_s": len(prompts) / step_s,
    }


def run_decode(settings: Settings, work: Path, deadline: float, eager: bool) -> dict:
    """Decode tokens/s at each batch size in bf16, one engine for all of them (max_num_seqs = the largest).

    The whole batch is prefilled in one step (max_num_batched_tokens = batch x prompt), so every
    later step is a pure decode step of the whole batch. With graphs, exactly these batch sizes are
    captured. A batch size is skipped when the previous one suggests it would pass the deadline.
    """
    from benchmarks.gpu_check.device import is_cuda

    facts = model_facts(settings, work)
    largest = max(settings.decode_batches)
    max_model_len = settings.decode_prompt_len + settings.decode_output_len + BLOCK_SIZE
    graph_kwargs = {"enforce_eager": eager}
    if not eager and is_cuda(settings.device):
        graph_kwargs["cuda_graph_batch_sizes"] = list(settings.decode_batches)
    llm, record = make_llm(
        settings,
        work,
        settings.speed_dtype,
        max_num_seqs=largest,
        max_model_len=max_model_len,
        max_num_batched_tokens=max(largest * settings.decode_prompt_len, 2048),
        **graph_kwargs,
    )
    record.update(mode="eager" if eager else "graphs", dtype=settings.speed_dtype, facts=facts, batches={}, skipped=[])
    previous_s = 0.0
    for batch in settings.decode_batches:
        # A larger batch takes at least as long as the previous one did; a 2x margin for its prefill.
        if previous_s and time.time() + 2 * previous_s > deadline:
            log(f"decode batch {batch}: skipped, too close to the phase's deadline")
            record["skipped"].append(batch)
            continue
        begin = time.time()
        prompts = random_prompts(settings.seed + batch, [settings.decode_prompt_len] * batch, facts["vocab"])
        result = measure_decode_step(llm, prompts, settings.decode_output_len)
        previous_s = time.time() - begin
        record["batches"][str(batch)] = result
        write_record(work, f"decode_{record['mode']}", {**record, "partial": True})
        log(
            f"decode {record['mode']} batch {batch}: {result['step_s'] * 1e3:.2f} ms/step, "
            f"{result['tokens_per_s']:.1f} tokens/s ({previous_s:.1f} s)"
        )
    llm.shutdown()
    return record


# ----------------------------------------------------------------------------- prefill


def run_prefill(settings: Settings, work: Path, deadline: float) -> dict:
    """Prefill tokens/s in bf16: many long prompts, one output token each, a large token budget.

    Eager (CUDA graphs only ever replay decode-only steps). Timed after a warm-up on a quarter of
    the prompts.
    """
    facts = model_facts(settings, work)
    num, length = settings.prefill_num_prompts, settings.prefill_prompt_len
    llm, record = make_llm(
        settings,
        work,
        settings.speed_dtype,
        max_num_seqs=num,
        max_model_len=length + BLOCK_SIZE,
        max_num_batched_tokens=settings.prefill_max_num_batched_tokens,
        enforce_eager=True,
    )
    prompts = random_prompts(settings.seed, [length] * num, facts["vocab"])
    timed_generate(llm, prompts[: max(1, num // 4)], 1)  # warm-up
    seconds = timed_generate(llm, prompts, 1)[0]
    llm.shutdown()
    record.update(
        dtype=settings.speed_dtype,
        facts=facts,
        num_prompts=num,
        prompt_len=length,
        max_num_batched_tokens=settings.prefill_max_num_batched_tokens,
        prefill_s=seconds,
        tokens_per_s=num * length / seconds,
    )
    log(f"prefill: {num} x {length} tokens in {seconds:.3f} s = {record['tokens_per_s']:.0f} tokens/s")
    return record
