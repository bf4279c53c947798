"""How llama.cpp makes a GGUF artifact from a source model (the backend's ``artifacts`` part).

* A Hugging Face directory becomes ``gguf:F16`` (or BF16, F32) through llama.cpp's own
  ``convert_hf_to_gguf.py`` from the engine build's vendored tree (``<build>/src``, with its
  ``gguf-py``), run by this Python (it needs ``torch`` and ``transformers``: ``pip install -e
  '.[convert]'``). Every quantized type is then made from that F16 file by ``llama-quantize``.
* A full-precision GGUF file (F32, F16, BF16) is quantized directly by ``llama-quantize``. A
  quantized GGUF is no source: requantizing compounds the errors, and the study would compare
  artifacts that are not what users download.

The tool version in the cache key is the llama.cpp commit of the build (``engine.json``), or the
server's ``--version`` for a binary autotune did not build: the quantizer and the converter come
from the same tree as the server that loads their output.
"""

from __future__ import annotations

import re
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Mapping

from autotune.api import AutotuneError, ModelSpec, parse_format, resolve_model
from autotune._builtin import Recipe, engine_environment, family_of, run_tool
from autotune._builtin import read_gguf
from autotune_plugins.llama_server import declarations, engine
from autotune_plugins.llama_server.builds import _manifest_of
from autotune_plugins.llama_server.formats import predict_gguf_weights

__all__ = ["CONVERTER", "FULL_PRECISION", "gguf_recipe", "vocabulary_problem"]

CONVERTER = "convert_hf_to_gguf.py"
# What llama.cpp's converter (a Python script run by this interpreter) may need of our
# environment beyond the engines' allow-list: its Python and transformers' cache settings.
CONVERTER_VARIABLES = ("PYTHON*", "VIRTUAL_ENV", "TRANSFORMERS_*", "HF_HOME", "HF_HUB_OFFLINE")
# First guesses of the seconds per GiB written, until the cache has timed this machine's own
# (artifacts.predict_making): a Qwen2.5-1.5B-shaped model on an H200 host, 16 cores
# (bench/results/h200_exllamav2_times.txt): 17.3 s for its 2.9 GiB F16, 12.1 s for its 0.92 GiB
# Q4_K_M. A slower disk or fewer cores take longer; the first making corrects it.
CONVERT_S_PER_GIB = 6.0
QUANTIZE_S_PER_GIB = 13.0
# What convert_hf_to_gguf.py writes itself (its --outtype); the rest is llama-quantize's.
_CONVERT_TYPES = {"F16": "f16", "BF16": "bf16", "F32": "f32"}
FULL_PRECISION = frozenset(_CONVERT_TYPES)
# Vocabulary and metadata beside the tensors: a 150k-token vocabulary is ~10 MB in a header.
_HEADER_ALLOWANCE = 32 * 2**20


def _tool(server: Path) -> str:
    manifest, _ = _manifest_of(server)
    if manifest and manifest.get("llama_cpp_commit"):
        return f"llama.cpp-{manifest['llama_cpp_commit']}"
    label = engine.engine_version(server).label
    return "llama.cpp-" + re.sub(r"[^A-Za-z0-9_.-]+", "_", label).strip("_")


def converter_of(server: Path) -> Path:
    """``convert_hf_to_gguf.py`` of the tree the server was built from.

    Raises:
        AutotuneError: The server is not an autotune build with its sources.
    """
    _, install_dir = _manifest_of(server)
    script = install_dir / "src" / CONVERTER
    if not script.is_file():
        raise AutotuneError(
            f"{script}: not found; a Hugging Face source is converted with the llama.cpp tree of an "
            "`autotune engine build llama.cpp` (this llama-server has none beside it)"
        )
    return script


# The converter's own words for a tokenizer it does not know (conversion/base.py,
# get_vocab_base_pre): every conversion of this model with this tree fails alike.
_UNKNOWN_TOKENIZER = "pre-tokenizer was not recognized"
# What the converter imports (convert_hf_to_gguf.py, conversion/base.py).
_MISSING_MODULE = re.compile(r"No module named '([^']+)'")


