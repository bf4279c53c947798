#!/usr/bin/env bash
# The whole H200 run of issue 7 as one detached pipeline, so that no device call idles while
# another step could run and none runs past the 10-minute limit. Each device call (kind
# nvidia-h200-x2, carry [".carry"], from the repository root) is
#
#   bash bench/exllamav2_h200/pipeline.sh 560
#
# which starts the pipeline in its own session if it is not running yet (such a process
# outlives the call while the machine stays warm), waits up to 560 s for it to finish, and
# copies what it has so far to $OUT. Repeat the call until it prints "pipeline finished".
#
# Steps (each skipped once done: a marker under /tmp/x/done), two GPUs:
#   wheels (.carry, into /tmp/site) and a copy of the repository's bench/ (the next call
#   replaces the working tree under a running pipeline)
#   in parallel: llama.cpp CUDA build | ExLlamaV2's JIT build | the random FP16 HF model
#   EXL2 measurement pass (GPU 0) | GGUF F16 + Q4_K_M from the same HF model (CPU; should
#   llama.cpp's converter fail, `autotune synth` writes the same shape with its own weights)
#   EXL2 3.3 (GPU 0), 4.0 (GPU 1), 5.0 (GPU 0) at once, reusing the measurement
#   the study bench/h200_exllamav2_study.toml on GPU 0, then bench/study_table.py
set -uo pipefail
W=/tmp/x
DONE=$W/done
LOGS=$W/out
mkdir -p "$DONE" "$LOGS" "$W/m"

if [ "${1:-}" != "--run" ]; then
  wait_s=${1:-560}
  OUT=${OUT:-/tmp/out}
  mkdir -p "$OUT"
  if [ ! -f "$W/pid" ] || ! kill -0 "$(cat "$W/pid")" 2>/dev/null; then
    if [ -f "$DONE/all" ]; then
      echo "pipeline already finished"
    else
      nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader
      rm -rf "$W/repo" && mkdir -p "$W/repo" && cp -r bench .carry "$W/repo/"
      setsid bash "$W/repo/bench/exllamav2_h200/pipeline.sh" --run >"$LOGS/pipeline.log" 2>&1 < /dev/null &
      echo $! >"$W/pid"
      echo "pipeline started (pid $(cat "$W/pid"))"
    fi
  else
    echo "pipeline running (pid $(cat "$W/pid"))"
  fi
  t0=$SECONDS
  while [ $((SECONDS - t0)) -lt "$wait_s" ] && [ -f "$W/pid" ] && kill -0 "$(cat "$W/pid")" 2>/dev/null; do
    sleep 5
  done
  [ -f "$DONE/all" ] && echo "pipeline finished"
  cat "$LOGS/times.txt" 2>/dev/null
  tail -n 15 "$LOGS/pipeline.log"
  # At most 8 files come back: the small ones whole, the logs in one archive.
  for f in times.txt sizes.txt study.log study.db h200_exllamav2_study.md h200_exllamav2_study.json; do
    [ -f "$LOGS/$f" ] && cp "$LOGS/$f" "$OUT/"
  done
  tar czf "$OUT/logs.tgz" -C "$LOGS" --exclude=study.db . 2>/dev/null
  exit 0
fi

# ---------------------------------------------------------------- the pipeline itself
cd "$W/repo"
export PYTHONPATH=/tmp/site
export WORK=$W OUT=$LOGS LLAMA_SRC=/tmp/p/src LLAMA_BIN=/tmp/p/b/bin
STEPS=bench/exllamav2_h200/steps.sh
step() {  # step NAME CMD...: once; a marker says it succeeded
  local name=$1; shift
  [ -f "$DONE/$name" ] && { echo "$name: done before"; return 0; }
  echo "$name: start $(date +%T)"
  if "$@"; then touch "$DONE/$name"; echo "$name: ok $(date +%T)"; else echo "$name: FAILED $(date +%T)"; return 1; fi
}

step wheels bash -c 'python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .carry/whl/*.whl .carry/whl-exl2/*.whl \
  && mkdir -p /tmp/p/src && tar xzf .carry/llama.cpp.tar.gz -C /tmp/p/src' || exit 1

step llama_build bash -c 'cmake -S /tmp/p/src -B /tmp/p/b -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON \
    -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
    >"$OUT/llama_build.log" 2>&1 && ninja -C /tmp/p/b llama-server llama-quantize >>"$OUT/llama_build.log" 2>&1' &
step jit bash "$STEPS" jit &
step model bash "$STEPS" model &
wait
for s in llama_build jit model; do [ -f "$DONE/$s" ] || { echo "stopping: $s failed"; exit 1; }; done

CUDA_VISIBLE_DEVICES=0 step measure bash "$STEPS" measure &
# llama.cpp's converter needs the gguf-py of its own tree, ahead of the carried gguf wheel.
PYTHONPATH=/tmp/p/src/gguf-py:/tmp/site step gguf bash "$STEPS" gguf &
wait
[ -f "$DONE/measure" ] || { echo "stopping: measure failed"; exit 1; }

CUDA_VISIBLE_DEVICES=0 BPWS=3.3 step exl2_3.3 bash "$STEPS" exl2 &
CUDA_VISIBLE_DEVICES=1 BPWS=4.0 step exl2_4.0 bash "$STEPS" exl2 &
CUDA_VISIBLE_DEVICES=0 BPWS=5.0 step exl2_5.0 bash "$STEPS" exl2 &
wait
for s in exl2_3.3 exl2_4.0 exl2_5.0; do [ -f "$DONE/$s" ] || { echo "stopping: $s failed"; exit 1; }; done

# If llama.cpp's converter failed, the GGUF is the same shape with its own random weights.
[ -f "$DONE/gguf" ] || step gguf_synth bash "$STEPS" gguf_synth || exit 1

CUDA_VISIBLE_DEVICES=0 step study bash "$STEPS" study || exit 1
step table python3 bench/study_table.py "sqlite:///$OUT/study.db" --gpu h200 \
    --json "$OUT/h200_exllamav2_study.json" --md "$OUT/h200_exllamav2_study.md" || exit 1
touch "$DONE/all"
echo "all done $(date +%T)"
