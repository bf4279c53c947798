#!/usr/bin/env bash
# Issue 43: placement grids on two H200s (device kind nvidia-h200-x2, carry [".carry"] made by
# bench/make_carry.sh), in back-to-back calls while the machine stays warm (all under /tmp/o):
#   bash bench/h200x2_placement_grids.sh prep           # sm_90 build (CUDA; no RPC) of the carried
#                                                       # tree; a dense 32B shape and a Qwen3-30B-A3B
#                                                       # shape (48 layers), Q4_K_M each
#   bash bench/h200x2_placement_grids.sh grid NAME RUN [SECS]
#                                                       # bench/h200x2_grid_NAME.toml, run RUN, each
#                                                       # card held to the file's vram_budget_gib by
#                                                       # its own holder; a later call resumes it
# Then, here: python bench/replay.py --grid sqlite:///.../h200x2-grid-NAME-run1.db --grid
# ...-run2.db --seeds 20 --strategies random,tpe,prior --budget-fraction 0.25 (and 0.10).
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /tmp/o/src /tmp/o/m /tmp/o/db
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
AT=(python3 -c 'import sys; from autotune.cli import main; sys.exit(main())')
t() { local n=$1; shift; local t0=$SECONDS; "$@" >"$OUT/$n.log" 2>&1; local rc=$?; echo "$n $((SECONDS - t0)) s rc=$rc" | tee -a "$OUT/times.txt"; tail -n 3 "$OUT/$n.log"; }

case "${1:-}" in
prep)
  nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader; nvidia-smi topo -m; nproc
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .carry/whl/*.whl
  python3 -c 'import scipy' 2>/dev/null || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .carry/whl-scipy/*.whl
  tar xzf .carry/llama.cpp.tar.gz -C /tmp/o/src
  gunzip -c .carry/ggml-vocab-qwen2.gguf.gz >/tmp/o/ggml-vocab-qwen2.gguf
  t build bash -c "cmake -S /tmp/o/src -B /tmp/o/gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF \
      -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_UI=OFF \
      -DLLAMA_USE_PREBUILT_UI=OFF -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 && \
      ninja -C /tmp/o/gpu llama-server llama-quantize" &
  t synth_dense "${AT[@]}" synth --arch qwen2 --layers 64 --hidden 5120 --heads 40 --kv-heads 8 --ffn 27648 \
      --ctx 32768 --vocab-from /tmp/o/ggml-vocab-qwen2.gguf --out /tmp/o/m/q32b.gguf &
  t synth_moe "${AT[@]}" synth --arch qwen3moe --layers 48 --hidden 2048 --heads 32 --kv-heads 4 --head-dim 128 \
      --ffn 6144 --experts 128 --experts-used 8 --expert-ffn 768 --ctx 32768 \
      --vocab-from /tmp/o/ggml-vocab-qwen2.gguf --out /tmp/o/m/q30a3b.gguf &
  wait
  t quant_dense /tmp/o/gpu/bin/llama-quantize /tmp/o/m/q32b.gguf /tmp/o/m/q32b-Q4_K_M.gguf Q4_K_M 16 &
  t quant_moe /tmp/o/gpu/bin/llama-quantize /tmp/o/m/q30a3b.gguf /tmp/o/m/q30a3b-Q4_K_M.gguf Q4_K_M 16 &
  wait
  rm -f /tmp/o/m/q32b.gguf /tmp/o/m/q30a3b.gguf
  ls -la /tmp/o/m | tee "$OUT/models.txt"
  ;;
grid)
  name=$2 run=$3 secs=${4:-560}
  file=bench/h200x2_grid_$name.toml db=h200x2-grid-$name-run$run
  leave=$(python3 -c "import tomllib; print(tomllib.load(open('$file','rb'))['hardware']['vram_budget_gib'])")
  sed "s/^seed = 0/seed = $((run - 1))/" "$file" >"/tmp/o/$db.toml"
  holders=()
  for card in 0 1; do  # each card held to the budget: a wrongly admitted share fails for real
    CUDA_VISIBLE_DEVICES=$card setsid python3 bench/hold_gpu_memory.py --leave-gib "$leave" >"$OUT/hold-$db-$card.log" 2>&1 &
    holders+=($!)
  done
  for card in 0 1; do
    for _ in $(seq 60); do grep -q holding "$OUT/hold-$db-$card.log" 2>/dev/null && break; sleep 1; done
    cat "$OUT/hold-$db-$card.log"
  done
  # NVML per card while the grid runs: each launched trial's memory on each card.
  nvidia-smi --query-gpu=timestamp,index,memory.used --format=csv,noheader -lms 500 >"$OUT/nvml-$db.csv" &
  smi=$!
  t "study-$db" timeout -s INT "$secs" "${AT[@]}" study "/tmp/o/$db.toml" --storage "sqlite:////tmp/o/db/$db.db" --json
  kill "$smi" "${holders[@]}"; wait 2>/dev/null
  cp "/tmp/o/db/$db.db" "$OUT/"
  tail -n 40 "$OUT/study-$db.log"
  ;;
*) echo "usage: $0 prep | grid NAME RUN [SECS]" >&2; exit 2 ;;
esac
