#!/usr/bin/env bash
# The prepared device check: on a machine with a CUDA GPU, run the kernel tests natively, check greedy
# parity of the whole engine against transformers on a random Llama-3-8B-shaped checkpoint made on the
# spot, and measure decode tokens/s (batch 1, 32, 256; CUDA graphs and eager) against the bandwidth
# roofline and prefill tokens/s against the matmul roofline, then check and time quant_linear (GGUF Q8_0/Q4_0/
# Q4_1/Q5_0/Q5_1 weights on SmolLM2-135M's shapes, Q4_K/Q5_K/Q6_K on Llama-3.2-1B's) against torch fp16.
# Prints a short table last.
#
#   bash benchmarks/gpu_check.sh                    # the GPU check (about 8 minutes on an H200)
#   bash benchmarks/gpu_check.sh --smoke            # the same phases on a CPU: tiny model, Triton interpreter
#   bash benchmarks/gpu_check.sh --phases hardware,decode_graphs   # a subset (checkpoint added when needed)
#   bash benchmarks/gpu_check.sh --phases hardware,quant           # the quantized GEMM only (about 2 minutes)
#
# Environment: PYTHON (default python3), OUT (where results.json, table.md and log.txt go; default
# WORK/out), GPU_CHECK_WORK (checkpoint and records; default /tmp/gpu_check, /tmp/gpu_check_smoke with
# --smoke), GPU_CHECK_BUDGET_S (total seconds for the phases; default 480, 420 with --smoke), SMOKE=1
# (same as --smoke).
#
# Each phase is one process (`python -m benchmarks.gpu_check PHASE`, see benchmarks/gpu_check/) under its
# own timeout, clipped to what is left of the budget; a failed phase is recorded and the next one runs.
# Timed phases run alone; untimed ones run in pairs: the kernel tests beside making the checkpoint, and
# the two parity sides (ours and transformers', 32 GB of float32 weights each) at once. When pydantic is
# missing (the GPU machine's image) and .whl/ holds the wheels from benchmarks/gpu_wheels.sh, they are
# installed into /tmp/site first. On the device: run with carry [".whl"], timeout_s about 570.
# Exit code: 0 all phases ran and all targets passed, 1 a phase failed, 2 a target was missed.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; }

SMOKE=${SMOKE:-0}
SELECTED=""
while [ $# -gt 0 ]; do
  case $1 in
    --smoke) SMOKE=1 ;;
    --phases) SELECTED=${2:?--phases needs a comma-separated list}; shift ;;
    --phases=*) SELECTED=${1#--phases=} ;;
    -h|--help) usage; exit 0 ;;
    *) echo "gpu_check: unknown argument $1" >&2; usage >&2; exit 64 ;;
  esac
  shift
done

export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
# Steps in order; the phases of one step (joined by +) run at the same time: none of them is timed
# against the others (the kernel tests beside making the checkpoint; our engine beside transformers).
# quant (the GGUF-weight GEMM) comes last: it runs in what the budget leaves, or alone with --phases quant.
STEPS=(hardware kernels+checkpoint decode_graphs decode_eager prefill parity_ours+parity_hf quant)
MODEL_PHASES=" decode_graphs decode_eager prefill parity_ours parity_hf "

if [ "$SMOKE" = 1 ]; then
  SMOKE_FLAG=--smoke
  WORK=${GPU_CHECK_WORK:-/tmp/gpu_check_smoke}
  BUDGET_S=${GPU_CHECK_BUDGET_S:-420}
  MIN_PHASE_S=5
  # The CPU path: no GPU even where there is one, Triton kernels through Triton's interpreter (read when
  # Triton is first imported, so it is set before any Python starts).
  export CUDA_VISIBLE_DEVICES="" TRITON_INTERPRET=1
else
  SMOKE_FLAG=
  WORK=${GPU_CHECK_WORK:-/tmp/gpu_check}
  BUDGET_S=${GPU_CHECK_BUDGET_S:-480}
  MIN_PHASE_S=20
  if ! command -v nvidia-smi >/dev/null 2>&1; then
    echo "gpu_check: no nvidia-smi here, so no CUDA GPU; use --smoke for the CPU smoke run" >&2
    exit 1
  fi
fi
OUT_DIR=${OUT:-$WORK/out}
mkdir -p "$WORK/phases" "$OUT_DIR"
LOG=$OUT_DIR/log.txt
: >"$LOG"
: >"$WORK/status.tsv"
START_S=$(date +%s)
DEADLINE_S=$((START_S + BUDGET_S))

say() { echo "gpu_check: $*" | tee -a "$LOG"; }

