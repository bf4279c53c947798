#!/usr/bin/env bash
# The ExLlamaV2 H200 run of issue 7, one step per call so that each stays well under the
# device's 10-minute limit. Run from the repository root on the device:
#   bash bench/exllamav2_h200/steps.sh setup      # ~5 min: wheels + ExLlamaV2's JIT build (~4.5 min)
#   bash bench/exllamav2_h200/steps.sh jit        # the JIT build alone (wheels already on PYTHONPATH)
#   bash bench/exllamav2_h200/steps.sh model      # ~1 min: random Qwen2.5-1.5B-shaped FP16 model
#   bash bench/exllamav2_h200/steps.sh measure    # EXL2 measurement pass, once for every bpw
#   bash bench/exllamav2_h200/steps.sh exl2       # 3.3 / 4.0 / 5.0 bpw reusing that measurement
#   bash bench/exllamav2_h200/steps.sh gguf       # F16 GGUF + Q4_K_M (LLAMA_SRC, LLAMA_BIN)
#   bash bench/exllamav2_h200/steps.sh study      # the study of bench/h200_exllamav2_study.toml
# Work files go under $WORK (default /tmp/x: the study file names its paths there); timings
# and logs under $OUT. A fresh machine loses /tmp/x and the JIT build: run the steps in one
# warm lease, or chain them in one call ("setup model measure" fits in 10 min on the first).
set -euo pipefail
WORK=${WORK:-/tmp/x}
OUT=${OUT:-$WORK/out}
PY=${PY:-python3}
LLAMA_SRC=${LLAMA_SRC:-/tmp/p/src}          # llama.cpp source tree (convert_hf_to_gguf.py)
LLAMA_BIN=${LLAMA_BIN:-/tmp/p/b/bin}        # its CUDA build (llama-quantize, llama-server)
HERE=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$WORK/m" "$OUT"
BASE=$WORK/m/q15b-fp16
BPWS=${BPWS:-"3.3 4.0 5.0"}

timed() {  # timed NAME CMD...: run, log to $OUT/NAME.log, append "NAME seconds rc" to $OUT/times.txt
  local name=$1; shift
  local t0=$EPOCHREALTIME rc=0
  "$@" >"$OUT/$name.log" 2>&1 || rc=$?
  echo "$name $(awk "BEGIN{printf \"%.1f s\", $EPOCHREALTIME - $t0}") rc=$rc" | tee -a "$OUT/times.txt"
  tail -n 5 "$OUT/$name.log"
  return $rc
}

for step in "$@"; do
case $step in
setup)
  $PY -V
  $PY -c 'import sys; sys.exit(0 if sys.version_info[:2] == (3, 12) else "the carried wheels are cp312; this python is %d.%d: pip download them again for it (README)" % sys.version_info[:2])'
  ls .carry/whl-exl2/*.whl
  $PY -m pip install --no-index --no-deps .carry/whl-exl2/*.whl
  $PY -c 'import pandas, rich, pygments, PIL, regex, fastparquet, websockets, tokenizers, safetensors, ninja, pynvml; print("deps ok")'
  bash "$0" jit
  ;;
jit)
  # ExLlamaV2 0.3.2 JIT-compiles exllamav2_ext with ninja/nvcc at first import (~4.5 min).
  timed jit_build $PY -c 'import time; t=time.time(); from exllamav2 import ext; import exllamav2.attn as a; print("ext built in", round(time.time()-t), "s; flash_attn", a.has_flash_attn, "paged", a.has_flash_attn_with_paged, "xformers", a.has_xformers, "sdpa_lower_right", a.has_lower_right_sdpa)'
  ;;
model)
  timed build_model $PY "$HERE/build_model.py" "$BASE"
  ;;
measure)
  timed exl2_measure $PY -m exllamav2.conversion.convert_exl2 -i "$BASE" -o "$WORK/exl2-work-measure" \
    -nr -om "$WORK/m/measurement.json"
  ;;
exl2)
  for b in $BPWS; do
    timed "exl2_quant_$b" $PY -m exllamav2.conversion.convert_exl2 -i "$BASE" -o "$WORK/exl2-work-$b" -nr \
      -m "$WORK/m/measurement.json" -b "$b" -cf "$WORK/m/q15b-exl2-$b"
    rm -rf "$WORK/exl2-work-$b"
    du -sb "$WORK/m/q15b-exl2-$b"/*.safetensors | tee -a "$OUT/sizes.txt"
  done
  ;;
gguf_synth)
  # Fallback when the converter fails: the same shape with its own random weights.
  timed gguf_synth_f16 $PY -c 'import sys; from autotune.cli import main; sys.exit(main())' synth --arch qwen2 \
    --layers 28 --hidden 1536 --heads 12 --kv-heads 2 --ffn 8960 --ctx 32768 \
    --vocab-from "${VOCAB:-.carry/ggml-vocab-qwen2.gguf}" --out "$WORK/m/q15b-synth-F16.gguf"
  timed gguf_q4km "$LLAMA_BIN/llama-quantize" "$WORK/m/q15b-synth-F16.gguf" "$WORK/m/q15b-Q4_K_M.gguf" Q4_K_M
  du -sb "$WORK/m/q15b-Q4_K_M.gguf" | tee -a "$OUT/sizes.txt"
  ;;
gguf)
  timed gguf_f16 $PY "$HERE/gguf_from_hf.py" "$LLAMA_SRC" "$BASE" "$WORK/m/q15b-F16.gguf"
  timed gguf_q4km "$LLAMA_BIN/llama-quantize" "$WORK/m/q15b-F16.gguf" "$WORK/m/q15b-Q4_K_M.gguf" Q4_K_M
  du -sb "$WORK/m/q15b-Q4_K_M.gguf" | tee -a "$OUT/sizes.txt"
  ;;
study)
  # One Optuna study over both engines (grid sampler: every configuration once).
  timed study $PY -c 'import sys; from autotune.cli import main; sys.exit(main())' study bench/h200_exllamav2_study.toml --storage "sqlite:///$OUT/study.db"
  ;;
*)
  echo "unknown step '$step' (steps: setup jit model measure exl2 gguf gguf_synth study)" >&2; exit 2
  ;;
esac
done
