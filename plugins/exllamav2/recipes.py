"""How ExLlamaV2 makes an EXL2 directory from a Hugging Face source (the backend's ``artifact_recipe``).

ExLlamaV2's converter (``python -m exllamav2.conversion.convert_exl2``, doc/convert.md) works
in two passes: a measurement pass that quantizes every module about a dozen times to learn how
each one suffers, then the quantization at the target bits per weight. The measurement depends
on the source only, so it is made once per source (``measurement.json`` in the cache entry,
under a lock of its own) and handed to every bpw with ``-m``: exl2:3.0, 4.0 and 5.0 of one
model cost one measurement and three quantizations. ``-cf`` compiles a full model directory
(config, tokenizer and the quantized safetensors), which is what the backend loads.

The ``convert_args`` setting hands the converter more arguments (calibration lengths, states
kept on the card); an artifact made with them is another artifact, so they name a cache entry
of their own (the measurement included, which depends on them too).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Mapping

from autotune.api import AutotuneError, parse_format
from autotune._builtin import Recipe, family_of, model_from_hf_config, normalize_format, run_tool
from autotune_plugins.exllamav2 import declarations
from autotune_plugins.exllamav2.formats import exl2_weights

__all__ = ["CONVERTER_MODULE", "convert_args_problem", "exl2_recipe"]

CONVERTER_MODULE = "exllamav2.conversion.convert_exl2"
MEASUREMENT = "measurement.json"
# A first guess of the seconds per GiB written, until the cache has timed this machine's own
# (artifacts.predict_making): a Qwen2.5-1.5B-shaped model on an H200 (bench/results/
# h200_exllamav2_times.txt) took 300 s to measure, once per source, and 210-224 s per bpw, each
# about 0.9 GiB: with the measurement spread over three bpw, about 340 s per GiB.
CONVERT_S_PER_GIB = 340.0


# What the recipe itself says to the converter: the same flag from the study would contradict it.
OWN_FLAGS = {
    "-i": "--in_dir",
    "-o": "--out_dir",
    "-nr": "--no_resume",
    "-res": "--resume",
    "-om": "--output_measurement",
    "-m": "--measurement",
    "-cf": "--compile_full",
    "-b": "--bits",
}


def convert_args_problem(args: list) -> str | None:
    """Why ``args`` cannot be handed to the converter (None: they can)."""
    if not all(isinstance(a, str) and a for a in args):
        return "must be a list of non-empty strings (arguments of python -m " + CONVERTER_MODULE + ")"
    own = sorted({a.partition("=")[0] for a in args} & (set(OWN_FLAGS) | set(OWN_FLAGS.values())))
    if own:
        return (
            f"{', '.join(own)}: set by autotune for each format (the source, the output, the bits, the "
            "shared measurement); accepted are the converter's other options, such as -l, -ml, -r, -mr, -hsol"
        )
    return None


def _measured(
    source: Path,
    entry: Path,
    python: str,
    env: Mapping[str, str],
    say: Callable[[str], None],
    extra: tuple[str, ...] = (),
) -> Path:
    """The source's measurement pass, made once for every bpw (in the cache entry ``entry``)."""
    target = entry / MEASUREMENT
    entry.mkdir(parents=True, exist_ok=True)
    with open(entry / (MEASUREMENT + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if target.is_file():
                say(f"exl2 measurement of {source.name}: cache hit, {target}")
                return target
            say(f"exl2 measurement of {source.name}: one pass shared by every bpw -> {target}")
            with tempfile.TemporaryDirectory(prefix="exl2-measure-", dir=entry) as work:
                partial = Path(work) / MEASUREMENT
                run_tool(
                    [
                        python,
                        "-m",
                        CONVERTER_MODULE,
                        "-i",
                        str(source),
                        "-o",
                        work + "/job",
                        "-nr",
                        "-om",
                        str(partial),
                        *extra,
                    ],
                    f"exllamav2 measurement of {source.name}",
                    say,
                    env=env,
                )
                if not partial.is_file():
                    raise AutotuneError(f"exllamav2 measurement of {source.name} wrote no {MEASUREMENT}")
                partial.replace(target)
            return target
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def exl2_recipe(
    fmt: str,
    source: Path,
    python: str,
    env: Mapping[str, str] | Callable[[], Mapping[str, str]],
    tool: str,
    convert_args: tuple[str, ...] = (),
) -> Recipe | None:
    """The recipe for ``fmt`` (``exl2:<bpw>``) from the Hugging Face directory ``source``.

    Args:
        fmt: An ``exl2:<bpw>`` format.
        source: The FP16/BF16 Hugging Face model directory.
        python: The interpreter with exllamav2 and torch (the backend's ``python`` setting).
        env: The converter's environment (the study's card as CUDA device 0).
        tool: ``exllamav2-<version>``, part of the cache key.
        convert_args: More converter arguments (the backend's setting), checked by
            ``convert_args_problem``; with any, the key's tool names a hash of them.

    Returns:
        None for a format that is not EXL2 (another engine's).

    Raises:
        AutotuneError: ``source`` is not an HF directory.
    """
    if family_of(fmt, (declarations.EXL2,)) is not declarations.EXL2:
        return None
    _, detail = parse_format(fmt, (declarations.EXL2,))
    if not source.is_dir():
        raise AutotuneError(
            f"{source}: EXL2 is converted from a Hugging Face model directory (config.json and "
            "*.safetensors), not a single file"
        )
    model = model_from_hf_config(source)
    bpw = float(detail)
    if convert_args:
        tool += "-args" + hashlib.sha256("\0".join(convert_args).encode()).hexdigest()[:8]
    canonical = normalize_format(fmt, (declarations.EXL2,))
    # The compiled directory copies the source's small files (tokenizer, config) beside the weights.
    extra = sum(p.stat().st_size for p in source.iterdir() if p.is_file() and p.suffix != ".safetensors")
    expected = exl2_weights(model, bpw).total_bytes + extra

    def convert(inputs: list[Path], out: Path, say: Callable[[str], None]) -> None:
        run_env = env() if callable(env) else env
        measurement = _measured(inputs[0], out.parent, python, run_env, say, convert_args)
        with tempfile.TemporaryDirectory(prefix="exl2-job-", dir=out.parent) as work:
            run_tool(
                [
                    python,
                    "-m",
                    CONVERTER_MODULE,
                    "-i",
                    str(inputs[0]),
                    "-o",
                    work + "/job",
                    "-nr",
                    "-m",
                    str(measurement),
                    "-cf",
                    str(out),
                    "-b",
                    str(bpw),
                    *convert_args,
                ],
                f"exllamav2 convert {inputs[0].name} -b {bpw}",
                say,
                env=run_env,
            )
        with contextlib.suppress(OSError):
            shutil.rmtree(out / "out_tensor", ignore_errors=True)  # the converter's scratch, when it leaves it

    args = "".join(" " + a for a in convert_args)
    return Recipe(
        canonical,
        tool,
        f"exl2-{bpw:g}bpw",
        expected,
        convert,
        description=f"exllamav2 convert_exl2 -b {bpw:g}{args} (measurement shared)",
        step="convert_exl2",
        seconds_per_gib=CONVERT_S_PER_GIB,
    )
