"""What llama.cpp's converter would fail on, found before a study's first trial (issue 28 item 4):
its own ``--vocab-only`` run into a temporary file reads and checks the tokenizer, not the
weights. A model whose tokenizer the converter does not recognise ("BPE pre-tokenizer was not
recognized") burned a 5-minute budget in 217 failed trials; now the study is refused (exit 2)
with the cause and the remedy before anything is launched.

The converter is the build's own (``<build>/src/convert_hf_to_gguf.py``), run by this Python;
the unknown-tokenizer case needs what it imports (the ``convert`` extra) and is skipped without.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.engine_fixtures import cpu_build

CONVERTER_IMPORTS = ("torch", "transformers", "sentencepiece", "safetensors", "tokenizers")
has_converter_imports = all(importlib.util.find_spec(m) for m in CONVERTER_IMPORTS)

STUDY = """
[study]
name = "odd"

[hardware]
gpu = "cpu"

[model]
source = "odd-tokenizer"

[workload]
prompt_tokens = 32
output_tokens = 16

[[candidates]]
backend = "llama-server"
weights = ["gguf:Q8_0", "gguf:Q4_0"]

[space]
ctx = [256]
parallel = [1]
"""


def converter() -> Path:
    from autotune_plugins.llama_server.recipes import converter_of

    return converter_of(Path(cpu_build().server))


@pytest.mark.skipif(importlib.util.find_spec("torch") is not None, reason="torch is installed here")
def test_a_python_without_the_converters_imports_is_found_before_the_first_trial(tmp_path):
    # The real converter, run as a conversion would run it: here it cannot import torch, as
    # every conversion of the study would not.
    from autotune_plugins.llama_server.recipes import vocabulary_problem

    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    problem = vocabulary_problem(converter(), model)
    assert problem is not None and "--vocab-only failed" in problem and "No module named 'torch'" in problem
    assert f"this Python ({sys.executable}), which lacks torch: pip install -e '.[convert]'" in problem


@pytest.mark.skipif(
    not has_converter_imports,
    reason="convert_hf_to_gguf.py needs torch, transformers and sentencepiece: pip install -e '.[convert]'",
)
def test_a_tokenizer_the_converter_does_not_know_stops_the_study_before_its_first_trial(tmp_path):
    from autotune_plugins.llama_server.recipes import vocabulary_problem
    from tests.hf_model import write_tiny_llama

    known = write_tiny_llama(tmp_path / "known")  # a byte-fallback BPE: the converter's Llama vocabulary
    assert vocabulary_problem(converter(), known) is None
    write_tiny_llama(tmp_path / "odd-tokenizer", byte_level=True, vocab_size=400)
    (tmp_path / "odd.toml").write_text(STUDY)
    env = dict(os.environ, AUTOTUNE_LOAD_PLUGINS="llama_server")
    run = subprocess.run(
        [
            sys.executable,
            "-c",
            "from autotune.cli import main; main()",
            "study",
            "odd.toml",
            "--storage",
            f"sqlite:///{tmp_path / 'odd.db'}",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2, run.stderr[-3000:]
    assert (
        "odd.toml: [candidates.0] backend = 'llama-server': making gguf:F16 (llama.cpp convert_hf_to_gguf.py "
        "--outtype f16) would fail: convert_hf_to_gguf.py odd-tokenizer --vocab-only (a dry run) failed: "
        "NotImplementedError: BPE pre-tokenizer was not recognized"
    ) in run.stderr
    assert (
        "does not know this model's tokenizer" in run.stderr
        and "name GGUF files as this candidate's weights" in run.stderr
    )
    # Nothing launched, nothing made: no progress line, no storage.
    assert not [line for line in run.stderr.splitlines() if line.startswith(("trial ", "artifact ", "baseline"))]
    assert not (tmp_path / "odd.db").exists()
