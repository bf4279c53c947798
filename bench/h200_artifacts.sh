#!/usr/bin/env bash
# Issue 17 on the H200 through the device tool (kind nvidia-h200-x2 for its 32 cores; carry
# [".carry"], made by bench/make_carry.sh). Every call runs
#   bash bench/h200_artifacts.sh all
# which does what is not done yet, in order, until the call's time is nearly spent (DEADLINE_S,
# 560 s of the 600 s a call may take), everything under /tmp/g (kept while the machine is warm):
#   prep     wheels; `autotune engine build llama.cpp --cuda-arch 90` from the carried tree
#            (offline, --sdist) | ExLlamaV2's JIT build | the HF source (build_qwen_source.py),
#            the three at once
#   study    bench/h200_artifacts_study.toml: each format made by the first trial that needs it;
#            cut off by the deadline, it is interrupted (its storage consistent) and the next
#            call continues it
#   report   `autotune best` and the per-trial table (bench/study_table.py)
#   again    (AGAIN=1) the study on a fresh storage, TRIALS_AGAIN launches: it must make nothing
# Each call returns at most 8 files: $OUT/<step>.tgz with that step's logs and storages, and
# $OUT/times.txt.
set -uo pipefail
OUT=${OUT:-/tmp/out}
DEADLINE_S=${DEADLINE_S:-560}
LOGS=/tmp/g/logs
mkdir -p "$OUT" "$LOGS" /tmp/g/db
export PYTHONPATH=/tmp/site AUTOTUNE_ARTIFACTS_DIR=/tmp/g/artifacts CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
AT=(python3 -c 'import sys; from autotune.cli import main; sys.exit(main())')
left() { echo $((DEADLINE_S - SECONDS)); }
t() { local n=$1; shift; local t0=$SECONDS; "$@" >"$LOGS/$n.log" 2>&1; local rc=$?
      echo "$n $((SECONDS - t0)) s rc=$rc" | tee -a "$LOGS/times.txt"; tail -n 4 "$LOGS/$n.log"; return $rc; }
pack() { cp "$LOGS/times.txt" "$OUT/times.txt" 2>/dev/null; for s in prep study report again; do
           [ -d "$LOGS/$s" ] && tar czf "$OUT/$s.tgz" -C "$LOGS" "$s"; done; }
trap pack EXIT

prep() {
  [ -f /tmp/g/prep.ok ] && return 0
  mkdir -p "$LOGS/prep"
  python3 -V; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .carry/whl/*.whl .carry/whl-exl2/*.whl || return 1
  python3 -c 'import scipy, transformers, sentencepiece, autotune; print("transformers", transformers.__version__)' || return 1
  # The carried llama.cpp tree as an extracted llama-cpp-python sdist, so that `engine build`
  # runs offline and keeps its source tree (convert_hf_to_gguf.py and gguf-py) beside the build.
  if [ ! -f /tmp/g/sdist/vendor/llama.cpp/CMakeLists.txt ]; then
    mkdir -p /tmp/g/sdist/vendor/llama.cpp && tar xzf .carry/llama.cpp.tar.gz -C /tmp/g/sdist/vendor/llama.cpp
    printf 'Metadata-Version: 2.1\nName: llama_cpp_python\nVersion: 0.3.36\n' >/tmp/g/sdist/PKG-INFO
  fi
  gunzip -c .carry/ggml-vocab-qwen2.gguf.gz >/tmp/g/ggml-vocab-qwen2.gguf
  t prep/engine_build "${AT[@]}" engine build llama.cpp --cuda-arch 90 --sdist /tmp/g/sdist & b=$!
  t prep/exl2_jit python3 -c 'import time; t=time.time(); from exllamav2 import ext; print("ext built in", round(time.time()-t), "s")' & j=$!
  t prep/source python3 bench/artifacts_h200/build_qwen_source.py /tmp/g/ggml-vocab-qwen2.gguf /tmp/g/q15b & s=$!
  wait $b && wait $j && wait $s || return 1
  ls -la /tmp/g/q15b >"$LOGS/prep/source_files.txt"
  touch /tmp/g/prep.ok
}

study() {
  [ -f /tmp/g/study.ok ] && return 0
  mkdir -p "$LOGS/study"
  [ "$(left)" -gt 60 ] || { echo "study: too little of this call left; call again"; return 1; }
  [ -f "$LOGS/study/plugins.log" ] || t study/plugins "${AT[@]}" plugins
  local n; n=$(ls "$LOGS/study"/run*.log 2>/dev/null | wc -l)
  # SIGTERM at the deadline: the study stops as on Ctrl-C and the next call continues it.
  t "study/run$n" timeout -s TERM "$(left)" "${AT[@]}" study bench/h200_artifacts_study.toml \
      --storage sqlite:////tmp/g/db/first.db --json || { cp /tmp/g/db/first.db "$LOGS/study/"; return 1; }
  cp /tmp/g/db/first.db "$LOGS/study/"
  find /tmp/g/artifacts -name '*.json' -exec sh -c 'for f; do echo "== $f"; cat "$f"; echo; done' _ {} + \
      >"$LOGS/study/artifact_records.txt"
  du -sb /tmp/g/artifacts/*/*/* >"$LOGS/study/artifact_sizes.txt"
  touch /tmp/g/study.ok
}

report() {
  [ -f /tmp/g/report.ok ] && return 0
  mkdir -p "$LOGS/report"
  t report/best "${AT[@]}" best --storage sqlite:////tmp/g/db/first.db --study h200-artifacts --json || return 1
  t report/table python3 bench/study_table.py sqlite:////tmp/g/db/first.db --study h200-artifacts --gpu h200 \
      --json "$LOGS/report/h200_artifacts.json" --md "$LOGS/report/h200_artifacts.md" || return 1
  touch /tmp/g/report.ok
}

again() {
  [ "${AGAIN:-0}" = 1 ] || return 0
  [ -f /tmp/g/again.ok ] && return 0
  mkdir -p "$LOGS/again"
  [ "$(left)" -gt 60 ] || { echo "again: too little of this call left; call again"; return 1; }
  sed 's/^name = "h200-artifacts"/name = "h200-artifacts-again"/' bench/h200_artifacts_study.toml >/tmp/g/again.toml
  t again/run timeout -s TERM "$(left)" "${AT[@]}" study /tmp/g/again.toml --storage sqlite:////tmp/g/db/again.db \
      --trials "${TRIALS_AGAIN:-8}" || return 1
  cp /tmp/g/db/again.db "$LOGS/again/"
  { echo "lines that made something (must be 0): $(grep -c ': making ' "$LOGS/again/run.log")"
    echo "cache hits: $(grep -c 'cache hit' "$LOGS/again/run.log")"; } | tee "$LOGS/again/hits.txt"
  touch /tmp/g/again.ok
}

case ${1:-} in
all) prep && study && report && again; rc=$?; pkill -f "[a]utotune.cli" ; exit $rc ;;
*) echo "usage: bash bench/h200_artifacts.sh all" >&2; exit 2 ;;
esac
