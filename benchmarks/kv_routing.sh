#!/usr/bin/env bash
# Serve's default router against KVAwareRouter (deployments/routing.py) on two tiny-llama replicas
# (configs/serve/kv_routing.yaml), both driven by vLLM's own `bench serve` client in one run:
#
#   benchmarks/kv_routing.sh [RESULT_DIR]      (default results/kv-routing)
#
#   shared: vLLM's prefix_repetition dataset, NUM_PREFIXES prefixes of PREFIX_LEN tokens + 64-token suffixes
#           -> 32 tokens, NUM_PROMPTS requests, max concurrency 16. Each replica's KV pool holds
#           POOL_BLOCKS blocks of 16 tokens: about half of the prefixes' working set, so a replica that
#           sees every prefix evicts, and one that sees half of them keeps them.
#   unique: random 1,024-token prompts -> 32 (no shared prefixes): the router must cost nothing here.
# Each router runs on its own Ray head (ports below, not the defaults other sessions use); the same
# client seed gives both the same requests. Prints one line per run, with the replicas' prefix-cache
# hit rate (their serval_prefix_cache_* totals, read through LLMServer.stats) and the load average.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-results/kv-routing}
NUM_PREFIXES=${NUM_PREFIXES:-12} PREFIX_LEN=${PREFIX_LEN:-1536} NUM_PROMPTS=${NUM_PROMPTS:-240}
POOL_BLOCKS=${POOL_BLOCKS:-700}
GCS=${GCS_PORT:-6421} DASH=${DASHBOARD_PORT:-8321} HTTP=${HTTP_PORT:-8121} METRICS=${METRICS_PORT:-8181}
export RAY_AUTH_MODE=token RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
mkdir -p "$OUT"

config() {  # config ROUTER(default|kv) -> a YAML path: kv_routing.yaml, its router removed for "default"
  .venv/bin/python - "$1" "$POOL_BLOCKS" "$OUT/$1.yaml" <<'EOF'
import sys, yaml
router, blocks, path = sys.argv[1], int(sys.argv[2]), sys.argv[3]
config = yaml.safe_load(open("configs/serve/kv_routing.yaml"))
llm = config["applications"][0]["args"]["llm_configs"][0]
llm["engine_kwargs"]["num_gpu_blocks_override"] = blocks
if router == "default":
    del llm["deployment_config"]["request_router_config"]
yaml.safe_dump(config, open(path, "w"))
print(path)
EOF
}

hit_rate() {  # the replicas' prefix-cache hits / queries since their start, over both
  .venv/bin/python - "$DASH" "$GCS" <<'EOF'
import sys
import ray
from ray import serve
ray.init(address=f"127.0.0.1:{sys.argv[2]}", logging_level="error", log_to_driver=False)
handle = serve.get_deployment_handle("LLMServer:tiny-llama", app_name="llm")
stats = {}
for _ in range(40):
    s = handle.stats.remote().result()
    stats[s["replica_id"]] = s
hits, queries = sum(s["prefix_cache_hits"] for s in stats.values()), sum(s["prefix_cache_queries"] for s in stats.values())
print(f"{hits / max(queries, 1):.3f} ({len(stats)} replicas)")
EOF
}

bench() {  # bench NAME [bench serve flags]
  local name=$1
  shift
  ../shared/peers/vllm_bench_serve.sh --base-url "http://127.0.0.1:$HTTP" --model tiny-llama \
    --tokenizer "$PWD/models/tiny-llama" --max-concurrency 16 --request-rate inf --ignore-eos --seed 0 \
    --save-result --result-dir "$OUT" --result-filename "$name.json" "$@" > "$OUT/$name.log" 2>&1
}

report() {  # report NAME HIT_RATE
  .venv/bin/python - "$OUT/$1.json" "$1" "$2" "$(cut -d' ' -f1-3 /proc/loadavg)" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
print(f"{sys.argv[2]:<16} {r['output_throughput']:7.0f} output tok/s, median TTFT {r['median_ttft_ms']:7.1f} ms, "
      f"p90 TTFT {r['p90_ttft_ms']:7.1f} ms, "
      f"prefix hit rate {sys.argv[3]}, load average {sys.argv[4]}", flush=True)
EOF
}

for router in default kv; do
  yaml=$(config "$router")
  launcher() { if [ "$1" = up ]; then .venv/bin/python -m serval serve --detach --config "$yaml" --gcs-port "$GCS" \
    --dashboard-port "$DASH" --port "$HTTP" --metrics-export-port "$METRICS" --num-cpus 2;
    else .venv/bin/python -m serval stop --dashboard-port "$DASH"; fi; }
  launcher up > "$OUT/$router-serve.log" 2>&1 || { tail -20 "$OUT/$router-serve.log"; exit 1; }
  trap 'launcher down >/dev/null 2>&1 || true' EXIT
  bench "$router-shared" --dataset-name prefix_repetition --num-prompts "$NUM_PROMPTS" \
    --prefix-repetition-prefix-len "$PREFIX_LEN" --prefix-repetition-suffix-len 64 \
    --prefix-repetition-num-prefixes "$NUM_PREFIXES" --prefix-repetition-output-len 32 --percentile-metrics ttft,tpot \
    --metric-percentiles 50,90
  report "$router-shared" "$(hit_rate)"
  bench "$router-unique" --dataset-name random --random-input-len 1024 --random-output-len 32 --num-prompts 120 \
    --percentile-metrics ttft,tpot --metric-percentiles 50,90
  report "$router-unique" "-"
  launcher down > /dev/null 2>&1
  trap - EXIT
done
