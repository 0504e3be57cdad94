#!/usr/bin/env bash
# Quantized weights served: Serval on a GGUF file's blocks against llama.cpp's llama-server on the same file,
# both driven by vLLM's own `bench serve` client (../shared/peers/vllm_bench_serve.sh), plus Serval's float32
# directory (the default app) for reference, in one run:
#
#   [FILES="q4_1 q8_0 q4_k_m 1b_q8_0 1b_q4_k_m"] [LOADS="B1 C32 P2048"] [ENGINES="serval llama serval-f32"] [ROUNDS=1] \
#   [ISA=avx2] [C32_PROMPTS=160] \
#     benchmarks/quant_vs_llama.sh [RESULT_DIR]                     (default results/quant-vs-llama)
#
#   B1:  8 prompts of 128 random tokens -> 128, one at a time (batch 1), ignore_eos.
#   C32: C32_PROMPTS (default 160) prompts of 256 random tokens -> 128, max concurrency 32, no rate limit, ignore_eos.
#   P2048: 3 prompts of 2,048 random tokens -> 16, one at a time: a long prompt's prefill (its TTFT).
# Files (each made when missing, under FILES_DIR, default /tmp):
#   q4_1       models/smollm2-135m-instruct.gguf (the registry's: Q4_1 linears, Q8_0 embedding);
#   q8_0       SmolLM2 by llama.cpp's own converter from the float32 directory (../shared/peers/gguf_from_hf.sh q8_0);
#   q4_k_m     SmolLM2 as users download it: llama.cpp's quantizer (../shared/peers/quantize_gguf.sh Q4_K_M) on the
#              converter's float32 file (its widths are not multiples of 256: Q5_0 and Q8_0 blocks);
#   1b_q8_0, 1b_q4_k_m   `serval make-model --size 1b` (Llama-3.2-1B's shapes, random weights, SmolLM2's
#              tokenizer; 4.3 GB of float32), converted and quantized the same way (Q4_K, Q6_K, ... blocks);
#   gemma3     models/gemma3-270m.gguf, the registry's Gemma 3 270M as llama.cpp's quantizer wrote it (Q4_K_M:
#              Q5_0, Q8_0, Q4_K, Q6_K), `make models`; the bench client reads its tokenizer from models/gemma3-270m.
# llama-server runs with --parallel set
# to the load's concurrency. Serval serves configs/serve/default.yaml with model_source set to the file and, on a
# GGUF file, kv_cache_dtype KV_CACHE_DTYPE (default float16: llama-server's own default K and V type; "auto" for
# the float32 cache); serval-f32 keeps the float32 directory's defaults.
# Prints a line per run, the machine's read and copy bandwidths (2 threads, 256 MB) and, for B1, each step's
# effective bandwidth (weight bytes / median TPOT); the JSON records are under RESULT_DIR.
# ISA=avx2: every engine on its AVX2 code paths, an AVX2-only CPU's arithmetic measured on an AVX-512 one (its
# memory and clocks stay this machine's): Serval's kernels built for x86-64-v3, torch, oneDNN and MKL capped
# at AVX2, llama-server built without AVX-512 (LLAMA_CPP_HOME, default /tmp/llama-cpp-avx2, built from the
# sources ../shared/peers/setup_llama_cpp.sh unpacks, when missing).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-results/quant-vs-llama}
FILES=${FILES:-q4_1 q8_0}
LOADS=${LOADS:-B1 C32}
ENGINES=${ENGINES:-serval llama serval-f32}
ROUNDS=${ROUNDS:-1}
C32_PROMPTS=${C32_PROMPTS:-160}
KV_CACHE_DTYPE=${KV_CACHE_DTYPE:-float16}
MODEL_ID=smollm2-135m-instruct
FILES_DIR=${FILES_DIR:-/tmp}
export RAY_AUTH_MODE=token
mkdir -p "$OUT"
grep -m1 "model name" /proc/cpuinfo

if [[ ${ISA:-native} == avx2 ]]; then
  export SERVAL_CPU_MARCH=x86-64-v3 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2
  export LLAMA_CPP_HOME=${LLAMA_CPP_HOME:-/tmp/llama-cpp-avx2}
  if [[ ! -x $LLAMA_CPP_HOME/bin/llama-server || ! -x $LLAMA_CPP_HOME/bin/llama-quantize ]]; then
    src=${LLAMA_CPP_SRC:-/tmp/llama-cpp/src}
    [[ -d $src ]] || LLAMA_CPP_HOME=${src%/src} ../shared/peers/setup_llama_cpp.sh
    echo "building llama-server for AVX2 into $LLAMA_CPP_HOME (minutes) ..." >&2
    cmake -S "$src" -B "$LLAMA_CPP_HOME/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF \
      -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=OFF \
      > "$OUT/llama-avx2-build.log" 2>&1
    # Both binaries: ../shared/peers/llama_cpp_server.sh takes a home holding llama-server and llama-quantize as built.
    cmake --build "$LLAMA_CPP_HOME/build" --target llama-server llama-quantize -j"$(nproc)" >> "$OUT/llama-avx2-build.log" 2>&1
    mkdir -p "$LLAMA_CPP_HOME/bin"
    for b in llama-server llama-quantize; do ln -sf "$LLAMA_CPP_HOME/build/bin/$b" "$LLAMA_CPP_HOME/bin/$b"; done
  fi
  .venv/bin/python -m engine.kernels.cpu >&2  # the x86-64-v3 build, before the replicas need it
fi

