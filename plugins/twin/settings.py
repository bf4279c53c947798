"""The settings every twin backend takes (study file, ``[backends.twin-<engine>]``): simulated
noise and thermal throttling for tests and drills, llama.cpp's layer offload and host threads,
the stability metric; and what one simulated run reports.
"""

from __future__ import annotations

from typing import Any, Mapping

from autotune.api import Setting
from autotune._builtin import SERVING_UNITS, load_links
from autotune_plugins.shared.common_settings import STABILITY_METRIC, at_least_one, not_negative
from autotune_plugins.twin.speculation import DEFAULT_ACCEPTANCE, acceptance_problem


#: What one simulated run reports, and in which unit: what every serving backend measures.
UNITS: Mapping[str, str] = SERVING_UNITS


def _fraction(value: float) -> str | None:
    return None if 0 < value <= 1 else "must be > 0 and <= 1 (a speed multiplier)"


def layers_problem(value: Any) -> str | None:
    if isinstance(value, str):
        return None if value in ("all", "auto") else 'must be "all", "auto" or a number of layers'
    return None if value >= 0 else "must be >= 0 layers"


def _link_problem(value: str) -> str | None:
    known = load_links()
    return None if value in known else f"must be a link of the GPU catalog: {', '.join(known)}"


TWIN_SETTINGS: tuple[Setting, ...] = (
    Setting(
        "noise",
        float,
        0.0,
        "relative standard deviation of simulated measurement noise (0: exact)",
        check=not_negative,
    ),
    Setting(
        "throttle_after_s",
        float,
        None,
        "simulated seconds of load after which the card throttles (absent: never)",
        check=not_negative,
    ),
    Setting(
        "throttle_factor",
        float,
        0.75,
        "speed multiplier once throttled (the article's 40 -> 30 tok/s)",
        check=_fraction,
    ),
    Setting(
        "gpu_layers",
        (str, int),
        "all",
        '"all", "auto" (llama.cpp lets layers spill to the host) or a count',
        check=layers_problem,
    ),
    STABILITY_METRIC,
    Setting(
        "acceptance",
        (float, dict),
        None,
        "per-token acceptance of speculative drafts the twin assumes: one "
        "number, or a table by spec type or family (draft, mtp, ngram); absent: "
        + ", ".join(f"{f} {a}" for f, a in DEFAULT_ACCEPTANCE.items())
        + " (docs/twin.md)",
        check=acceptance_problem,
    ),
    Setting(
        "acceptance_rate",
        float,
        None,
        "the engine's measured acceptance of drafts (accepted / drafted, a "
        "trial's acceptance.rate) at the trial's n-max, converted to per-token; over acceptance when given "
        "(autotune estimate --acceptance)",
        check=lambda v: None if 0 <= v < 1 else "must be >= 0 and < 1",
    ),
    Setting(
        "host_threads",
        int,
        None,
        "CPU threads llama.cpp runs host layers and experts with (absent: the "
        "host's memory bandwidth alone bounds them)",
        check=at_least_one,
    ),
    Setting(
        "interconnect",
        str,
        None,
        "what a study's several cards send activations over: pcie3, pcie4, pcie5, "
        "nvlink, nvlink4 (absent: the slowest of the cards' own PCIe links)",
        check=_link_problem,
    ),
)
