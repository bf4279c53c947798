#!/usr/bin/env bash
# Issue 16 on one H200: llama-server through the openai-server backend (template "llama-server",
# /v1/completions) against autotune's native llama-server backend (/completion), same synthetic
# Qwen2.5-7B-shaped GGUF (Q4_K_M), same build, 1, 2, 4 and 8 streams. Through the device tool
# (kind nvidia-h200, carry [".carry"], made by bench/make_carry.sh), one step per call while the
# machine stays warm (everything lives under /tmp/g):
#   bash bench/h200_openai_vs_native.sh prep      # wheels; llama.cpp CUDA build; the 7B GGUF
#   bash bench/h200_openai_vs_native.sh compare   # both backends, two rounds in swapped order,
#                                                 # then $OUT/h200_openai_vs_native.md
# On kind nvidia-h200-x2 the two rounds run at once, round N on GPU N-1, each round measuring
# both backends on its own card; after `bash bench/h200_grids.sh prep` (same /tmp/g layout) the
# prep step is not needed.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /tmp/g/db /tmp/g/m
export PYTHONPATH=/tmp/site
AT=(python3 -c 'import sys; from autotune.cli import main; sys.exit(main())')
t() { local n=$1; shift; local t0=$SECONDS; "$@" >"$OUT/$n.log" 2>&1; local rc=$?; echo "$n $((SECONDS - t0)) s rc=$rc" | tee -a "$OUT/times.txt"; tail -n 3 "$OUT/$n.log"; }

study() {  # study BACKEND ROUND: the same grid, only the backend table differs
  local backend=$1 round=$2 name=h200-$1-round$2 settings
  if [ "$backend" = openai-server ]; then
    settings='[backends.openai-server]
template = "llama-server"
executable = "/tmp/g/b/bin/llama-server"
extra_args = ["--fit", "off"]     # as the native backend launches it'
  else
    settings='[backends.llama-server]
binary = "/tmp/g/b/bin/llama-server"'
  fi
  cat >"/tmp/g/$name.toml" <<EOF
[study]
name = "$name"
sampler = "grid"
prior = false
finish_top = 0

[hardware]
gpu = "auto"

[model]
ref = "/tmp/g/m/q7b-Q4_K_M.gguf"

[workload]
prompt_tokens = 512
output_tokens = 128

[measure]
warmup_runs = 1
min_runs = 3
max_runs = 6
rel_spread_tol = 0.03

[[candidates]]
backend = "$backend"
weights = ["/tmp/g/m/q7b-Q4_K_M.gguf"]

[space]
ctx = [4096]
parallel = [1, 2, 4, 8]
cache_type = ["f16"]
flash_attn = [true]

$settings
EOF
  t "study-$name" "${AT[@]}" study "/tmp/g/$name.toml" --storage "sqlite:////tmp/g/db/$name.db" --json
  cp "/tmp/g/db/$name.db" "/tmp/g/$name.toml" "$OUT/"
}

step=$1; shift
case $step in
prep)
  python3 -V; nvidia-smi --query-gpu=index,name,uuid,memory.total,driver_version --format=csv,noheader
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .carry/whl/*.whl
  python3 -c 'import scipy' 2>/dev/null || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .carry/whl-scipy/*.whl
  python3 -c 'import scipy, optuna, autotune; print("scipy", scipy.__version__, "optuna", optuna.__version__)'
  mkdir -p /tmp/g/src && tar xzf .carry/llama.cpp.tar.gz -C /tmp/g/src
  gunzip -c .carry/ggml-vocab-qwen2.gguf.gz >/tmp/g/ggml-vocab-qwen2.gguf
  t llama_build bash -c 'cmake -S /tmp/g/src -B /tmp/g/b -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON \
      -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF \
      -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
      && ninja -C /tmp/g/b llama-server llama-quantize' &
  t synth_q7b "${AT[@]}" synth --arch qwen2 --layers 28 --hidden 3584 --heads 28 --kv-heads 4 --ffn 18944 \
      --ctx 32768 --vocab-from /tmp/g/ggml-vocab-qwen2.gguf --out /tmp/g/m/q7b-F16.gguf &
  wait
  t quant_q7b_Q4_K_M /tmp/g/b/bin/llama-quantize /tmp/g/m/q7b-F16.gguf /tmp/g/m/q7b-Q4_K_M.gguf Q4_K_M 16
  rm -f /tmp/g/m/q7b-F16.gguf
  ls -la /tmp/g/m | tee "$OUT/models.txt"
  ;;
compare)
  # Two rounds, the order swapped, so that a drift of the card (clocks, temperature) does not
  # favour one backend.
  if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
    (export CUDA_VISIBLE_DEVICES=0; study llama-server 1; study openai-server 1) &
    (export CUDA_VISIBLE_DEVICES=1; study openai-server 2; study llama-server 2) &
    wait
  else
    study llama-server 1; study openai-server 1
    study openai-server 2; study llama-server 2
  fi
  python3 - "$OUT" <<'EOF' | tee "$OUT/h200_openai_vs_native.md"
import statistics, sys
import optuna
from autotune.study import records
optuna.logging.set_verbosity(optuna.logging.WARNING)
out = sys.argv[1]
rows = {}
for backend in ("llama-server", "openai-server"):
    for rnd in (1, 2):
        name = f"h200-{backend}-round{rnd}"
        study = optuna.load_study(study_name=name, storage=f"sqlite:///{out}/{name}.db")
        for r in records.measured(study):
            sm = r.engine_facts.get("server_metrics") or {}
            rows.setdefault(r.trial_config.parallel, {}).setdefault(backend, []).append(
                (r.median("aggregate_tok_s"), r.median("per_user_tok_s"), r.median("ttft_ms"),
                 (r.measured_vram_bytes or 0) / 2**30, len(sm.get("warnings", []))))
print("# llama-server on an H200: openai-server (template llama-server) vs the native backend\n")
print("Synthetic Qwen2.5-7B shape, Q4_K_M, ctx 4096 per stream, f16 KV, flash attention, prompt 512, "
      "output 128; medians of two rounds (order swapped); bench/h200_openai_vs_native.sh. "
      "'engine warnings': openai-server trials whose /metrics figures and the client's differ by more than 5%.\n")
print("| streams | native agg tok/s | openai agg tok/s | openai / native | native per-user | openai per-user "
      "| native TTFT ms | openai TTFT ms | native peak GiB | openai peak GiB | engine warnings |")
print("|---|---|---|---|---|---|---|---|---|---|---|")
for p in sorted(rows):
    n, o = rows[p].get("llama-server", []), rows[p].get("openai-server", [])
    if not n or not o:
        print(f"| {p} | missing: {len(n)} native, {len(o)} openai rounds |"); continue
    med = lambda xs, i: statistics.median(x[i] for x in xs)
    print(f"| {p} | {med(n, 0):.1f} | {med(o, 0):.1f} | {med(o, 0) / med(n, 0):.3f} | {med(n, 1):.1f} | {med(o, 1):.1f} "
          f"| {med(n, 2):.1f} | {med(o, 2):.1f} | {med(n, 3):.2f} | {med(o, 3):.2f} | {sum(x[4] for x in o)} |")
EOF
  ;;
*) echo "unknown step $step" >&2; exit 2 ;;
esac
