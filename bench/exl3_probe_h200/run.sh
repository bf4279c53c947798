#!/usr/bin/env bash
# exllamav3 1.6.5 on one H200, before the backend is trusted with it (issue 30): how long its
# JIT build takes, how long EXL3 conversion of a 0.5B model takes at two bitrates, and what
# decode speed and memory it gives per cache mode (probe.py). One device call (kind
# nvidia-h200, carry [".carry"] with .carry/whl-exl3 from bench/make_carry.sh), repeated until
# it prints "probe finished":
#
#   bash bench/exl3_probe_h200/run.sh 560
#
# The steps run detached in their own session (they outlive a call while the machine is
# warm); each call waits up to its argument in seconds and copies what there is to $OUT.
set -uo pipefail
W=/tmp/x3
DONE=$W/done
LOGS=$W/out
mkdir -p "$DONE" "$LOGS" "$W/m"

if [ "${1:-}" != "--run" ]; then
  wait_s=${1:-560}
  OUT=${OUT:-/tmp/out}
  mkdir -p "$OUT"
  if [ ! -f "$W/pid" ] || ! kill -0 "$(cat "$W/pid")" 2>/dev/null; then
    if [ -f "$DONE/all" ]; then echo "probe already finished"; else
      nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader
      rm -rf "$W/repo" && mkdir -p "$W/repo" && cp -r bench .carry "$W/repo/"
      setsid bash "$W/repo/bench/exl3_probe_h200/run.sh" --run >"$LOGS/run.log" 2>&1 < /dev/null &
      echo $! >"$W/pid"; echo "probe started (pid $(cat "$W/pid"))"
    fi
  else echo "probe running (pid $(cat "$W/pid"))"; fi
  t0=$SECONDS
  while [ $((SECONDS - t0)) -lt "$wait_s" ] && [ -f "$W/pid" ] && kill -0 "$(cat "$W/pid")" 2>/dev/null; do sleep 5; done
  [ -f "$DONE/all" ] && echo "probe finished"
  cat "$LOGS/times.txt" 2>/dev/null; cat "$LOGS/exl3_probe.jsonl" 2>/dev/null
  tail -n 20 "$LOGS/run.log"
  ls "$W"/ext/*/ 2>/dev/null | head; find "$W/ext" -name '*.so' -exec ls -la {} \; 2>/dev/null
  cp "$LOGS"/times.txt "$LOGS"/exl3_probe.jsonl "$OUT/" 2>/dev/null
  tar czf "$OUT/logs.tgz" -C "$LOGS" . 2>/dev/null
  exit 0
fi

cd "$W/repo"
export PYTHONPATH=/tmp/site3 OUT=$LOGS TORCH_EXTENSIONS_DIR=$W/ext TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16
P=bench/exl3_probe_h200/probe.py
step() {  # step NAME CMD...: once; a marker says it succeeded; its time goes to times.txt
  local name=$1; shift
  [ -f "$DONE/$name" ] && { echo "$name: done before"; return 0; }
  echo "$name: start $(date +%T)"; local t=$SECONDS
  if "$@" >"$LOGS/$name.log" 2>&1; then touch "$DONE/$name"; echo "$name $((SECONDS - t)) s rc=0" >>"$LOGS/times.txt"
  else echo "$name $((SECONDS - t)) s rc=$?" >>"$LOGS/times.txt"; tail -n 30 "$LOGS/$name.log"; return 1; fi
}
python3 -V; python3 -c 'import torch; print(torch.__version__, torch.version.cuda)'
step wheels python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site3 .carry/whl-exl3/*.whl || exit 1
step jit python3 $P jit &
step model python3 $P model "$W/m/q05b" &
wait
for s in jit model; do [ -f "$DONE/$s" ] || { echo "stopping: $s failed"; exit 1; }; done
for b in 4.0 2.5; do
  step "exl3_$b" python3 -m exllamav3.conversion.convert_model -i "$W/m/q05b" -o "$W/m/q05b-exl3-$b" -w "$W/work-$b" -b "$b"
done
step measure python3 $P measure "$W/m/q05b-exl3-4.0" "$W/m/q05b-exl3-2.5" "$W/m/q05b"
touch "$DONE/all"
