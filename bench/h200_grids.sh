#!/usr/bin/env bash
# The H200 session of issues 13 and 14 through the device tool (kind nvidia-h200-x2, carry
# [".carry"], made by bench/make_carry.sh), one step per call, back to back while the machine
# stays warm (everything lives under /tmp/g):
#   bash bench/h200_grids.sh prep            # wheels; llama.cpp CUDA build beside two synthetic
#                                            # models; six quantizations; llama-bench tg128/pp512
#                                            # (BENCH=0 leaves llama-bench out: ~60 s less)
#   bash bench/h200_grids.sh grids RUN SECS  # both exhaustive grids at once, one per GPU, for
#                                            # SECS seconds (a later call resumes them); RUN 1 puts
#                                            # the Qwen grid on GPU 0, RUN 2 swaps the GPUs
#   bash bench/h200_grids.sh seeds SEED...   # issue 14: the default strategy for real (prior on,
#                                            # then TPE) on each grid, one per GPU, with --budget a
#                                            # quarter of the grid's recorded measuring time
#   bash bench/h200_grids.sh llama-seeds S0 S1  # in one call from a bare machine: the Llama
#                                            # model and build only, then seeds S0 (GPU 0) and S1
#                                            # (GPU 1) at once, interrupted cleanly (SIGINT)
#                                            # before LIMIT seconds (default 570) so the storages
#                                            # come back whatever happens
#   bash bench/h200_grids.sh workers         # issue 14: the Qwen grid by two workers on one
#                                            # storage, one per GPU (CUDA_VISIBLE_DEVICES=N)
# Each grid runs under a physical memory budget: bench/hold_gpu_memory.py takes the rest of its
# card. Storages are copied to $OUT after every step.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /tmp/g/db
export PYTHONPATH=/tmp/site
AT=(python3 -c 'import sys; from autotune.cli import main; sys.exit(main())')
t() { local n=$1; shift; local t0=$SECONDS; "$@" >"$OUT/$n.log" 2>&1; local rc=$?; echo "$n $((SECONDS - t0)) s rc=$rc" | tee -a "$OUT/times.txt"; tail -n 3 "$OUT/$n.log"; }

build() {  # build TARGET...: the carried llama.cpp tree for sm_90 under /tmp/g/b
  t llama_build bash -c "cmake -S /tmp/g/src -B /tmp/g/b -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON \
      -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF \
      -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
      && ninja -C /tmp/g/b $*"
}

synth_l8b() {  # the Llama 3.1 8B shape, F16, at /tmp/g/m/l8b-F16.gguf
  t synth_l8b "${AT[@]}" synth --arch llama --layers 32 --hidden 4096 --heads 32 --kv-heads 8 --ffn 14336 \
      --ctx 131072 --vocab-from /tmp/g/ggml-vocab-llama-bpe.gguf --out /tmp/g/m/l8b-F16.gguf
}

grid() {  # grid STUDY_FILE GPU RUN SECS LEAVE_GIB
  local file=$1 gpu=$2 run=$3 secs=$4 leave=$5 name
  name=$(basename "$file" .toml)-run$run
  cp "$file" "/tmp/g/$name.toml"  # the card is CUDA_VISIBLE_DEVICES's: gpu_index counts from it
  # Exported: the holder and the study (its engine, its NVML reads) must both see this card only.
  export CUDA_VISIBLE_DEVICES=$gpu
  setsid python3 bench/hold_gpu_memory.py --leave-gib "$leave" >"$OUT/hold-$name.log" 2>&1 &
  local holder=$!
  sleep 20
  cat "$OUT/hold-$name.log"
  t "study-$name" "${AT[@]}" study "/tmp/g/$name.toml" --storage "sqlite:////tmp/g/db/$name.db" --budget "${secs}s"
  kill "$holder"; wait "$holder" 2>/dev/null
  cp "/tmp/g/db/$name.db" "$OUT/"
}

