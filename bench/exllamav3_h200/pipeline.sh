#!/usr/bin/env bash
# Issue 30 item 4 on one H200 as one detached pipeline: every device call (kind nvidia-h200,
# carry the .carry/ paths README.md names, made by bench/make_carry.sh; from the repository root) is
#
#   bash bench/exllamav3_h200/pipeline.sh 540
#
# which starts the pipeline in its own session if it is not running yet (it outlives the call
# while the machine stays warm), waits up to 540 s for it, and copies what it has so far to $OUT.
# Repeat the call until it prints "pipeline finished" (README.md: expected 2-3 calls). A fresh
# machine (the lease lapsed) starts again from nothing: /tmp/x3 is gone with it.
#
# Steps (each once: a marker under /tmp/x3/done; times in times.txt):
#   wheels     the carried wheels into /tmp/site: autotune's (.carry/whl) and exllamav3 1.6.5 with
#              what the image lacks of its dependencies (.carry/whl-exl3; missing_wheels.py: each
#              only if its modules do not import); the study file with the options below
#   in parallel:
#     exl3_jit   exllamav3's extension, JIT-compiled by its first import (sm_90 only, 14 jobs)
#     source     bench/artifacts_h200/build_qwen_source.py: random Qwen2.5-0.5B-shaped FP16 model
#                (SMALL=1, default; SMALL=0 the 1.5B shape) with Qwen2's own tokenizer (numpy +
#                safetensors, CPU); the directory keeps its name q15b either way
#     llama      (GGUF=1, default) autotune engine build llama.cpp --cuda-arch 90 from the carried tree
#     exl2_jit   (EXL2=1) ExLlamaV2's extension
#   artifacts  exl3:3.0, 4.0, 5.0 at once on the GPU, gguf:Q4_K_M (and exl2:4.0 with EXL2=1), each
#              by bench/exllamav3_h200/make_artifacts.py: the backends' own recipes into the
#              artifact cache the study reads
#   study      bench/h200_exl3_study.toml (grid, 16 trials; 18 with EXL2=1) while
#              bench/hold_gpu_memory.py leaves 24 GiB of the card (one physical budget)
#   table      bench/study_table.py (NVML against the memory model, per trial) and autotune best
#   kld        (KLD=1, default; issue 42) bench/exllamav3_h200/kld_artifacts.py: every artifact and cache
#              type of the study against its engine's full precision (exllamav3 and ExLlamaV2: the
#              source directory; llama.cpp: gguf:F16), after the speed results are safe; then the
#              table again with a KLD column. A failure here stops nothing before it
#   tabby_*    (TABBY=1; carry from make_tabby_carry.sh) TabbyAPI from its carried checkout, serving
#              the exl3:4.0 artifact through openai-server's tabbyapi-exllamav3 template: cache k4v4,
#              parallel 1 and 8, under the same budget (issue 30 item 3)
set -uo pipefail
W=/tmp/x3
DONE=$W/done
LOGS=$W/out
mkdir -p "$DONE" "$LOGS"
GGUF=${GGUF:-1}
EXL2=${EXL2:-0}
TABBY=${TABBY:-0}
SMALL=${SMALL:-1}
KLD=${KLD:-1}

if [ "${1:-}" != "--run" ]; then
  wait_s=${1:-540}
  OUT=${OUT:-/tmp/out}
  mkdir -p "$OUT"
  if [ ! -f "$W/pid" ] || ! kill -0 "$(cat "$W/pid")" 2>/dev/null; then
    if [ -f "$DONE/all" ]; then
      echo "pipeline already finished"
    else
      nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader
      rm -rf "$W/repo" && mkdir -p "$W/repo" && cp -r bench .carry "$W/repo/"
      GGUF=$GGUF EXL2=$EXL2 TABBY=$TABBY SMALL=$SMALL KLD=$KLD setsid bash "$W/repo/bench/exllamav3_h200/pipeline.sh" --run \
          >>"$LOGS/pipeline.log" 2>&1 < /dev/null &
      echo $! >"$W/pid"
      echo "pipeline started (pid $(cat "$W/pid")); GGUF=$GGUF EXL2=$EXL2 TABBY=$TABBY SMALL=$SMALL KLD=$KLD"
    fi
  else
    echo "pipeline running (pid $(cat "$W/pid"))"
  fi
  t0=$SECONDS
  while [ $((SECONDS - t0)) -lt "$wait_s" ] && [ -f "$W/pid" ] && kill -0 "$(cat "$W/pid")" 2>/dev/null; do
    sleep 5
  done
  [ -f "$DONE/all" ] && echo "pipeline finished"
  [ -f "$DONE/failed" ] && echo "pipeline FAILED: $(cat "$DONE/failed")"
  cat "$LOGS/times.txt" 2>/dev/null
  tail -n 20 "$LOGS/pipeline.log"
  # Few files come back: the results whole, everything else in one archive.
  for f in times.txt h200_exl3_study.md h200_exl3_study.json best.json study.db h200_exl3_kld.md h200_exl3_kld.json \
      h200_exl3_tabbyapi.md h200_exl3_tabbyapi.json tabby.db; do
    [ -f "$LOGS/$f" ] && cp "$LOGS/$f" "$OUT/"
  done
  tar czf "$OUT/logs.tgz" -C "$LOGS" --exclude=study.db --exclude=tabby.db . 2>/dev/null
  exit 0