# Seconds one phase may take: its own limit (full run / smoke run).
phase_limit() {
  if [ "$SMOKE" = 1 ]; then
    case $1 in kernels) echo 240 ;; *) echo 150 ;; esac
  else
    case $1 in
      hardware) echo 90 ;;
      kernels|checkpoint|parity_ours|parity_hf) echo 180 ;;
      decode_graphs|decode_eager) echo 150 ;;
      prefill) echo 100 ;;
      quant) echo 150 ;;
      *) echo 120 ;;
    esac
  fi
}

# Triton's nanobind extension reports hundreds of "leaked" objects at interpreter exit: harmless, dropped.
NOISE='/^nanobind: \|^ - leaked \|^ - \.\.\. skipped remainder\|nanobind\.readthedocs\.io/d'

record_status() { printf '%s\t%s\t%s\n' "$1" "$2" "$3" >>"$WORK/status.tsv"; }

# run_phase PHASE: one process under `timeout`, output prefixed with [PHASE], status appended.
run_phase() {
  local phase=$1 limit remaining began rc
  limit=$(phase_limit "$phase")
  remaining=$((DEADLINE_S - $(date +%s)))
  if [ "$remaining" -lt "$MIN_PHASE_S" ]; then
    say "$phase: skipped, ${remaining}s left of the ${BUDGET_S}s budget"
    record_status "$phase" "skipped:no time left" 0
    return
  fi
  [ "$limit" -gt "$remaining" ] && limit=$remaining
  rm -f "$WORK/phases/$phase.json"
  say "=== $phase (limit ${limit}s, $((DEADLINE_S - $(date +%s)))s left) ==="
  began=$(date +%s)
  timeout --kill-after=20 "$limit" "$PY" -m benchmarks.gpu_check "$phase" --work "$WORK" $SMOKE_FLAG \
      --deadline $((began + limit - limit / 8)) 2>&1 | sed -u -e "$NOISE" -e "s/^/[$phase] /" | tee -a "$LOG"
  rc=${PIPESTATUS[0]}
  record_status "$phase" "$rc" $(($(date +%s) - began))
  say "$phase: exit $rc after $(($(date +%s) - began))s"
}

skip_phase() { say "$1: skipped ($2)"; record_status "$1" "skipped:$2" 0; }

ensure_pydantic() {
  if "$PY" -c "import pydantic" 2>/dev/null; then
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
    return
  fi
  if ls .whl/*.whl >/dev/null 2>&1; then
    say "pydantic missing: installing .whl/ into /tmp/site"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      2>&1 | tee -a "$LOG"
    export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
  else
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
  fi
  "$PY" -c "import pydantic; print('gpu_check: pydantic', pydantic.VERSION)" 2>&1 | tee -a "$LOG" ||
    say "pydantic still missing (run benchmarks/gpu_wheels.sh where pip works, carry .whl): engine phases will fail"
}

# selected PHASE: whether --phases names it (parity_ours and parity_hf are named "parity"); the
# checkpoint is selected whenever a phase that needs it is.
selected() {
  local name=${1%_ours} p
  name=${name%_hf}
  [ -z "$SELECTED" ] && return 0
  case ",$SELECTED," in *",$name,"*) return 0 ;; esac
  if [ "$1" = checkpoint ]; then
    for p in ${SELECTED//,/ }; do
      case $MODEL_PHASES in *" $p "*|*" ${p}_ours "*) return 0 ;; esac
    done
  fi
  return 1
}

say "$(date -u +%FT%TZ) mode=$([ "$SMOKE" = 1 ] && echo smoke || echo gpu) python=$PY work=$WORK out=$OUT_DIR budget=${BUDGET_S}s"
"$PY" --version 2>&1 | tee -a "$LOG"
[ "$SMOKE" = 1 ] || nvidia-smi --query-gpu=name,memory.total,memory.used,clocks.sm,clocks.mem,driver_version \
  --format=csv 2>&1 | tee -a "$LOG"
ensure_pydantic

checkpoint_ok=1
for step in "${STEPS[@]}"; do
  pids=()
  for phase in ${step//+/ }; do
    selected "$phase" || continue
    if [ "$checkpoint_ok" = 0 ] && [[ $MODEL_PHASES == *" $phase "* ]]; then
      skip_phase "$phase" "no checkpoint"
    elif [[ $step == *+* ]]; then
      run_phase "$phase" & pids+=($!)
    else
      run_phase "$phase"
    fi
  done
  [ ${#pids[@]} -gt 0 ] && wait "${pids[@]}"
  if [[ $step == *checkpoint* ]] && selected checkpoint &&
     ! awk -F'\t' '$1 == "checkpoint" && $2 == "0" { found = 1 } END { exit !found }' "$WORK/status.tsv"; then
    checkpoint_ok=0
  fi
done

say "phases done in $(($(date +%s) - START_S))s; report:"
"$PY" -m benchmarks.gpu_check report --work "$WORK" --out "$OUT_DIR" $SMOKE_FLAG 2>&1 | tee -a "$LOG"
exit "${PIPESTATUS[0]}"
