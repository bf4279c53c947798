"""How exllamav3 makes an EXL3 directory from a Hugging Face source (the backend's ``artifact_recipe``).

exllamav3's converter is ``python -m exllamav3.conversion.convert_model`` (the repository's
convert.py imports the same ``parser, prepare, main``; doc/convert.md). One pass per bitrate,
no shared measurement (unlike ExLlamaV2): ``-i`` the source, ``-o`` the output directory (the
quantized safetensors, config.json with ``quantization_config.quant_method = "exl3"``, and the
source's tokenizer files copied, conversion/compile.py), ``-w`` a work directory for its
checkpoints, ``-b`` the decoder's bits per weight (1-8), ``-hb`` the head's (default 6).

The converter reports a refused argument as `` !! Error: ...`` and exits 0
(``convert_model.py __main__``), so the recipe checks the output's config.json itself.

The ``convert_args`` setting hands the converter more arguments (``-cr``/``-cc`` calibration
size, ``-cb`` codebook, ``-hq``...); an artifact made with them is another artifact, so they
name a cache entry of their own.
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Mapping

from autotune.api import AutotuneError, parse_format
from autotune._builtin import Recipe, family_of, model_from_hf_config, normalize_format, run_tool
from autotune._builtin import read_config_json
from autotune_plugins.exllamav3 import declarations
from autotune_plugins.exllamav3.formats import EXL3_HEAD_BITS, exl3_quantization, exl3_weights, spell

__all__ = ["CONVERTER_MODULE", "convert_args_problem", "converter_argv", "exl3_recipe"]

CONVERTER_MODULE = "exllamav3.conversion.convert_model"
# A first guess of the seconds per GiB written, until this machine's cache has timed its own
# (artifacts.predict_making): exllamav3 1.6.5 on an H200 (bench/results/exl3_probe_h200) wrote a
# Qwen2.5-0.5B shape at 4.0 bpw (529 MiB) in 129 s and at 2.5 bpw (465 MiB) in 145 s: 250 and
# 319 s per GiB, with the defaults (250 x 2048 calibration rows). A small model's fixed costs
# weigh more; the mean stands until a larger one is timed.
CONVERT_S_PER_GIB = 285.0

# What the recipe itself says to the converter: the same flag from the study would contradict it.
OWN_FLAGS = {
    "-i": "--in_dir",
    "-o": "--out_dir",
    "-w": "--work_dir",
    "-b": "--bits",
    "-hb": "--head_bits",
    "-r": "--resume",
    "-rcp": "--recipe",
    "-d": "--devices",
}


def convert_args_problem(args: list) -> str | None:
    """Why ``args`` cannot be handed to the converter (None: they can)."""
    if not all(isinstance(a, str) and a for a in args):
        return "must be a list of non-empty strings (arguments of python -m " + CONVERTER_MODULE + ")"
    own = sorted({a.partition("=")[0] for a in args} & (set(OWN_FLAGS) | set(OWN_FLAGS.values())))
    if own:
        return (
            f"{', '.join(own)}: set by autotune for each format (the source, the output, the work directory, "
            "the bits, the head bits, the card); accepted are the converter's other options, such as -cr, -cc, "
            "-cb, -hq"
        )
    return None


def converter_argv(
    python: str, source: Path, out: Path, work: Path, bpw: float, head_bits: float, extra: tuple[str, ...] = ()
) -> list[str]:
    """The converter's command line for one bitrate."""
    return [
        python,
        "-m",
        CONVERTER_MODULE,
        "-i",
        str(source),
        "-o",
        str(out),
        "-w",
        str(work),
        "-b",
        spell(bpw),
        "-hb",
        f"{head_bits:g}",
        *extra,
    ]


def exl3_recipe(
    fmt: str,
    source: Path,
    python: str,
    env: Mapping[str, str] | Callable[[], Mapping[str, str]],
    tool: str,
    convert_args: tuple[str, ...] = (),
    head_bits: float = EXL3_HEAD_BITS,
) -> Recipe | None:
    """The recipe for ``fmt`` (``exl3:<bpw>``) from the Hugging Face directory ``source``.

    Args:
        fmt: An ``exl3:<bpw>`` format.
        source: The FP16/BF16 Hugging Face model directory.
        python: The interpreter with exllamav3 and torch (the backend's ``python`` setting).
        env: The converter's environment (the study's card as CUDA device 0).
        tool: ``exllamav3-<version>``, part of the cache key.
        convert_args: More converter arguments (checked by ``convert_args_problem``); with
            any, the key's tool names a hash of them.
        head_bits: ``-hb``; other than the default 6, it is part of the key too.

    Returns:
        None for a format that is not EXL3 (another engine's).

    Raises:
        AutotuneError: ``source`` is not an HF directory.
    """
    if family_of(fmt, (declarations.EXL3,)) is not declarations.EXL3:
        return None
    _, bpw = parse_format(fmt, (declarations.EXL3,))
    if not source.is_dir():
        raise AutotuneError(
            f"{source}: EXL3 is converted from a Hugging Face model directory (config.json and "
            "*.safetensors), not a single file"
        )
    model = model_from_hf_config(source)
    key_args = convert_args + (() if head_bits == EXL3_HEAD_BITS else ("-hb", f"{head_bits:g}"))
    if key_args:
        tool += "-args" + hashlib.sha256("\0".join(key_args).encode()).hexdigest()[:8]
    canonical = normalize_format(fmt, (declarations.EXL3,))
    extra = sum(p.stat().st_size for p in source.iterdir() if p.is_file() and p.suffix != ".safetensors")
    expected = exl3_weights(model, float(bpw), head_bits).total_bytes + extra

    def convert(inputs: list[Path], out: Path, say: Callable[[str], None]) -> None:
        run_env = env() if callable(env) else env
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix="exl3-work-", dir=out.parent) as work:
            run_tool(
                converter_argv(python, inputs[0], out, Path(work), float(bpw), head_bits, convert_args),
                f"exllamav3 convert {inputs[0].name} -b {spell(bpw)}",
                say,
                env=run_env,
            )
        # The converter exits 0 after refusing its arguments (" !! Error: ..."): only a
        # config.json that states EXL3 says it finished.
        cfg = out / "config.json"
        if not cfg.is_file() or exl3_quantization(read_config_json(out), cfg) is None:
            shutil.rmtree(out, ignore_errors=True)
            raise AutotuneError(
                f"exllamav3 convert {inputs[0].name} -b {spell(bpw)} wrote no EXL3 config.json in "
                f"{out} (the converter prints ' !! Error: ...' and exits 0 when it refuses its "
                "arguments: see its output above)"
            )

    args = "".join(" " + a for a in convert_args)
    return Recipe(
        canonical,
        tool,
        f"exl3-{spell(bpw)}bpw",
        expected,
        convert,
        description=f"exllamav3 convert_model -b {spell(bpw)} -hb {head_bits:g}{args}",
        step="convert_exl3",
        seconds_per_gib=CONVERT_S_PER_GIB,
    )