checkpoint_of() {
  case $1 in
    1b_*) echo "$FILES_DIR/llama-1b" ;;
    gemma3) echo "$PWD/models/gemma3-270m" ;;
    *) echo "$PWD/models/$MODEL_ID" ;;
  esac
}
gguf_of() {  # gguf_of FILE -> its path
  case $1 in
    q4_1) echo "$PWD/models/$MODEL_ID.gguf" ;;
    q8_0 | q4_k_m) echo "$FILES_DIR/$MODEL_ID.$1.gguf" ;;
    1b_q8_0 | 1b_q4_k_m) echo "$FILES_DIR/llama-1b.${1#1b_}.gguf" ;;
    gemma3) echo "$PWD/models/gemma3-270m.gguf" ;;
    *) echo "unknown file $1" >&2; exit 2 ;;
  esac
}
make_file() {  # make_file FILE: writes gguf_of FILE where it is missing (minutes for the 1B)
  local path dir f32
  path=$(gguf_of "$1") dir=$(checkpoint_of "$1")
  [[ -f $path ]] && return
  [[ $1 == gemma3 ]] && { echo "$path is missing: make models writes it" >&2; exit 2; }
  echo "making $path ..." >&2
  if [[ $1 == 1b_* && ! -f $dir/config.json ]]; then
    .venv/bin/serval make-model "$dir" --size 1b --threads 2 >&2
    # SmolLM2's tokenizer (the same 49,152 ids): llama.cpp's converter refuses a BPE pre-tokenizer it does not know.
    cp "$PWD/models/$MODEL_ID"/tokenizer.json "$PWD/models/$MODEL_ID"/tokenizer_config.json "$dir/"
  fi
  if [[ $1 == *q8_0 ]]; then ../shared/peers/gguf_from_hf.sh "$dir" "$path" q8_0 >> "$OUT/convert.log" 2>&1; return; fi
  f32=${path%.*.gguf}.f32.gguf
  [[ -f $f32 ]] || ../shared/peers/gguf_from_hf.sh "$dir" "$f32" f32 >> "$OUT/convert.log" 2>&1
  ../shared/peers/quantize_gguf.sh "$f32" "$path" Q4_K_M >> "$OUT/convert.log" 2>&1
}
for f in $FILES; do make_file "$f"; done

shape() {  # shape LOAD -> "prompts input output concurrency"
  case $1 in
    B1) echo "8 128 128 1" ;;
    C32) echo "$C32_PROMPTS 256 128 32" ;;
    P2048) echo "3 2048 16 1" ;;
    *) echo "unknown load $1" >&2; exit 2 ;;
  esac
}

load() {  # load NAME URL MODEL LOAD RUN TOKENIZER
  read -r prompts input output concurrency <<<"$(shape "$4")"
  echo "[$1 $4 run $5] $prompts prompts $input -> $output, concurrency $concurrency ..." >&2
  ../shared/peers/vllm_bench_serve.sh --base-url "$2" --model "$3" --tokenizer "$6" --dataset-name random \
    --random-input-len "$input" --random-output-len "$output" --num-prompts "$prompts" --ignore-eos --seed "$5" \
    --request-rate inf --max-concurrency "$concurrency" --save-result --save-detailed --metadata "output_len=$output" \
    --result-dir "$OUT" --result-filename "$1-$4-$5.json" > "$OUT/$1-$4-$5.log" 2>&1
}

serval() {  # serval NAME MODEL_SOURCE RUN TOKENIZER [KV_CACHE_DTYPE]: the default app on MODEL_SOURCE, every load
  sed -e "s|model_source: models/$MODEL_ID |model_source: $2 |" \
    -e "s|^      engine_kwargs:\$|      engine_kwargs:\n        kv_cache_dtype: ${5:-auto}|" configs/serve/default.yaml > "$OUT/$1.yaml"
  .venv/bin/serval serve --config "$OUT/$1.yaml" --detach --replace > "$OUT/$1-serve-$3.log" 2>&1 \
    || { tail -20 "$OUT/$1-serve-$3.log"; .venv/bin/serval stop >/dev/null 2>&1; exit 1; }
  for l in $LOADS; do load "$1" http://127.0.0.1:8000 "$MODEL_ID" "$l" "$3" "$4"; done
  .venv/bin/serval stop > /dev/null 2>&1
}

llama() {  # llama NAME GGUF RUN TOKENIZER: llama-server on GGUF, --parallel = each load's concurrency
  for l in $LOADS; do
    read -r _ input output concurrency <<<"$(shape "$l")"
    ../shared/peers/llama_cpp_server.sh "$2" 8200 --parallel "$concurrency" \
      --ctx-size $((concurrency * (input + output + 64))) > "$OUT/$1-server-$l-$3.log" 2>&1 &
    local pid=$!
    until curl -sf http://127.0.0.1:8200/health >/dev/null; do
      kill -0 $pid 2>/dev/null || { tail -20 "$OUT/$1-server-$l-$3.log"; exit 1; }
      sleep 1
    done
    load "$1" http://127.0.0.1:8200 "$2" "$l" "$3" "$4"
    kill $pid; wait $pid 2>/dev/null || true
  done
}

for run in $(seq 1 "$ROUNDS"); do
  for f in $FILES; do
    for engine in $ENGINES; do
      case $engine in
        serval) serval "serval-$f" "$(gguf_of "$f")" "$run" "$(checkpoint_of "$f")" "$KV_CACHE_DTYPE" ;;
        llama) llama "llama-$f" "$(gguf_of "$f")" "$run" "$(checkpoint_of "$f")" ;;
        serval-f32) if [[ $f == "${FILES%% *}" ]]; then serval serval-f32 "models/$MODEL_ID" "$run" "models/$MODEL_ID"; fi ;;
      esac
    done
  done
done

.venv/bin/python benchmarks/quant_report.py "$OUT" $(for f in $FILES; do echo "$f=$(gguf_of "$f")"; done)
