#!/usr/bin/env bash
# Makes what TABBY=1 in pipeline.sh needs (issue 30 item 3: TabbyAPI serving exllamav3 for real),
# under .carry/ (gitignored): TabbyAPI is not on PyPI, so its checkout travels as a tarball.
#   .carry/tabbyAPI.tar.gz   `git archive` of a TabbyAPI checkout (TABBY_GIT: its git directory or
#                            work tree; about 160 KB)
#   .carry/whl-tabby/        its dependencies (pyproject.toml) as cp312 wheels, --no-deps, with
#                            their own dependencies listed by hand; the pipeline installs only those
#                            whose modules the image cannot import (missing_wheels.py). About 2 MB.
set -euo pipefail
cd "$(dirname "$0")/../.."
: "${TABBY_GIT:?set TABBY_GIT to a TabbyAPI git checkout (its .git directory or work tree)}"
mkdir -p .carry/whl-tabby
git --git-dir="$( [ -d "$TABBY_GIT/.git" ] && echo "$TABBY_GIT/.git" || echo "$TABBY_GIT")" \
    archive --format=tar.gz --prefix=tabbyAPI/ HEAD >.carry/tabbyAPI.tar.gz
P=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux2014_x86_64
   --platform manylinux_2_17_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_28_x86_64 --no-deps)
# fastapi-slim 0.128.0 is the last that is itself the package (later ones only require fastapi,
# which pulls opentelemetry); it wants starlette < 0.51. huggingface-hub < 1 reads through requests
# (1.x and later need httpx2); the image usually has it already (transformers).
# Only what the H200 image lacks (its package list: the device library's KINDS.md; aiohttp,
# anyio, click, h11, jinja2, huggingface-hub, hf-xet, uvloop and their kind are there): the whole
# list was 15 MB, which with the other carried wheels and the tree passed the 64 MiB carry limit.
python3 -m pip download -q "${P[@]}" -d .carry/whl-tabby fastapi-slim==0.128.0 starlette==0.50.0 \
    ruamel.yaml ruamel.yaml.clib uvicorn loguru sse-starlette sniffio async-lru httptools
du -sh .carry/tabbyAPI.tar.gz .carry/whl-tabby
