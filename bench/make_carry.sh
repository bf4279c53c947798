#!/usr/bin/env bash
# Makes .carry/ (gitignored), what the H200 sessions carry to a device with no network:
#   whl/       optuna, optuna-dashboard, bottle, sqlalchemy, alembic, mako, colorlog, gguf, greenlet (cp312)
#              + the autotune wheel (the study writes its dashboard notes through optuna-dashboard)
#              + llama-cpp-python's bindings without their own llama.cpp (CMAKE_ARGS=-DLLAMA_BUILD=OFF,
#              pure Python: they load the engine build's libllama, for KLD of GGUF) and diskcache
#   whl-exl2/  exllamav2 0.3.2, fastparquet, cramjam, websockets (cp312)
#   whl-exl3/  exllamav3 1.6.5 (pure Python: it JIT-compiles its extension at first import) and the
#              dependencies an image may lack: pyyaml, marisa-trie, psutil, pydantic with pydantic-core,
#              annotated-types, typing-inspection, typing-extensions (cp312; about 9 MB;
#              bench/exllamav3_h200/pipeline.sh installs each only where its module does not import)
#   whl-scipy/ scipy (cp312; the twin's calibration needs it, and images without it exist)
#   whl-convert/  only with CONVERT=1 (where the image lacks them): transformers 4.57.6 (llama.cpp's
#              pin for convert_hf_to_gguf.py), tokenizers, sentencepiece and their dependencies,
#              less numpy (the image's torch needs its own); about 25 MB, so with whl-scipy the
#              carry may pass 64 MiB: leave whl-scipy out where the image has scipy
#   llama.cpp.tar.gz   the llama.cpp tree of the pinned llama-cpp-python sdist, with its
#              gguf-py (convert_hf_to_gguf.py needs its own) but without docs, tests, models
#              and the GPU backends other than CUDA (the whole sdist is over the 64 MiB carry)
#   ggml-vocab-{qwen2,llama-bpe}.gguf.gz   the tokenizers `autotune synth` copies
# Needs a CPU build made by `autotune engine build llama.cpp --cpu` (its src/ is the tree).
set -euo pipefail
cd "$(dirname "$0")/.."
SRC=${SRC:-$HOME/.cache/autotune/engines/llama.cpp-0.3.36-cpu/src}
[ -d "$SRC" ] || { echo "no llama.cpp tree at $SRC: run autotune engine build llama.cpp --cpu first" >&2; exit 2; }
mkdir -p .carry/whl .carry/whl-exl2 .carry/whl-exl3 .carry/whl-scipy
P=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux2014_x86_64
   --platform manylinux_2_17_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_28_x86_64 --no-deps)
python3 -m pip download -q "${P[@]}" -d .carry/whl optuna==5.0.0 optuna-dashboard==0.21.0 bottle sqlalchemy==2.1.9 alembic mako colorlog gguf greenlet
python3 -m pip download -q "${P[@]}" -d .carry/whl diskcache==5.6.3
CMAKE_ARGS="-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF" python3 -m pip wheel -q --no-deps -w .carry/whl llama-cpp-python==0.3.36
python3 -m pip download -q "${P[@]}" -d .carry/whl-exl2 exllamav2==0.3.2 fastparquet cramjam websockets
python3 -m pip download -q "${P[@]}" -d .carry/whl-exl3 exllamav3==1.6.5 pyyaml==6.0.4 marisa-trie==1.4.1 psutil==7.2.2 pydantic==2.14.4 \
    pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0
python3 -m pip download -q "${P[@]}" -d .carry/whl-scipy 'scipy>=1.11,<2'
if [ "${CONVERT:-0}" = 1 ]; then
  mkdir -p .carry/whl-convert  # with dependencies: every P option but the last (--no-deps)
  python3 -m pip download -q "${P[@]:0:${#P[@]}-1}" -d .carry/whl-convert transformers==4.57.6 sentencepiece
  rm -f .carry/whl-convert/numpy-*.whl
fi
rm -f .carry/whl/autotune-*.whl
# Without build isolation where this python3 can build wheels; else isolated (setuptools from
# PyPI): a system python3 without the wheel package stopped here with "invalid command 'bdist_wheel'".
python3 -m pip wheel -q --no-deps --no-build-isolation -w .carry/whl . 2>/dev/null ||
    python3 -m pip wheel -q --no-deps -w .carry/whl .
# gzipped: with scipy the carry is near its 64 MiB limit (a vocabulary shrinks to a quarter)
for v in qwen2 llama-bpe; do gzip -9 -c "$SRC/models/ggml-vocab-$v.gguf" >".carry/ggml-vocab-$v.gguf.gz"; done
tar czf .carry/llama.cpp.tar.gz -C "$SRC" \
    --exclude=./docs --exclude=./models --exclude=./.github --exclude=./examples --exclude='./tools/server/public*' \
    --exclude='./ggml/src/ggml-'{vulkan,sycl,metal,opencl,cann,musa,hip,hexagon,openvino,et,kompute,webgpu,zdnn,rpc} \
    --exclude='./gguf-py/tests' --exclude='*/tests' .
du -sh .carry/* | sort -h