def vocabulary_problem(script: Path, source: Path) -> str | None:
    """What converting ``source`` with ``script`` would fail on in its vocabulary, found by
    the converter's own ``--vocab-only`` run into a temporary file: the tokenizer is read and
    checked (a BPE pre-tokenizer against the tree's table) and the weights are not, so it
    takes seconds (Python, torch and transformers starting) whatever the model's size. The
    cause with its remedy; None when the vocabulary converts."""
    with tempfile.TemporaryDirectory(prefix="autotune-vocab-") as tmp:
        try:
            run_tool(
                [
                    sys.executable,
                    str(script),
                    str(source),
                    "--vocab-only",
                    "--outtype",
                    "f16",
                    "--outfile",
                    str(Path(tmp) / "vocab.gguf"),
                ],
                f"{CONVERTER} {source.name} --vocab-only",
                lambda _: None,
                cwd=script.parent,
                env=engine_environment(CONVERTER_VARIABLES),
            )
        except AutotuneError as exc:
            cause = str(exc)
        else:
            return None
    if _UNKNOWN_TOKENIZER in cause:
        # run_tool joins the tool's last error lines with " | ": the traceback's own line says it.
        said = next(part for part in reversed(cause.split(" | ")) if _UNKNOWN_TOKENIZER in part)
        return (
            f"{CONVERTER} {source.name} --vocab-only (a dry run) failed: {said.strip()}: the llama.cpp tree of "
            f"this build ({script.parent}) does not know this model's tokenizer, "
            "so every conversion of it would fail; convert it with a llama.cpp whose convert_hf_to_gguf.py "
            "knows it and name that full-precision GGUF as [model] source, or name GGUF files as this "
            "candidate's weights"
        )
    missing = _MISSING_MODULE.search(cause)
    if missing:
        return (
            f"{cause}: the converter runs in this Python ({sys.executable}), which lacks "
            f"{missing.group(1)}: pip install -e '.[convert]' in autotune's checkout"
        )
    return f"{cause} (the converter's own message; a GGUF file as [model] source needs no conversion)"


def _source_kind(source: Path) -> tuple[str, str | None]:
    """("hf", None) for a model directory, ("gguf", TYPE) for a GGUF file: its
    ``general.file_type``, else (files written without one, as stories260K) the widest type
    of its tensors when every tensor is full precision."""
    if source.is_dir():
        return "hf", None
    header = read_gguf(source)
    if header.file_type is not None:
        return "gguf", header.file_type
    types = {t.ggml_type for t in header.tensors}
    if types and types <= FULL_PRECISION:
        return "gguf", "F32" if "F32" in types and len(types) == 1 else sorted(types - {"F32"})[0]
    return "gguf", None


def gguf_recipe(
    fmt: str, source: Path, settings: Mapping[str, Any], server: Path | Callable[[], Path]
) -> Recipe | None:
    """The recipe for ``fmt`` (``gguf:<TYPE>``) from ``source`` with the build of ``server``.

    Returns:
        None for a format that is not GGUF (another engine's).

    Raises:
        AutotuneError: ``source`` is not a model llama.cpp can start from (the message says why
            and what would do).
    """
    if family_of(fmt, (declarations.GGUF,)) is not declarations.GGUF:
        return None
    _, detail = parse_format(fmt, (declarations.GGUF,))
    if callable(server):
        server = server()
    qtype = str(detail)
    kind, source_type = _source_kind(source)
    if kind == "gguf" and source_type not in FULL_PRECISION:
        raise AutotuneError(
            f"{source}: a {source_type or 'unknown-type'} GGUF is no source to make {fmt} from; "
            f"give a full-precision one ({', '.join(sorted(FULL_PRECISION))}) or the Hugging Face "
            "model directory"
        )
    model: ModelSpec = resolve_model(str(source))
    expected = predict_gguf_weights(model, qtype).total_bytes + _HEADER_ALLOWANCE
    tool = _tool(server)
    name = f"{qtype}.gguf"
    canonical = f"gguf:{qtype}"
    if kind == "hf" and qtype in _CONVERT_TYPES:
        script = converter_of(server)

        def convert(inputs: list[Path], out: Path, say: Callable[[str], None]) -> None:
            run_tool(
                [
                    sys.executable,
                    str(script),
                    str(inputs[0]),
                    "--outfile",
                    str(out),
                    "--outtype",
                    _CONVERT_TYPES[qtype],
                ],
                f"{CONVERTER} {inputs[0].name} --outtype {_CONVERT_TYPES[qtype]}",
                say,
                cwd=script.parent,
                env=engine_environment(CONVERTER_VARIABLES),
            )

        return Recipe(
            canonical,
            tool,
            name,
            expected,
            convert,
            description=f"llama.cpp {CONVERTER} --outtype {_CONVERT_TYPES[qtype]}",
            step=CONVERTER,
            seconds_per_gib=CONVERT_S_PER_GIB,
            check=lambda: vocabulary_problem(script, source),
        )
    quantizer = engine.find_llama_quantize(settings)
    needs = ("gguf:F16",) if kind == "hf" else ()

    def quantize(inputs: list[Path], out: Path, say: Callable[[str], None]) -> None:
        src = inputs[-1]  # the F16 made first for an HF source; the GGUF source itself otherwise
        run_tool([str(quantizer), str(src), str(out), qtype], f"llama-quantize {src.name} {qtype}", say)

    return Recipe(
        canonical,
        tool,
        name,
        expected,
        quantize,
        needs=needs,
        description=f"llama-quantize {qtype}" + (" from gguf:F16" if needs else ""),
        step="llama-quantize",
        seconds_per_gib=QUANTIZE_S_PER_GIB,
    )
