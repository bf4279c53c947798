#!/usr/bin/env bash
# issue 27: raw figures of llama-server with part of a model in host memory, on one device
# machine (kind nvidia-h200, carry [".carry"] made by bench/make_carry.sh), in two back-to-back
# calls (the machine stays warm between them; /tmp survives):
#   bash bench/h200_offload_probe.sh build   # sm_90 build of the carried tree, two synthetic models
#   bash bench/h200_offload_probe.sh probe   # bench/offload_probe.py over -ngl, --n-cpu-moe, -ub, --fit
# Models (random weights, `autotune synth`, then Q4_K_M): a Qwen2.5-7B shape (dense, 28 layers)
# and a Qwen3-30B-A3B shape cut to 12 layers (128 experts, 8 used, expert width 768), so that
# the F16 file is written in minutes. Results land in $OUT: offload_{dense,moe,held}.jsonl, the
# launch logs, times.txt.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /tmp/o/src /tmp/o/m
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
AT=(python3 -c 'import sys; from autotune.cli import main; sys.exit(main())')
t() { local n=$1; shift; local t0=$SECONDS; "$@" >"$OUT/$n.log" 2>&1; local rc=$?; echo "$n $((SECONDS - t0)) s rc=$rc" | tee -a "$OUT/times.txt"; tail -n 3 "$OUT/$n.log"; }
SERVER=/tmp/o/gpu/bin/llama-server
DENSE=/tmp/o/m/q7b-Q4_K_M.gguf
MOE=/tmp/o/m/q30a3b12-Q4_K_M.gguf

case "${1:-}" in
build)
  python3 -V; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nproc; free -g | head -2
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .carry/whl/*.whl
  tar xzf .carry/llama.cpp.tar.gz -C /tmp/o/src
  gunzip -c .carry/ggml-vocab-qwen2.gguf.gz >/tmp/o/ggml-vocab-qwen2.gguf
  COMMON=(-G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF
          -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF)
  t build_gpu bash -c "cmake -S /tmp/o/src -B /tmp/o/gpu ${COMMON[*]} -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 && ninja -C /tmp/o/gpu llama-server llama-quantize" &
  t synth_dense "${AT[@]}" synth --arch qwen2 --layers 28 --hidden 3584 --heads 28 --kv-heads 4 --ffn 18944 \
      --ctx 32768 --vocab-from /tmp/o/ggml-vocab-qwen2.gguf --out /tmp/o/m/q7b.gguf &
  t synth_moe "${AT[@]}" synth --arch qwen3moe --layers 12 --hidden 2048 --heads 32 --kv-heads 4 --head-dim 128 \
      --ffn 6144 --experts 128 --experts-used 8 --expert-ffn 768 --ctx 32768 \
      --vocab-from /tmp/o/ggml-vocab-qwen2.gguf --out /tmp/o/m/q30a3b12.gguf &
  wait
  t quant_dense /tmp/o/gpu/bin/llama-quantize /tmp/o/m/q7b.gguf $DENSE Q4_K_M &
  t quant_moe /tmp/o/gpu/bin/llama-quantize /tmp/o/m/q30a3b12.gguf $MOE Q4_K_M &
  wait
  ls -la /tmp/o/m | tee "$OUT/models.txt"
  ;;
probe)
  P=(python3 bench/offload_probe.py --server $SERVER --prompt 512 --output 64 --repeats 2)
  t probe_moe "${P[@]}" $MOE --out "$OUT/offload_moe.jsonl" \
      --case "ncmoe=0 ub=512" --case "ncmoe=4 ub=512" --case "ncmoe=8 ub=512" --case "ncmoe=12 ub=512" \
      --case "ncmoe=0 ub=2048" --case "ncmoe=4 ub=2048" --case "ncmoe=8 ub=2048" --case "ncmoe=12 ub=2048" \
      --case "ngl=6 ub=512" --case "fit=on"
  cat "$OUT/probe_moe.log"
  t probe_dense "${P[@]}" $DENSE --out "$OUT/offload_dense.jsonl" \
      --case "ngl=0 ub=512" --case "ngl=7 ub=512" --case "ngl=14 ub=512" --case "ngl=21 ub=512" \
      --case "ngl=28 ub=512" --case "ngl=999 ub=512" --case "ngl=14 ub=2048" --case "fit=on"
  cat "$OUT/probe_dense.log"
  # A physical budget: all but 3 GiB of the card held, so --fit has to leave part of each model
  # in host memory, and the hand-picked splits beside it must fit the same 3 GiB.
  setsid python3 bench/hold_gpu_memory.py --leave-gib 3 >"$OUT/hold.log" 2>&1 &
  for _ in $(seq 60); do grep -q holding "$OUT/hold.log" 2>/dev/null && break; sleep 1; done
  cat "$OUT/hold.log"
  t probe_held_moe "${P[@]}" $MOE --out "$OUT/offload_held.jsonl" --case "fit=on" --case "ncmoe=10 ub=512" \
      --case "ncmoe=12 ub=512"
  t probe_held_dense "${P[@]}" $DENSE --out "$OUT/offload_held.jsonl" --case "fit=on" --case "ngl=14 ub=512"
  cat "$OUT/probe_held_moe.log" "$OUT/probe_held_dense.log"
  pkill -f hold_gpu_memory.py
  ;;
*) echo "usage: $0 build|probe" >&2; exit 2 ;;
esac
