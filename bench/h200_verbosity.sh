#!/usr/bin/env bash
# issue 25, item 10: llama-server at its default log verbosity against -lv 4 (what every trial
# and deploy line used before), interleaved (bench/llama_verbosity.py), on one device machine
# (kind nvidia-h200, carry [".carry"] made by bench/make_carry.sh), in one call from bare:
#   bash bench/h200_verbosity.sh
# 1. the carried llama.cpp tree built twice at once: for the host's CPU (GGML_CUDA=OFF) and for
#    sm_90; 2. synthetic Qwen2.5 shapes: 0.5B (CPU, Q4_0) and 3B (GPU, Q4_K_M); 3. the
#    benchmark on the CPU build (every core, -ngl 0) and on the GPU build (-ngl all).
# Results land in $OUT: verbosity_{cpu,gpu}.{txt,json} and the logs.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /tmp/v/src /tmp/v/m
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
AT=(python3 -c 'import sys; from autotune.cli import main; sys.exit(main())')
t() { local n=$1; shift; local t0=$SECONDS; "$@" >"$OUT/$n.log" 2>&1; local rc=$?; echo "$n $((SECONDS - t0)) s rc=$rc" | tee -a "$OUT/times.txt"; tail -n 3 "$OUT/$n.log"; }

python3 -V; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nproc
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .carry/whl/*.whl
tar xzf .carry/llama.cpp.tar.gz -C /tmp/v/src
gunzip -c .carry/ggml-vocab-qwen2.gguf.gz >/tmp/v/ggml-vocab-qwen2.gguf
COMMON=(-G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF
        -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF)
t build_cpu bash -c "cmake -S /tmp/v/src -B /tmp/v/cpu ${COMMON[*]} -DGGML_CUDA=OFF && ninja -C /tmp/v/cpu llama-server llama-quantize" &
t build_gpu bash -c "cmake -S /tmp/v/src -B /tmp/v/gpu ${COMMON[*]} -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 && ninja -C /tmp/v/gpu llama-server" &
t synth_small "${AT[@]}" synth --arch qwen2 --layers 24 --hidden 896 --heads 14 --kv-heads 2 --ffn 4864 \
    --ctx 32768 --vocab-from /tmp/v/ggml-vocab-qwen2.gguf --out /tmp/v/m/q05b-F16.gguf &
t synth_3b "${AT[@]}" synth --arch qwen2 --layers 36 --hidden 2048 --heads 16 --kv-heads 2 --ffn 11008 \
    --ctx 32768 --vocab-from /tmp/v/ggml-vocab-qwen2.gguf --out /tmp/v/m/q3b-F16.gguf &
wait
/tmp/v/cpu/bin/llama-quantize /tmp/v/m/q05b-F16.gguf /tmp/v/m/q05b-Q4_0.gguf Q4_0 >"$OUT/quant.log" 2>&1 &
/tmp/v/cpu/bin/llama-quantize /tmp/v/m/q3b-F16.gguf /tmp/v/m/q3b-Q4_K_M.gguf Q4_K_M >>"$OUT/quant.log" 2>&1 &
wait
ls -la /tmp/v/m
AUTOTUNE_LLAMA_SERVER=/tmp/v/cpu/bin/llama-server t verbosity_cpu python3 bench/llama_verbosity.py \
    /tmp/v/m/q05b-Q4_0.gguf --rounds 6 --ctx 1024 --parallel 4 --prompt 256 --output 64 --out "$OUT/verbosity_cpu"
cat "$OUT/verbosity_cpu.txt"
AUTOTUNE_LLAMA_SERVER=/tmp/v/gpu/bin/llama-server t verbosity_gpu python3 bench/llama_verbosity.py \
    /tmp/v/m/q3b-Q4_K_M.gguf --gpu --rounds 6 --ctx 2048 --parallel 8 --prompt 512 --output 128 --out "$OUT/verbosity_gpu"
cat "$OUT/verbosity_gpu.txt"
