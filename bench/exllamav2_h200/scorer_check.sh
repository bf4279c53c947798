#!/usr/bin/env bash
# Issue 7, item 2 on a GPU: ExLlamaV2's scorer against transformers on a tiny random Qwen2
# (scorer_check.py says what is compared). One device call, kind nvidia-h200-x2, carry
# [".carry"], from the repository root: bash bench/exllamav2_h200/scorer_check.sh
# Wheels; ExLlamaV2's JIT build beside the tiny model; EXL2 8.0 (GPU 0) and 4.0 (GPU 1) at
# once, each with its own measurement pass; then the check. Results under $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/out}
T=/tmp/t
mkdir -p "$T" "$OUT"
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .carry/whl/*.whl .carry/whl-exl2/*.whl
s0=$SECONDS
OUT=$OUT bash bench/exllamav2_h200/steps.sh jit >/dev/null 2>&1 &
OUT=$OUT python3 bench/exllamav2_h200/build_model.py "$T/fp16" --tiny >"$OUT/model.txt" 2>&1
wait
echo "jit + tiny model $((SECONDS - s0)) s" | tee -a "$OUT/times.txt"
for b in 8.0 4.0; do
  gpu=0; [ "$b" = 4.0 ] && gpu=1
  ( t0=$SECONDS; CUDA_VISIBLE_DEVICES=$gpu python3 -m exllamav2.conversion.convert_exl2 -i "$T/fp16" -o "$T/w-$b" \
      -nr -b "$b" -cf "$T/exl2-$b" >"$T/conv_$b.log" 2>&1
    echo "convert $b: $((SECONDS - t0)) s rc=$?" >>"$OUT/times.txt"; tail -n 4 "$T/conv_$b.log" >>"$OUT/conv.log" ) &
done
wait
cat "$OUT/times.txt"
CUDA_VISIBLE_DEVICES=0 python3 bench/exllamav2_h200/scorer_check.py "$T/fp16" "$T/exl2-8.0" "$T/exl2-8.0:q4" \
    "$T/exl2-4.0" --out "$OUT/scorer_check.json" 2>&1 | tail -n 30 | tee "$OUT/scorer_check.txt"
echo "total $((SECONDS - s0)) s" | tee -a "$OUT/times.txt"
