#!/usr/bin/env bash
# issue 27: the exhaustive grids of models that do not fit, on one device machine (kind
# nvidia-h200, carry [".carry"] made by bench/make_carry.sh), in back-to-back calls while the
# machine stays warm (everything lives under /tmp/o):
#   bash bench/h200_offload_grids.sh prep        # sm_90 build of the carried tree, two synthetic
#                                                # models (dense Qwen2.5-7B shape, a 12-layer
#                                                # Qwen3-30B-A3B shape), Q4_K_M each
#   bash bench/h200_offload_grids.sh grid NAME RUN [SECS]
#                                                # the grid bench/h200_grid_NAME.toml, run RUN, under
#                                                # the physical budget its [hardware] names (a holder
#                                                # takes the rest of the card); a later call resumes it
# Every configuration of a grid is measured once per run (sampler "grid"); run 2 is the same grid
# in another seeded order ([study] seed = RUN - 1 shuffles the grid), so that replay
# (bench/replay.py) knows the between-run spread. Storages and logs are copied to $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /tmp/o/src /tmp/o/m /tmp/o/db
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
AT=(python3 -c 'import sys; from autotune.cli import main; sys.exit(main())')
t() { local n=$1; shift; local t0=$SECONDS; "$@" >"$OUT/$n.log" 2>&1; local rc=$?; echo "$n $((SECONDS - t0)) s rc=$rc" | tee -a "$OUT/times.txt"; tail -n 3 "$OUT/$n.log"; }

case "${1:-}" in
prep)
  python3 -V; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nproc; free -g | head -2
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .carry/whl/*.whl
  python3 -c 'import scipy' 2>/dev/null || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .carry/whl-scipy/*.whl
  tar xzf .carry/llama.cpp.tar.gz -C /tmp/o/src
  gunzip -c .carry/ggml-vocab-qwen2.gguf.gz >/tmp/o/ggml-vocab-qwen2.gguf
  t build bash -c "cmake -S /tmp/o/src -B /tmp/o/gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF \
      -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_UI=OFF \
      -DLLAMA_USE_PREBUILT_UI=OFF -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 && ninja -C /tmp/o/gpu llama-server llama-quantize" &
  t synth_dense "${AT[@]}" synth --arch qwen2 --layers 28 --hidden 3584 --heads 28 --kv-heads 4 --ffn 18944 \
      --ctx 32768 --vocab-from /tmp/o/ggml-vocab-qwen2.gguf --out /tmp/o/m/q7b.gguf &
  t synth_moe "${AT[@]}" synth --arch qwen3moe --layers 12 --hidden 2048 --heads 32 --kv-heads 4 --head-dim 128 \
      --ffn 6144 --experts 128 --experts-used 8 --expert-ffn 768 --ctx 32768 \
      --vocab-from /tmp/o/ggml-vocab-qwen2.gguf --out /tmp/o/m/q30a3b12.gguf &
  wait
  t quant_dense /tmp/o/gpu/bin/llama-quantize /tmp/o/m/q7b.gguf /tmp/o/m/q7b-Q4_K_M.gguf Q4_K_M 8 &
  t quant_moe /tmp/o/gpu/bin/llama-quantize /tmp/o/m/q30a3b12.gguf /tmp/o/m/q30a3b12-Q4_K_M.gguf Q4_K_M 8 &
  wait
  rm -f /tmp/o/m/q7b.gguf /tmp/o/m/q30a3b12.gguf
  ls -la /tmp/o/m | tee "$OUT/models.txt"
  ;;
chat)
  # issue 39: bench/h200_chat_targets.toml under a 5 GiB physical budget, --budget ${2:-300}s, as
  # a new user runs it: refused up front (exit 2, the forecast's figures), or a search within it.
  budget=${2:-300}
  setsid python3 bench/hold_gpu_memory.py --leave-gib 5 >"$OUT/hold-chat.log" 2>&1 &
  holder=$!
  for _ in $(seq 60); do grep -q holding "$OUT/hold-chat.log" 2>/dev/null && break; sleep 1; done
  cat "$OUT/hold-chat.log"
  t "study-chat-$budget" timeout -s INT $((budget + 240)) "${AT[@]}" study bench/h200_chat_targets.toml \
      --storage "sqlite:////tmp/o/db/h200-chat-targets.db" --budget "${budget}s"
  kill "$holder"; wait "$holder" 2>/dev/null
  cp /tmp/o/db/h200-chat-targets.db "$OUT/" 2>/dev/null
  cat "$OUT/study-chat-$budget.log"
  ;;
grid)
  name=$2 run=$3 secs=${4:-560}
  file=bench/h200_grid_$name.toml db=h200_grid_$name-run$run
  leave=$(python3 -c "import tomllib,sys; print(tomllib.load(open('$file','rb'))['hardware']['vram_budget_gib'])")
  sed "s/^seed = 0/seed = $((run - 1))/" "$file" >"/tmp/o/$db.toml"
  # A run recorded before (bench/results/offload_grids_h200) goes on where it stopped.
  [ -f "/tmp/o/db/$db.db" ] || [ ! -f "bench/results/offload_grids_h200/$db.db" ] || \
      cp "bench/results/offload_grids_h200/$db.db" "/tmp/o/db/$db.db"
  setsid python3 bench/hold_gpu_memory.py --leave-gib "$leave" >"$OUT/hold-$db.log" 2>&1 &
  holder=$!
  for _ in $(seq 60); do grep -q holding "$OUT/hold-$db.log" 2>/dev/null && break; sleep 1; done
  cat "$OUT/hold-$db.log"
  # SIGINT before the call's limit: the study stops cleanly and its storage comes back.
  t "study-$db" timeout -s INT "$secs" "${AT[@]}" study "/tmp/o/$db.toml" --storage "sqlite:////tmp/o/db/$db.db" --json
  kill "$holder"; wait "$holder" 2>/dev/null
  cp "/tmp/o/db/$db.db" "$OUT/"
  tail -n 40 "$OUT/study-$db.log"
  ;;
*) echo "usage: $0 prep | grid NAME RUN [SECS]" >&2; exit 2 ;;
esac