fi

# ---------------------------------------------------------------- the pipeline itself
cd "$W/repo"
export PYTHONPATH=/tmp/site AUTOTUNE_ARTIFACTS_DIR=$W/artifacts CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
# exllamav3's JIT build: the H200's architecture only, its objects kept under $W so that a
# step run again reuses them (ninja), 14 of the 16 cores.
export TORCH_CUDA_ARCH_LIST=9.0 TORCH_EXTENSIONS_DIR=$W/torch_extensions MAX_JOBS=${MAX_JOBS:-14}
AT=(python3 -c 'import sys; from autotune.cli import main; sys.exit(main())')
STUDY=$W/study.toml
fail() { echo "$*" >"$DONE/failed"; echo "stopping: $*"; exit 1; }
step() {  # step NAME CMD...: once; its log in $LOGS/NAME.log, "NAME seconds rc" in times.txt
  local name=$1; shift
  [ -f "$DONE/$name" ] && { echo "$name: done before"; return 0; }
  echo "$name: start $(date +%T)"
  local t0=$EPOCHREALTIME rc=0
  "$@" >"$LOGS/$name.log" 2>&1 || rc=$?
  echo "$name $(awk "BEGIN{printf \"%.1f s\", $EPOCHREALTIME - $t0}") rc=$rc" >>"$LOGS/times.txt"
  tail -n 4 "$LOGS/$name.log"
  if [ $rc = 0 ]; then touch "$DONE/$name"; echo "$name: ok $(date +%T)"; else echo "$name: FAILED $(date +%T)"; fi
  return $rc
}

