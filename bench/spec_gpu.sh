#!/usr/bin/env bash
# Issue 47's GPU study through the device tool (kind nvidia-h100-x1, carry [".carry"], made by
# bench/make_carry.sh less whl-scipy, with the autotune wheel of this tree), two calls back to
# back while the machine stays warm (everything under /tmp/s):
#   bash bench/spec_gpu.sh prep    # wheels; llama.cpp CUDA build beside the two synthetic models
#   bash bench/spec_gpu.sh study   # bench/h100_spec_study.toml, exhaustive; storage and logs to $OUT
#   bash bench/spec_gpu.sh pays    # alone, from a bare machine: build, the 7B shape at Q8_0 and a
#                                  # 4-layer draft, then bench/h100_spec_pays.toml (1 and 8 slots)
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /tmp/s/m /tmp/s/src
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
AT=(python3 -c 'import sys; from autotune.cli import main; sys.exit(main())')
t() { local n=$1; shift; local t0=$SECONDS; "$@" >"$OUT/$n.log" 2>&1; local rc=$?; echo "$n $((SECONDS - t0)) s rc=$rc" | tee -a "$OUT/times.txt"; tail -n 3 "$OUT/$n.log"; }
case $1 in
prep)
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .carry/whl/*.whl
  python3 -c 'import scipy, optuna, autotune; print("scipy", scipy.__version__, "optuna", optuna.__version__)'
  tar xzf .carry/llama.cpp.tar.gz -C /tmp/s/src
  gunzip -c .carry/ggml-vocab-qwen2.gguf.gz >/tmp/s/ggml-vocab-qwen2.gguf
  t build bash -c "cmake -S /tmp/s/src -B /tmp/s/b -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON \
      -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF \
      -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
      && ninja -C /tmp/s/b llama-server llama-quantize" &
  t synth_q7b "${AT[@]}" synth --arch qwen2 --layers 28 --hidden 3584 --heads 28 --kv-heads 4 --ffn 18944 \
      --ctx 32768 --vocab-from /tmp/s/ggml-vocab-qwen2.gguf --out /tmp/s/m/q7b-F16.gguf &
  t synth_q05b "${AT[@]}" synth --arch qwen2 --layers 24 --hidden 896 --heads 14 --kv-heads 2 --ffn 4864 \
      --ctx 32768 --vocab-from /tmp/s/ggml-vocab-qwen2.gguf --out /tmp/s/m/q05b-F16.gguf &
  wait
  t quant_q7b /tmp/s/b/bin/llama-quantize /tmp/s/m/q7b-F16.gguf /tmp/s/m/q7b-Q4_K_M.gguf Q4_K_M 16 &
  t quant_q05b /tmp/s/b/bin/llama-quantize /tmp/s/m/q05b-F16.gguf /tmp/s/m/q05b-Q8_0.gguf Q8_0 16 &
  wait
  rm -f /tmp/s/m/q7b-F16.gguf
  ls -la /tmp/s/m | tee "$OUT/models.txt" ;;
study)
  cp bench/h100_spec_study.toml /tmp/s/study.toml
  t study timeout 560 "${AT[@]}" study /tmp/s/study.toml --storage sqlite:////tmp/s/spec.db
  cp /tmp/s/spec.db "$OUT/" 2>/dev/null
  t best "${AT[@]}" best --study h100-spec-7b --storage sqlite:////tmp/s/spec.db ;;
pays)
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .carry/whl/*.whl
  tar xzf .carry/llama.cpp.tar.gz -C /tmp/s/src
  gunzip -c .carry/ggml-vocab-qwen2.gguf.gz >/tmp/s/ggml-vocab-qwen2.gguf
  t build bash -c "cmake -S /tmp/s/src -B /tmp/s/b -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON \
      -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF \
      -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
      && ninja -C /tmp/s/b llama-server llama-quantize" &
  t synth_q7b "${AT[@]}" synth --arch qwen2 --layers 28 --hidden 3584 --heads 28 --kv-heads 4 --ffn 18944 \
      --ctx 32768 --vocab-from /tmp/s/ggml-vocab-qwen2.gguf --out /tmp/s/m/q7b-F16.gguf &
  t synth_tiny "${AT[@]}" synth --arch qwen2 --layers 4 --hidden 256 --heads 4 --kv-heads 2 --ffn 1024 \
      --ctx 32768 --vocab-from /tmp/s/ggml-vocab-qwen2.gguf --out /tmp/s/m/tiny-F16.gguf &
  wait
  t quant_q7b /tmp/s/b/bin/llama-quantize /tmp/s/m/q7b-F16.gguf /tmp/s/m/q7b-Q8_0.gguf Q8_0 16
  cp bench/h100_spec_pays.toml /tmp/s/pays.toml
  t pays timeout 240 "${AT[@]}" study /tmp/s/pays.toml --storage sqlite:////tmp/s/pays.db
  cp /tmp/s/pays.db "$OUT/" 2>/dev/null ;;
esac
