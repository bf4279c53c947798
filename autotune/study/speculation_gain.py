"""Speculative decoding's gain against parallel slots, from a study's measured trials.

Speculation pays at one stream (the verify pass costs about a plain step) and loses at many
(the step is compute-bound, each slot drafts in turn), so what a user needs to know is where it
stops paying on their card and workload. This compares, per ``parallel``, each configuration
with speculation (``spec_type`` other than ``none``) against the same configuration without it
(every other value equal: backend, weights, ctx, cache, offload...), and keeps at each slot count
the best such pair: the most speculation did for that many slots. A slot count whose best pair is
below 1 is one where no speculation the study tried beat none.

The report shows the list (text and HTML); the summary says from how many slots speculation
loses (:func:`verdict`). Nothing is shown for a study that did not search speculation, or that
never measured a configuration both with and without it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from autotune.study.records import TrialRecord, TrialState

__all__ = ["SPEC_OPTIONS", "SlotGain", "gains", "gain_lines", "verdict"]

#: The configuration keys that belong to speculation (the rest must match for a pair).
SPEC_OPTIONS = (
    "spec_type",
    "spec_n_max",
    "spec_n_min",
    "spec_p_min",
    "spec_ngram_n",
    "draft",
    "draft_gpu_layers",
    "draft_cache_type",
)


@dataclass(frozen=True)
class SlotGain:
    """The best speculation against none at one slot count.

    Attributes:
        parallel: The slots.
        gain: Speculation's ``metric`` over the same configuration's without (>1: it pays).
        with_tok_s, without_tok_s: The two medians.
        speculation: The speculation options of the better trial (``spec_type``, n-max...).
        trial, baseline_trial: The two trials' numbers.
        acceptance_rate: The engine's accepted / drafted in that trial, where it recorded it.
        pairs: Pairs measured at this slot count (the best of them is shown).
    """

    parallel: int
    gain: float
    with_tok_s: float
    without_tok_s: float
    speculation: Mapping[str, Any]
    trial: int
    baseline_trial: int
    acceptance_rate: float | None
    pairs: int

    def as_dict(self) -> dict[str, Any]:
        return {
            "parallel": self.parallel,
            "gain": self.gain,
            "with_tok_s": self.with_tok_s,
            "without_tok_s": self.without_tok_s,
            "speculation": dict(self.speculation),
            "trial": self.trial,
            "baseline_trial": self.baseline_trial,
            "acceptance_rate": self.acceptance_rate,
            "pairs": self.pairs,
        }


def _speculates(config: Mapping[str, Any]) -> bool:
    return str(config.get("spec_type", "none")) != "none"


def _acceptance_rate(r: TrialRecord) -> float | None:
    """The trial's measured acceptance rate (its ``acceptance`` record: accepted / drafted)."""
    found = getattr(r, "acceptance", None) or r.raw.get("acceptance")
    if isinstance(found, str):
        try:
            found = json.loads(found)
        except ValueError:
            return None
    rate = found.get("rate") if isinstance(found, Mapping) else None
    return float(rate) if isinstance(rate, (int, float)) else None


def gains(rows: Iterable[TrialRecord], metric: str = "aggregate_tok_s") -> list[SlotGain]:
    """Speculation's best gain at each slot count the study measured with and without it, by
    ``parallel``. Empty when no configuration was measured both ways."""
    plain: dict[tuple[str, int], tuple[float, int]] = {}
    speculated: list[tuple[str, int, float, TrialRecord]] = []
    for r in rows:
        value = r.median(metric) if r.state == TrialState.COMPLETE and r.config else None
        if value is None or r.config is None:
            continue
        config = dict(r.config)
        parallel = int(config.get("parallel", 1))
        rest = json.dumps(
            {k: v for k, v in config.items() if k not in SPEC_OPTIONS and k != "parallel"}, sort_keys=True, default=str
        )
        if _speculates(config):
            speculated.append((rest, parallel, value, r))
        elif (rest, parallel) not in plain or value > plain[(rest, parallel)][0]:
            plain[(rest, parallel)] = (value, r.number)
    best: dict[int, SlotGain] = {}
    pairs: dict[int, int] = {}
    for rest, parallel, value, r in speculated:
        base = plain.get((rest, parallel))
        if base is None or base[0] <= 0:
            continue
        pairs[parallel] = pairs.get(parallel, 0) + 1
        gain = value / base[0]
        if parallel not in best or gain > best[parallel].gain:
            spec = {k: v for k, v in dict(r.config or {}).items() if k in SPEC_OPTIONS}
            best[parallel] = SlotGain(parallel, gain, value, base[0], spec, r.number, base[1], _acceptance_rate(r), 0)
    return [SlotGain(**{**g.as_dict(), "pairs": pairs[p]}) for p, g in sorted(best.items())]


def _spec_words(spec: Mapping[str, Any]) -> str:
    words = [str(spec.get("spec_type"))]
    words += [f"{k.removeprefix('spec_').replace('_', '-')} {v}" for k, v in spec.items() if k != "spec_type"]
    return ", ".join(words)


def gain_lines(found: list[SlotGain], metric: str = "aggregate_tok_s") -> list[str]:
    """The gain against slots as the text report prints it (empty without pairs)."""
    if not found:
        return []
    lines = [f"speculation against slots ({metric}: the best speculation / the same configuration without):"]
    for g in found:
        rate = f", acceptance {g.acceptance_rate:.2f}" if g.acceptance_rate is not None else ""
        lines.append(
            f"  parallel {g.parallel}: x{g.gain:.2f} ({g.with_tok_s:.1f} vs {g.without_tok_s:.1f}; "
            f"{_spec_words(g.speculation)}{rate}; trials {g.trial} vs {g.baseline_trial}, "
            f"{g.pairs} pair{'s' if g.pairs != 1 else ''})"
        )
    return lines


def verdict(found: list[SlotGain], metric: str = "aggregate_tok_s") -> str | None:
    """When speculation loses, in one line: the fewest slots from which no speculation beat none
    at any larger slot count measured (``speculation loses from 4 slots: x0.84 aggregate``);
    None without pairs."""
    if not found:
        return None
    word = metric.removesuffix("_tok_s").replace("_", "-")
    losing = [g for g in found if g.gain < 1.0]
    if not losing:
        return (
            f"speculation wins at every slot count measured ({found[0].parallel}-{found[-1].parallel}): "
            f"x{min(g.gain for g in found):.2f} {word} at worst"
        )
    start = (
        next(i for i, g in enumerate(found) if all(h.gain < 1.0 for h in found[i:])) if found[-1].gain < 1.0 else None
    )
    if start is None:
        slots = ", ".join(str(g.parallel) for g in losing)
        return f"speculation loses at {slots} slot{'s' if slots != '1' else ''} (not from a slot count on)"
    first = found[start]
    if start == 0:
        return f"speculation loses at every slot count measured: x{first.gain:.2f} {word} at {first.parallel}"
    return f"speculation loses from {first.parallel} slots: x{first.gain:.2f} {word}"