wheels() {
  python3 -V && python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)' || return 1
  command -v nvcc && nvcc --version | tail -n 2
  # exllamav3 1.6.5's METADATA: torch, tokenizers, numpy, rich, typing_extensions, safetensors,
  # ninja, pillow, pyyaml, marisa_trie, pydantic (llguidance only for grammar filters). The image's
  # own are kept: of the carried dependencies, only those whose modules do not import.
  local want=(.carry/whl/*.whl)
  mapfile -t -O ${#want[@]} want < <(python3 bench/exllamav3_h200/missing_wheels.py .carry/whl-exl3 --always exllamav3)
  [ "$EXL2" = 1 ] && want+=(.carry/whl-exl2/*.whl)
  # scipy (autotune's calibration) and llama.cpp's converter's transformers, where carried and missing.
  for d in whl-scipy whl-convert; do
    [ -d ".carry/$d" ] && mapfile -t -O ${#want[@]} want < <(python3 bench/exllamav3_h200/missing_wheels.py ".carry/$d")
  done
  printf '%s\n' "${want[@]}"
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "${want[@]}" || return 1
  python3 -c 'import importlib.util as u; import tokenizers, safetensors, ninja, rich, PIL, numpy, yaml, marisa_trie, pydantic, autotune
assert u.find_spec("exllamav3"); print("dependencies ok; numpy", numpy.__version__, "pydantic", pydantic.VERSION)' || return 1
  cp bench/h200_exl3_study.toml "$STUDY"
  if [ "$EXL2" = 1 ]; then cat >>"$STUDY" <<'TOML'

[[candidates]]
backend = "exllamav2"
weights = ["exl2:4.0"]

[backends.exllamav2]
load_timeout_s = 600
unpaged_parallel = "queue"
convert_args = ["-l", "512", "-ml", "512", "-hsol", "16"]
TOML
  fi
  if [ "$GGUF" != 1 ]; then  # no llama-server: drop its candidate
    python3 - "$STUDY" <<'PY'
import re, sys
p = sys.argv[1]
s = open(p).read()
s = re.sub(r'\[\[candidates\]\]\nbackend = "llama-server"\nweights = \[[^\]]*\]\n\n', "", s)
open(p, "w").write(s)
PY
  fi
}

exl3_jit() {
  python3 -c 'import time; t = time.time()
from exllamav3.ext import exllamav3_ext
from exllamav3.version import __version__
print("exllamav3", __version__, "extension ready in", round(time.time() - t), "s")'
}

source_model() {
  gunzip -c .carry/ggml-vocab-qwen2.gguf.gz >"$W/ggml-vocab-qwen2.gguf" &&
    python3 bench/artifacts_h200/build_qwen_source.py "$W/ggml-vocab-qwen2.gguf" "$W/q15b" \
      $([ "$SMALL" = 1 ] && echo --small) && ls -la "$W/q15b"
}

llama() {
  # The carried llama.cpp tree as an extracted llama-cpp-python sdist, so that `engine build`
  # runs offline (bench/h200_artifacts.sh does the same).
  mkdir -p "$W/sdist/vendor/llama.cpp" && tar xzf .carry/llama.cpp.tar.gz -C "$W/sdist/vendor/llama.cpp" &&
    printf 'Metadata-Version: 2.1\nName: llama_cpp_python\nVersion: 0.3.36\n' >"$W/sdist/PKG-INFO" &&
    "${AT[@]}" engine build llama.cpp --cuda-arch 90 --sdist "$W/sdist"
}

step wheels wheels || fail "wheels"
step exl3_jit exl3_jit & j=$!
step source source_model & s=$!
l=""; [ "$GGUF" = 1 ] && { step llama llama & l=$!; }
x=""; [ "$EXL2" = 1 ] && { step exl2_jit python3 -c 'from exllamav2 import ext; print("exllamav2 extension ready")' & x=$!; }
wait $j; wait $s; [ -n "$l" ] && wait $l; [ -n "$x" ] && wait $x
for n in exl3_jit source; do [ -f "$DONE/$n" ] || fail "$n (log: $n.log)"; done
[ "$GGUF" = 1 ] && { [ -f "$DONE/llama" ] || fail "llama (log: llama.log)"; }
[ "$EXL2" = 1 ] && { [ -f "$DONE/exl2_jit" ] || fail "exl2_jit (log: exl2_jit.log)"; }

MAKE=(python3 bench/exllamav3_h200/make_artifacts.py "$STUDY")
pids=()
for b in 3.0 4.0 5.0; do step "make_exl3_$b" "${MAKE[@]}" exllamav3 "exl3:$b" & pids+=($!); done
[ "$GGUF" = 1 ] && { step make_gguf "${MAKE[@]}" llama-server gguf:Q4_K_M & pids+=($!); }
[ "$EXL2" = 1 ] && { step make_exl2 "${MAKE[@]}" exllamav2 exl2:4.0 & pids+=($!); }
for p in "${pids[@]}"; do wait "$p"; done
for n in make_exl3_3.0 make_exl3_4.0 make_exl3_5.0; do [ -f "$DONE/$n" ] || fail "$n (log: $n.log)"; done
grep -h '^{' "$LOGS"/make_*.log >"$LOGS/artifacts.jsonl" 2>/dev/null

# One physical budget: the holder takes all but 24 GiB of the card for the whole study.
python3 bench/hold_gpu_memory.py --leave-gib 24 >"$LOGS/hold.log" 2>&1 & holder=$!
sleep 15; cat "$LOGS/hold.log"
step study "${AT[@]}" study "$STUDY" --storage "sqlite:///$LOGS/study.db"
kill "$holder" 2>/dev/null; wait "$holder" 2>/dev/null
[ -f "$DONE/study" ] || fail "study (log: study.log)"
step table python3 bench/study_table.py "sqlite:///$LOGS/study.db" --study h200-exl3 --gpu h200 \
    --json "$LOGS/h200_exl3_study.json" --md "$LOGS/h200_exl3_study.md" || fail "table"
"${AT[@]}" best --storage "sqlite:///$LOGS/study.db" --study h200-exl3 --json >"$LOGS/best.json" 2>>"$LOGS/table.log"

if [ "$KLD" = 1 ]; then
  # Issue 42: the quality column. Each engine's own full precision is its reference (exllamav3 and
  # ExLlamaV2 load the source directory as it is, the default; llama.cpp's is the F16 GGUF its
  # Q4_K_M was quantized from, in the artifact cache already). Rows that fail say so in the JSON.
  refs=()
  [ "$GGUF" = 1 ] && refs+=(--reference "llama-server=gguf:F16")
  step kld python3 bench/exllamav3_h200/kld_artifacts.py "$STUDY" ${refs[@]+"${refs[@]}"} \
      --json "$LOGS/h200_exl3_kld.json" --md "$LOGS/h200_exl3_kld.md"
  [ -f "$LOGS/h200_exl3_kld.json" ] && python3 bench/study_table.py "sqlite:///$LOGS/study.db" --study h200-exl3 \
      --gpu h200 --kld "$LOGS/h200_exl3_kld.json" --json "$LOGS/h200_exl3_study.json" --md "$LOGS/h200_exl3_study.md" \
      >>"$LOGS/kld.log" 2>&1
fi

tabby_setup() {
  local want=()
  mapfile -t want < <(python3 bench/exllamav3_h200/missing_wheels.py .carry/whl-tabby)
  printf '%s\n' "${want[@]}"
  [ ${#want[@]} = 0 ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "${want[@]}" ||
    return 1
  rm -rf "$W/tabby" && mkdir -p "$W/tabby" && tar xzf .carry/tabbyAPI.tar.gz -C "$W/tabby" || return 1
  local weights
  weights=$(python3 -c 'import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    if r["format"] == "exl3:4.0": print(r["path"])' "$LOGS/artifacts.jsonl") || return 1
  [ -d "$weights" ] || { echo "no exl3:4.0 artifact in artifacts.jsonl"; return 1; }
  # The shipped template, its main.py made the checkout's (TabbyAPI imports its packages from
  # the script's directory, so any working directory serves).
  # (The pipeline's copy of the repository holds bench/ only: the template comes from the wheel.)
  sed "s|\"python3\", \"main.py\"|\"python3\", \"$W/tabby/tabbyAPI/main.py\"|" \
      /tmp/site/autotune_plugins/openai_server/templates/tabbyapi-exllamav3.toml >"$W/tabby-template.toml" || return 1
  grep -n "main.py" "$W/tabby-template.toml"
  cat >"$W/tabby_study.toml" <<TOML
[study]
name = "h200-exl3-tabbyapi"
seed = 0
sampler = "grid"
finish_top = 0

[hardware]
gpu = "auto"
vram_budget_gib = 20
safety_margin_mib = 512

[model]
ref = "$weights"

[workload]
prompt_tokens = 512
output_tokens = 128

[measure]
warmup_runs = 1
min_runs = 2
max_runs = 3
rel_spread_tol = 0.05

[[candidates]]
backend = "openai-server"
weights = ["$weights"]

[space]
ctx = [1024]
cache_type = ["k4v4"]
parallel = [1, 8]

[backends.openai-server]
template = "$W/tabby-template.toml"
startup_timeout_s = 900
TOML
  cat "$W/tabby_study.toml"
}

if [ "$TABBY" = 1 ]; then
  # Item 3 after the results above are safe: a failure here stops nothing that came before.
  if step tabby_setup tabby_setup; then
    python3 bench/hold_gpu_memory.py --leave-gib 24 >"$LOGS/hold_tabby.log" 2>&1 & holder=$!
    sleep 15
    step tabby_study "${AT[@]}" study "$W/tabby_study.toml" --storage "sqlite:///$LOGS/tabby.db"
    kill "$holder" 2>/dev/null; wait "$holder" 2>/dev/null
    step tabby_table python3 bench/study_table.py "sqlite:///$LOGS/tabby.db" --study h200-exl3-tabbyapi --gpu h200 \
        --json "$LOGS/h200_exl3_tabbyapi.json" --md "$LOGS/h200_exl3_tabbyapi.md"
  fi
fi
touch "$DONE/all"
echo "all done $(date +%T)"
