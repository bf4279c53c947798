#!/usr/bin/env bash
# Issue 17 on the H200 through the device tool (kind nvidia-h200, carry [".carry"], made by
# `CONVERT=1 bash bench/make_carry.sh`: the converter's wheels too), one step per call while the machine stays warm (everything under /tmp/g):
#   bash bench/h200_artifacts.sh prep    # wheels; `autotune engine build llama.cpp --cuda-arch 90`
#                                        # from the carried tree (offline, --sdist); ExLlamaV2's JIT
#                                        # build; the HF source (build_qwen_source.py)
#   bash bench/h200_artifacts.sh study   # bench/h200_artifacts_study.toml: each format made by the
#                                        # first trial that needs it, then the study again on a
#                                        # fresh storage (it must make nothing: cache hits only)
#   bash bench/h200_artifacts.sh report  # the trials and each artifact's path, sha256 and seconds
#                                        # to make, as bench/results/h200_artifacts*.{json,md}
# A step cut off by the call's limit resumes where it stopped when called again: the engine
# build and the artifact cache keep what is finished, and the study continues its storage.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /tmp/g/db
export PYTHONPATH=/tmp/site AUTOTUNE_ARTIFACTS_DIR=/tmp/g/artifacts CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
AT=(python3 -c 'import sys; from autotune.cli import main; sys.exit(main())')
t() { local n=$1; shift; local t0=$SECONDS; "$@" >"$OUT/$n.log" 2>&1; local rc=$?; echo "$n $((SECONDS - t0)) s rc=$rc" | tee -a "$OUT/times.txt"; tail -n 3 "$OUT/$n.log"; }

step=$1; shift
case $step in
prep)
  python3 -V; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
      .carry/whl/*.whl .carry/whl-exl2/*.whl .carry/whl-convert/*.whl
  python3 -c 'import scipy' 2>/dev/null || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .carry/whl-scipy/*.whl
  python3 -c 'import scipy, transformers, sentencepiece, autotune; print("transformers", transformers.__version__)'
  # The carried llama.cpp tree as an extracted llama-cpp-python sdist, so that `engine build`
  # runs offline and records its source tree (convert_hf_to_gguf.py and gguf-py) beside the build.
  if [ ! -f /tmp/g/sdist/vendor/llama.cpp/CMakeLists.txt ]; then
    mkdir -p /tmp/g/sdist/vendor/llama.cpp && tar xzf .carry/llama.cpp.tar.gz -C /tmp/g/sdist/vendor/llama.cpp
    printf 'Metadata-Version: 2.1\nName: llama_cpp_python\nVersion: 0.3.36\n' >/tmp/g/sdist/PKG-INFO
  fi
  t engine_build "${AT[@]}" engine build llama.cpp --cuda-arch 90 --sdist /tmp/g/sdist &
  t exl2_jit python3 -c 'import time; t=time.time(); from exllamav2 import ext; print("ext built in", round(time.time()-t), "s")' &
  vocab=.carry/ggml-vocab-qwen2.gguf
  if [ -f "$vocab.gz" ]; then gunzip -c "$vocab.gz" >/tmp/g/ggml-vocab-qwen2.gguf; vocab=/tmp/g/ggml-vocab-qwen2.gguf; fi
  t source python3 bench/artifacts_h200/build_qwen_source.py "$vocab" /tmp/g/q15b &
  wait
  ls -la /tmp/g/q15b | tee "$OUT/source.txt"
  ;;
study)
  t plugins "${AT[@]}" plugins
  t study "${AT[@]}" study bench/h200_artifacts_study.toml --storage sqlite:////tmp/g/db/first.db
  grep -E "^artifact |exl2 measurement" "$OUT/study.log" | tee "$OUT/making.txt"
  cp /tmp/g/db/first.db "$OUT/h200_artifacts_first.db"
  sed 's/^name = "h200-artifacts"/name = "h200-artifacts-again"/' bench/h200_artifacts_study.toml >/tmp/g/again.toml
  t study_again "${AT[@]}" study /tmp/g/again.toml --storage sqlite:////tmp/g/db/again.db
  echo "second run, lines that made something (must be none):"; grep -c ": making " "$OUT/study_again.log"
  grep -c "cache hit" "$OUT/study_again.log"
  cp /tmp/g/db/again.db "$OUT/h200_artifacts_again.db"
  find /tmp/g/artifacts -name '*.json' -newer /tmp/g/q15b/config.json -exec cat {} + >"$OUT/artifact_records.json"
  du -sh /tmp/g/artifacts/*/* | tee "$OUT/artifact_sizes.txt"
  ;;
report)
  t best "${AT[@]}" best --storage sqlite:////tmp/g/db/first.db --json
  cp "$OUT/best.log" "$OUT/h200_artifacts_best.json"
  t table python3 bench/study_table.py sqlite:////tmp/g/db/first.db --study h200-artifacts --gpu h200 \
      --json "$OUT/h200_artifacts.json" --md "$OUT/h200_artifacts.md"
  ;;
*) echo "unknown step $step" >&2; exit 2 ;;
esac
