#!/usr/bin/env bash
# Issue 29 item 6: a chat and a RAG profile on the same model and budget, on one device machine
# (kind nvidia-h200, carry [".carry/whl", ".carry/whl-scipy", ".carry/llama.cpp.tar.gz",
# ".carry/ggml-vocab-qwen2.gguf.gz"] made by bench/make_carry.sh), in back-to-back calls while
# the machine stays warm (everything lives under /tmp/w):
#   bash bench/h200_workloads.sh prep          # sm_90 build of the carried tree; a random-weight
#                                              # Qwen2.5-1.5B-shaped GGUF (F16)
#   bash bench/h200_workloads.sh study chat 270 ; bash bench/h200_workloads.sh study rag 270
#                                              # bench/h200_workload_NAME.toml, stopped by SIGINT
#                                              # at the limit (a later call resumes it)
# Storages, logs and each study's --json go to $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /tmp/w/src /tmp/w/m /tmp/w/db
# -P: the working tree's autotune/ must not shadow the carried wheel (python -c puts the cwd first)
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
AT=(python3 -P -c 'import sys; from autotune.cli import main; sys.exit(main())')
t() { local n=$1; shift; local t0=$SECONDS; "$@" >"$OUT/$n.log" 2>&1; local rc=$?; echo "$n $((SECONDS - t0)) s rc=$rc" | tee -a "$OUT/times.txt"; tail -n 3 "$OUT/$n.log"; }

case "${1:-}" in
prep)
  python3 -V; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nproc
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .carry/whl/*.whl
  python3 -c 'import scipy' 2>/dev/null || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .carry/whl-scipy/*.whl
  tar xzf .carry/llama.cpp.tar.gz -C /tmp/w/src
  gunzip -c .carry/ggml-vocab-qwen2.gguf.gz >/tmp/w/ggml-vocab-qwen2.gguf
  t build bash -c "cmake -S /tmp/w/src -B /tmp/w/gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF \
      -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_UI=OFF \
      -DLLAMA_USE_PREBUILT_UI=OFF -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 && ninja -C /tmp/w/gpu llama-server" &
  t synth "${AT[@]}" synth --arch qwen2 --layers 28 --hidden 1536 --heads 12 --kv-heads 2 --ffn 8960 \
      --ctx 32768 --tie-embeddings --vocab-from /tmp/w/ggml-vocab-qwen2.gguf --out /tmp/w/m/q15b.gguf &
  wait
  ls -la /tmp/w/m /tmp/w/gpu/bin/llama-server | tee "$OUT/models.txt"
  ;;
study)
  name=$2 secs=${3:-270} db=h200_workload_$2
  [ -f "/tmp/w/db/$db.db" ] || [ ! -f "bench/results/workloads_h200/$db.db" ] || \
      cp "bench/results/workloads_h200/$db.db" "/tmp/w/db/$db.db"
  # SIGINT before the call's limit: the study stops cleanly and its storage comes back.
  t "study-$name" timeout -s INT "$secs" "${AT[@]}" study "bench/h200_workload_$name.toml" \
      --storage "sqlite:////tmp/w/db/$db.db" --budget "$((secs - 30))s" --json
  cp "/tmp/w/db/$db.db" "$OUT/"
  "${AT[@]}" best "bench/h200_workload_$name.toml" --storage "sqlite:////tmp/w/db/$db.db" >"$OUT/best-$name.txt" 2>&1
  "${AT[@]}" report "bench/h200_workload_$name.toml" --storage "sqlite:////tmp/w/db/$db.db" \
      --out "$OUT/report-$name.html" >/dev/null 2>&1
  tail -n 30 "$OUT/study-$name.log"
  ;;
*) echo "usage: $0 prep | study NAME [SECS]" >&2; exit 2 ;;
esac
