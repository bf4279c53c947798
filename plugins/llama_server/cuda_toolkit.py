"""Which CUDA toolkit can build llama.cpp for which card, asked before compiling.

A CUDA build of llama.cpp for an architecture its ``nvcc`` cannot target fails minutes into
the configure step with ``nvcc fatal : Unsupported gpu architecture 'compute_70'`` inside a
CMake dump. The V100 (sm_70) is the card autotune's default study is about, and CUDA 13 -
what a fresh machine gets today - cannot build for it. So ``engine build`` finds the compiler
CMake will use, reads its version, and refuses an architecture it cannot target with the
last (or first) toolkit that can and how to point the build at it.

Which toolkit supports which architecture (NVIDIA's release notes):

* CUDA 13.0 removed offline compilation for every architecture before sm_75: Maxwell
  (sm_50/52/53), Pascal (sm_60/61/62) and Volta (sm_70/72). CUDA Toolkit 13.0 Release Notes,
  section "Deprecated Architectures"
  (https://docs.nvidia.com/cuda/archive/13.0.0/cuda-toolkit-release-notes/index.html); NVIDIA's
  "Navigating GPU Architecture Support: A Guide for NVIDIA CUDA Developers" (2025) says the same
  in terms of compute capability 5.x, 6.x, 7.0 and 7.2, and the CUDA 12.9 notes that "CUDA
  Toolkit 12.x series will continue to support building applications for these architectures".
  12.9 is the last 12.x release: the last toolkit for these cards. 13.0 also renamed Thor's
  sm_101 to sm_110.
* CUDA 12.0 removed Kepler sm_35/sm_37 (the minimum became sm_50; cuFFT's "Deprecated
  Functionality" page, 12.x), so 11.8 is their last toolkit; CUDA 11.0 removed sm_30/sm_32.
* New architectures need a toolkit at least as new as the card: sm_80 11.0, sm_86 11.1,
  sm_87 11.4, sm_89 and sm_90 11.8, sm_100/101/120 12.8, sm_103/121 12.9, sm_110 13.0.

When ``nvcc --list-gpu-arch`` answers (CUDA 11 and later), its list is what counts; the
table is the fallback and always supplies the remedy.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autotune._builtin import processes
from autotune.api import AutotuneError
from autotune._builtin import ConfigError

__all__ = [
    "CudaCompiler",
    "arch_number",
    "arch_problem",
    "card_arch_label",
    "card_runs_code",
    "check_cuda_archs",
    "cuda_arch_from_cc",
    "find_cuda_compiler",
    "inspect_cuda_compiler",
    "parse_gpu_arch_list",
    "parse_nvcc_version",
    "resolve_arch",
    "toolkit_note",
]

# Where NVIDIA's CUDA packages put nvcc, without adding it to PATH.
DEFAULT_NVCC = Path("/usr/local/cuda/bin/nvcc")
# Versioned installs side by side (cuda-12.9, cuda-13.0): candidates for the remedy.
VERSIONED_NVCC_GLOB = "/usr/local/cuda-*/bin/nvcc"

Version = tuple[int, int]

# The last toolkit that can compile for an architecture NVIDIA has since dropped.
_LAST_TOOLKIT: dict[int, Version] = {
    **{a: (8, 0) for a in (20, 21)},
    **{a: (10, 2) for a in (30, 32)},
    **{a: (11, 8) for a in (35, 37)},
    **{a: (12, 9) for a in (50, 52, 53, 60, 61, 62, 70, 72, 101)},
}
# The first toolkit that can compile for an architecture (only those a user may still meet).
_FIRST_TOOLKIT: dict[int, Version] = {
    50: (6, 0),
    52: (6, 5),
    53: (7, 0),
    60: (8, 0),
    61: (8, 0),
    62: (8, 0),
    70: (9, 0),
    72: (10, 0),
    75: (10, 0),
    80: (11, 0),
    86: (11, 1),
    87: (11, 4),
    89: (11, 8),
    90: (11, 8),
    100: (12, 8),
    101: (12, 8),
    120: (12, 8),
    103: (12, 9),
    121: (12, 9),
    110: (13, 0),
}
# Arch-specific ("90a") targets from 12.0, family-specific ("100f") from 12.9.
_SUFFIX_FIRST: dict[str, Version] = {"a": (12, 0), "f": (12, 9)}

_FAMILIES = (
    (100, "Blackwell"),
    (90, "Hopper"),
    (89, "Ada"),
    (80, "Ampere"),
    (75, "Turing"),
    (70, "Volta"),
    (60, "Pascal"),
    (50, "Maxwell"),
    (30, "Kepler"),
)
_EXAMPLES = {
    70: "V100",
    75: "T4",
    80: "A100",
    86: "RTX 30xx/A10",
    89: "L4/RTX 40xx",
    90: "H100",
    61: "P40/GTX 10xx",
    60: "P100",
    100: "B200",
    120: "RTX 50xx",
}


@dataclass(frozen=True)
class CudaCompiler:
    """The ``nvcc`` a CUDA build will use.

    Attributes:
        path: Its path.
        source: Where it came from, for messages: "--cuda-compiler", "CUDACXX", "PATH" or the
            default install location.
        version: (major, minor) from ``nvcc --version``.
        archs: Real architectures it lists with ``--list-gpu-arch`` (e.g. {"75", "90a"}), or
            None when it cannot list them (before CUDA 11) and the table decides.
    """

    path: str
    source: str
    version: Version
    archs: frozenset[str] | None = None

    @property
    def label(self) -> str:
        return f"CUDA {self.version[0]}.{self.version[1]}"


def _split_arch(arch: str) -> tuple[int, str]:
    m = re.fullmatch(r"(\d+)([a-z]?)", arch.strip().lower().removeprefix("sm_"))
    if not m:
        raise ConfigError(f"CUDA architecture {arch!r}: use a number such as 70, 86 or 90a")
    return int(m.group(1)), m.group(2)


def card_arch_label(arch: str) -> str:
    """ "sm_70 (Volta, e.g. V100)": an architecture as the user knows the card."""
    number, suffix = _split_arch(arch)
    family = next((name for floor, name in _FAMILIES if number >= floor), "pre-Kepler")
    example = f", e.g. {_EXAMPLES[number]}" if number in _EXAMPLES else ""
    return f"sm_{number}{suffix} ({family}{example})"


def _fmt(version: Version) -> str:
    return f"{version[0]}.{version[1]}"


def parse_nvcc_version(text: str) -> Version | None:
    """(major, minor) from ``nvcc --version`` ("Cuda compilation tools, release 13.0, V13.0.48")."""
    m = re.search(r"release\s+(\d+)\.(\d+)", text) or re.search(r"\bV(\d+)\.(\d+)\.\d+", text)
    return (int(m.group(1)), int(m.group(2))) if m else None


def parse_gpu_arch_list(text: str) -> frozenset[str]:
    """Architectures of ``nvcc --list-gpu-arch`` output ("compute_75" lines -> "75")."""
    return frozenset(m.group(1) for m in re.finditer(r"\b(?:compute|sm)_(\d+[a-z]?)\b", text))


def find_cuda_compiler(
    explicit: str | os.PathLike[str] | None = None, env: Mapping[str, str] | None = None
) -> tuple[str, str] | None:
    """The ``nvcc`` CMake will use and where it came from, as (path, source).

    Order: ``--cuda-compiler``, then ``$CUDACXX`` (which CMake itself reads), then ``nvcc`` on
    ``PATH``, then /usr/local/cuda/bin/nvcc (NVIDIA's packages install there without touching
    PATH). A directory is accepted for the first two and searched for ``nvcc`` and
    ``bin/nvcc``.

    Raises:
        ConfigError: ``--cuda-compiler`` or ``$CUDACXX`` names no executable: a silent
            fallback to another toolkit would build with one the user did not choose.
    """
    env = os.environ if env is None else env
    for value, source in ((explicit, "--cuda-compiler"), (env.get("CUDACXX"), "CUDACXX")):
        if not value:
            continue
        path = Path(value).expanduser()
        if path.is_dir():
            path = next((p for p in (path / "nvcc", path / "bin" / "nvcc") if p.is_file()), path / "bin" / "nvcc")
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise ConfigError(
                f"{source} {value}: no executable nvcc there (give the path of a CUDA "
                "toolkit's bin/nvcc, e.g. /usr/local/cuda-12.9/bin/nvcc)"
            )
        return str(path.absolute()), source
    on_path = shutil.which("nvcc", path=env.get("PATH"))
    if on_path:
        return on_path, "PATH"
    if DEFAULT_NVCC.is_file():
        return str(DEFAULT_NVCC), str(DEFAULT_NVCC)
    return None


def inspect_cuda_compiler(path: str, source: str, timeout_s: float = 60.0) -> CudaCompiler:
    """Runs ``nvcc --version`` (and ``--list-gpu-arch``) and returns what the compiler can do.

    Raises:
        ConfigError: It does not run or prints no version; the message quotes its output.
    """
    try:
        proc = processes.run(
            [path, "--version"],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            timeout_s=timeout_s,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ConfigError(f"CUDA compiler {path} (from {source}) does not run: {exc}") from None
    text = proc.stdout.decode("utf-8", "replace")
    version = parse_nvcc_version(text)
    if version is None:
        tail = " | ".join(text.strip().splitlines()[-3:]) or "no output"
        raise ConfigError(
            f"CUDA compiler {path} (from {source}): `nvcc --version` gave exit status "
            f"{proc.returncode} and no 'release X.Y' line ({tail})"
        )
    archs = None
    try:
        listed = processes.run(
            [path, "--list-gpu-arch"],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            stdin=subprocess.DEVNULL,
            timeout_s=timeout_s,
        )
        if listed.returncode == 0:
            archs = parse_gpu_arch_list(listed.stdout.decode("utf-8", "replace")) or None
    except (OSError, subprocess.TimeoutExpired):
        pass  # older nvcc: the table decides
    return CudaCompiler(path, source, version, archs)


def _supported_by_table(arch: str, version: Version) -> bool | None:
    number, suffix = _split_arch(arch)
    last = _LAST_TOOLKIT.get(number)
    if last is not None and version > last:
        return False
    first = max(_FIRST_TOOLKIT.get(number, (0, 0)), _SUFFIX_FIRST.get(suffix, (0, 0)))
    if version < first:
        return False
    return True if number in _FIRST_TOOLKIT or last is not None else None


def arch_problem(arch: str, compiler: CudaCompiler) -> str | None:
    """Why ``compiler`` cannot build for ``arch`` ("70", "90a"), or None when it can.

    The compiler's own list decides when it has one; else the table; an architecture neither
    knows is let through (CMake will say).
    """
    number, suffix = _split_arch(arch)
    if compiler.archs is not None:
        # Some releases list only the plain "compute_90": a suffix then follows the table.
        ok: bool | None = f"{number}{suffix}" in compiler.archs or (
            str(number) in compiler.archs and compiler.version >= _SUFFIX_FIRST.get(suffix, (0, 0))
        )
    else:
        ok = _supported_by_table(arch, compiler.version)
    if ok is not False:
        return None
    last = _LAST_TOOLKIT.get(number)
    if last is not None and compiler.version > last:
        need = f"the last toolkit that can is CUDA {_fmt(last)}"
        if last == (12, 9):
            need += " (CUDA 13.0 dropped sm_50 to sm_72)"
    else:
        first = max(_FIRST_TOOLKIT.get(number, (0, 0)), _SUFFIX_FIRST.get(suffix, (0, 0)))
        need = f"it needs CUDA {_fmt(first)} or newer" if first > (0, 0) else "it needs another CUDA toolkit"
    return (
        f"{compiler.label} ({compiler.path}, from {compiler.source}) cannot compile for {card_arch_label(arch)}: {need}"
    )


def toolkit_note(arch: str) -> str:
    """A remedy's aside when building for ``arch`` needs an older toolkit than today's, else ""."""
    number, _ = _split_arch(arch)
    last = _LAST_TOOLKIT.get(number)
    if last is None:
        return ""
    return (
        f" (with CUDA {_fmt(last)} or older: later toolkits cannot target sm_{number}; add "
        f"--cuda-compiler /usr/local/cuda-{_fmt(last)}/bin/nvcc)"
    )


def _other_toolkits(skip: str) -> list[str]:
    """Versioned installs other than ``skip``, newest first, each once (cuda-13 -> cuda-13.0)."""
    seen = {os.path.realpath(skip)}
    found = []
    for path in sorted(glob.glob(VERSIONED_NVCC_GLOB), reverse=True):
        real = os.path.realpath(path)
        if real not in seen:
            seen.add(real)
            found.append(path)
    return found


def check_cuda_archs(archs: Sequence[str], compiler: CudaCompiler, *, others: Sequence[str] | None = None) -> None:
    """Refuses, before anything is downloaded or compiled, architectures ``compiler`` cannot target.

    Args:
        archs: CMake architectures ("70", "90a").
        compiler: The compiler the build will use (:func:`inspect_cuda_compiler`).
        others: Other ``nvcc`` paths to look at for the remedy; None globs
            /usr/local/cuda-*/bin/nvcc.

    Raises:
        ConfigError: Names each architecture, the toolkit found, the toolkit that would do and
            how to point the build at it (an installed one when there is).
    """
    problems = [(a, p) for a in archs if (p := arch_problem(a, compiler))]
    if not problems:
        return
    bad = [a for a, _ in problems]
    fitting = None
    for candidate in _other_toolkits(compiler.path) if others is None else others:
        try:
            other = inspect_cuda_compiler(candidate, "installed")
        except AutotuneError:
            continue
        if not any(arch_problem(a, other) for a in archs):
            fitting = other
            break
    if fitting is not None:
        remedy = (
            f"{fitting.label} is installed at {fitting.path} and can: rerun with "
            f"--cuda-compiler {fitting.path} (or CUDACXX={fitting.path})"
        )
    else:
        example = (
            "/usr/local/cuda-12.9/bin/nvcc"
            if any(_LAST_TOOLKIT.get(_split_arch(a)[0]) == (12, 9) for a in bad)
            else "/usr/local/cuda-X.Y/bin/nvcc"
        )
        remedy = (
            f"Install that toolkit beside this one (NVIDIA's cuda-toolkit-X-Y packages go to "
            f"/usr/local/cuda-X.Y) and point the build at it: --cuda-compiler {example} "
            f"(or CUDACXX={example})"
        )
    reasons = "; ".join(p for _, p in problems)
    raise ConfigError(f"--cuda-arch {','.join(bad)}: {reasons}. {remedy}")


# --------------------------------------------------------------------------------------
# Architectures of cards and builds
# --------------------------------------------------------------------------------------


_ARCH_RE = re.compile(r"^\d{2,3}[a-z]?$")


def cuda_arch_from_cc(compute_capability: str) -> str:
    """The CMake CUDA architecture of an NVML compute capability.

    Args:
        compute_capability: "major.minor", as :class:`autotune.hardware.gpus.DetectedGpu` has it.

    Returns:
        E.g. "70" for "7.0" (V100), "90" for "9.0" (H100).

    Raises:
        ConfigError: The value is not "major.minor".
    """
    m = re.fullmatch(r"(\d+)\.(\d+)", compute_capability.strip())
    if not m:
        raise ConfigError(f"compute capability {compute_capability!r}: use 'major.minor', e.g. 7.0")
    return f"{int(m.group(1))}{int(m.group(2))}"


def resolve_arch(spec: str, gpus: Sequence[Any] | None = None) -> str:
    """Turns ``--cuda-arch`` into "cpu" or a CMake architecture list such as "70" or "70;86".

    The first pitfall of building llama.cpp for an old card is a binary without kernels for it
    (the V100 is sm_70, which recent CUDA defaults leave out): "auto" asks NVML for the compute
    capability of every visible card, so the build has exactly their architectures.

    Args:
        spec: "auto", "cpu", or architectures separated by commas or semicolons ("70", "70,86",
            "90a").
        gpus: Detected GPUs (objects with ``compute_capability``); None detects them with
            :func:`autotune.hardware.gpus.detect_gpus`.

    Returns:
        "cpu" or the architectures joined by ";", sorted and without duplicates.

    Raises:
        ConfigError: An architecture is not a number like 70 or 90a.
    """
    spec = spec.strip().lower()
    if spec == "cpu":
        return "cpu"
    if spec == "auto":
        if gpus is None:
            from autotune._builtin import detect_gpus

            gpus = detect_gpus()
        archs = {cuda_arch_from_cc(g.compute_capability) for g in gpus if g.compute_capability not in ("", "0.0")}
        # No NVIDIA card (or no driver): a CPU build is the only one that can run here.
        return ";".join(sorted(archs, key=_arch_key)) if archs else "cpu"
    parts = [p.strip().removeprefix("sm_") for p in re.split(r"[,;]", spec) if p.strip()]
    bad = [p for p in parts if not _ARCH_RE.match(p)]
    if not parts or bad:
        raise ConfigError(
            f"--cuda-arch {spec!r}: use auto, cpu, or CUDA architectures such as 70, 86 or 90 "
            "(compute capability without the dot), separated by commas"
        )
    return ";".join(sorted(set(parts), key=_arch_key))


def _arch_key(arch: str) -> tuple[int, str]:
    digits = re.match(r"\d+", arch)
    return (int(digits.group(0)) if digits else 0, arch)


def arch_number(arch: str) -> int:
    m = re.match(r"\d+", arch)
    return int(m.group(0)) if m else 0


def card_runs_code(built: str, card: str) -> bool:
    """Whether machine code built for ``built`` ("80", "90a") runs on a ``card`` ("86").

    CUDA's binary compatibility: code for X.y runs on X.z with z >= y; arch-specific code
    ("90a") only on that very architecture.
    """
    b, c = arch_number(built), arch_number(card)
    if built[-1:] == "a":
        return b == c
    return b // 10 == c // 10 and b % 10 <= c % 10
