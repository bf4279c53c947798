#!/usr/bin/env bash
# The H200 session of issues 4 and 7, as run through the device tool (kind nvidia-h200-x2,
# carry [".carry"]), one step per call, back to back while the machine stays warm:
#   bash bench/h200_session.sh prep    # wheels; in parallel: llama.cpp CUDA build, ExLlamaV2's
#                                      # JIT build, the 1.5B HF model, the 7B synthetic GGUF
#   bash bench/h200_session.sh vram    # issue 4: NVML vs prediction, 16+ llama-server configs
#   bash bench/h200_session.sh exl2    # issue 7: EXL2 measurement + 3 bpw, GGUF Q4_K_M
#   bash bench/h200_session.sh study   # issue 7: the ExLlamaV2-vs-llama.cpp study
# Issue 7's final run used bench/exllamav2_h200/pipeline.sh instead (all of it, overlapped,
# across calls); the exl2/study steps here are its one-step-per-call form.
# .carry is made by bench/make_carry.sh: whl/ (optuna, sqlalchemy, ..., the autotune wheel),
# whl-exl2/ (exllamav2 0.3.2, fastparquet, cramjam, websockets), llama.cpp.tar.gz (the
# vendored tree of the llama-cpp-python 0.3.36 sdist with its gguf-py, docs/tests/other GPU
# backends stripped), ggml-vocab-qwen2.gguf.gz (gunzipped to /tmp).
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONPATH=/tmp/site CUDA_VISIBLE_DEVICES=0
AT=(python3 -c 'import sys; from autotune.cli import main; sys.exit(main())')
t() { local n=$1; shift; local t0=$SECONDS; "$@" >"$OUT/$n.log" 2>&1; local rc=$?; echo "$n $((SECONDS - t0)) s rc=$rc" | tee -a "$OUT/times.txt"; tail -n 3 "$OUT/$n.log"; }

for step in "$@"; do
case $step in
prep)
  python3 -V; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .carry/whl/*.whl .carry/whl-exl2/*.whl
  mkdir -p /tmp/p/src /tmp/q7b /tmp/x/m && tar xzf .carry/llama.cpp.tar.gz -C /tmp/p/src
  t llama_build bash -c 'cmake -S /tmp/p/src -B /tmp/p/b -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON \
      -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF \
      -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
      && ninja -C /tmp/p/b llama-server llama-quantize' &
  t exl2_jit python3 -c 'import time; t=time.time(); from exllamav2 import ext; import exllamav2.attn as a; print("ext built in", round(time.time()-t), "s; flash_attn", a.has_flash_attn, "xformers", a.has_xformers, "sdpa_lower_right", a.has_lower_right_sdpa)' &
  t hf_model python3 bench/exllamav2_h200/build_model.py /tmp/x/m/q15b-fp16 &
  gunzip -c .carry/ggml-vocab-qwen2.gguf.gz >/tmp/ggml-vocab-qwen2.gguf
  t synth_7b "${AT[@]}" synth --arch qwen2 --layers 28 --hidden 3584 --heads 28 --kv-heads 4 --ffn 18944 \
      --ctx 32768 --vocab-from /tmp/ggml-vocab-qwen2.gguf --out /tmp/q7b/q7b-f16.gguf &
  wait
  for q in Q8_0 Q4_K_M; do t "quant_$q" /tmp/p/b/bin/llama-quantize /tmp/q7b/q7b-f16.gguf /tmp/q7b/q7b-$q.gguf $q 32 & done
  wait
  ls -la /tmp/q7b /tmp/x/m
  ;;
vram)
  t vram_check python3 bench/vram_check.py /tmp/q7b/q7b-Q8_0.gguf /tmp/q7b/q7b-Q4_K_M.gguf \
      --server /tmp/p/b/bin/llama-server --gpu h200 --ctx 2048 8192 --parallel 1 4 --caches f16 q8_0 \
      --ubatch 512 --out "$OUT/h200_vram.json" --md "$OUT/h200_vram.md"
  t vram_check_ub python3 bench/vram_check.py /tmp/q7b/q7b-Q4_K_M.gguf --server /tmp/p/b/bin/llama-server \
      --gpu h200 --ctx 4096 --parallel 2 --caches f16 --ubatch 256 1024 --no-fa-too \
      --out "$OUT/h200_vram_ub.json" --md "$OUT/h200_vram_ub.md"
  cat "$OUT/h200_vram.md" "$OUT/h200_vram_ub.md"
  ;;
exl2)
  OUT=$OUT bash bench/exllamav2_h200/steps.sh measure exl2 gguf
  ;;
study)
  OUT=$OUT bash bench/exllamav2_h200/steps.sh study
  ;;
*) echo "unknown step $step" >&2; exit 2 ;;
esac
done