step=$1; shift
case $step in
prep)
  python3 -V; nvidia-smi --query-gpu=index,name,uuid,memory.total,driver_version --format=csv,noheader
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .carry/whl/*.whl
  python3 -c 'import scipy' 2>/dev/null || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .carry/whl-scipy/*.whl
  python3 -c 'import scipy, optuna, autotune; print("scipy", scipy.__version__, "optuna", optuna.__version__)'
  mkdir -p /tmp/g/src /tmp/g/m && tar xzf .carry/llama.cpp.tar.gz -C /tmp/g/src
  for v in qwen2 llama-bpe; do gunzip -c .carry/ggml-vocab-$v.gguf.gz >/tmp/g/ggml-vocab-$v.gguf; done
  build llama-server llama-quantize llama-bench &
  t synth_q7b "${AT[@]}" synth --arch qwen2 --layers 28 --hidden 3584 --heads 28 --kv-heads 4 --ffn 18944 \
      --ctx 32768 --vocab-from /tmp/g/ggml-vocab-qwen2.gguf --out /tmp/g/m/q7b-F16.gguf &
  synth_l8b &
  wait
  for q in Q8_0 Q4_K_M Q4_0; do t "quant_q7b_$q" /tmp/g/b/bin/llama-quantize /tmp/g/m/q7b-F16.gguf /tmp/g/m/q7b-$q.gguf $q 16 & done
  for q in Q8_0 Q5_K_M Q4_K_M; do t "quant_l8b_$q" /tmp/g/b/bin/llama-quantize /tmp/g/m/l8b-F16.gguf /tmp/g/m/l8b-$q.gguf $q 16 & done
  wait
  ls -la /tmp/g/m | tee "$OUT/models.txt"
  # Single-stream decode and prefill as llama.cpp's own benchmark measures them (the published
  # figures the twin is checked against are llama-bench tg128), one model family per GPU.
  [ "${BENCH:-1}" = 0 ] && { rm -f /tmp/g/m/*-F16.gguf; exit 0; }
  for fam in q7b:0 l8b:1; do
    f=${fam%:*} gpu=${fam#*:}
    models=$(ls /tmp/g/m/$f-*.gguf | paste -sd,)
    CUDA_VISIBLE_DEVICES=$gpu /tmp/g/b/bin/llama-bench -m "$models" -p 512 -n 128 -fa 0,1 -r 5 -o json \
        >"$OUT/llama_bench_$f.json" 2>"$OUT/llama_bench_$f.log" &
  done
  wait
  echo "llama-bench done at $SECONDS s"; tail -n 2 "$OUT"/llama_bench_*.log
  rm -f /tmp/g/m/*-F16.gguf  # 31 GB the grids do not need
  ;;
grids)
  run=$1 secs=$2
  if [ "$run" = 1 ]; then gq=0 gl=1; else gq=1 gl=0; fi
  grid bench/h200_grid_qwen7b.toml $gq "$run" "$secs" 12 &
  grid bench/h200_grid_llama8b.toml $gl "$run" "$secs" 16 &
  wait
  ;;
seeds)
  # A quarter of each grid's measuring seconds (bench/results/h200_grids: 544 s and 445 s).
  for seed in "$@"; do
    for spec in qwen7b:0:136:12 llama8b:1:111:16; do
      IFS=: read -r g gpu secs leave <<<"$spec"
      name=h200_grid_$g-seed$seed
      sed -e "s/^sampler = \"grid\"/sampler = \"tpe\"\nprior = true/" -e "s/^seed = 0/seed = $seed/" \
          "bench/h200_grid_$g.toml" >"/tmp/g/$name.toml"
      (export CUDA_VISIBLE_DEVICES=$gpu  # for the holder and the study alike
       setsid python3 bench/hold_gpu_memory.py --leave-gib "$leave" >"$OUT/hold-$name.log" 2>&1 &
       holder=$!; sleep 20
       t "study-$name" "${AT[@]}" study "/tmp/g/$name.toml" --storage "sqlite:////tmp/g/db/$name.db" --budget "${secs}s" --json
       kill "$holder"; cp "/tmp/g/db/$name.db" "$OUT/") &
    done
    wait
  done
  ;;
llama-seeds)
  limit=${LIMIT:-570}
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .carry/whl/*.whl
  mkdir -p /tmp/g/src /tmp/g/m && tar xzf .carry/llama.cpp.tar.gz -C /tmp/g/src
  gunzip -c .carry/ggml-vocab-llama-bpe.gguf.gz >/tmp/g/ggml-vocab-llama-bpe.gguf
  build llama-server llama-quantize &
  synth_l8b &
  wait
  for q in Q8_0 Q5_K_M Q4_K_M; do t "quant_l8b_$q" /tmp/g/b/bin/llama-quantize /tmp/g/m/l8b-F16.gguf /tmp/g/m/l8b-$q.gguf $q 16 & done
  wait
  echo "prepared at $SECONDS s"
  gpu=0
  for seed in "$@"; do
    name=h200_grid_llama8b-seed$seed
    sed -e "s/^sampler = \"grid\"/sampler = \"tpe\"\nprior = true/" -e "s/^seed = 0/seed = $seed/" \
        bench/h200_grid_llama8b.toml >"/tmp/g/$name.toml"
    (export CUDA_VISIBLE_DEVICES=$gpu
     setsid python3 bench/hold_gpu_memory.py --leave-gib 16 >"$OUT/hold-$name.log" 2>&1 &
     holder=$!; sleep 20
     t "study-$name" timeout -s INT $((limit - SECONDS)) "${AT[@]}" study "/tmp/g/$name.toml" \
         --storage "sqlite:////tmp/g/db/$name.db" --budget 111s --json
     kill "$holder") &
    gpu=$((gpu + 1))
  done
  wait
  # Few files come back from a call: the storages and the logs, one archive each.
  (cd /tmp/g && tar czf "$OUT/llama-seeds.tgz" db/*.db)
  (cd "$OUT" && tar czf logs.tgz ./*.log times.txt && rm -f ./*.log)
  ;;
workers)
  # Two workers, one storage, one GPU each: the Llama grid should take about half its one-GPU
  # time (445 s) with no configuration measured twice, the finish's rounds shared out.
  sed "s/^name = .*/name = \"h200-grid-llama8b-2workers\"/" bench/h200_grid_llama8b.toml >/tmp/g/workers.toml
  for gpu in 0 1; do
    CUDA_VISIBLE_DEVICES=$gpu setsid python3 bench/hold_gpu_memory.py --leave-gib 16 >"$OUT/hold-w$gpu.log" 2>&1 &
  done
  sleep 20
  t0=$SECONDS
  pids=()
  for gpu in 0 1; do
    CUDA_VISIBLE_DEVICES=$gpu t "worker$gpu" "${AT[@]}" study /tmp/g/workers.toml --storage sqlite:////tmp/g/db/workers.db &
    pids+=($!)
  done
  wait "${pids[@]}"  # the workers only: a bare wait would wait for the holders too, for ever
  echo "two workers: $((SECONDS - t0)) s" | tee -a "$OUT/times.txt"
  pkill -f hold_gpu_memory.py; cp /tmp/g/db/workers.db "$OUT/"
  ;;
*) echo "unknown step $step" >&2; exit 2 ;;
esac
