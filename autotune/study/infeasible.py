"""Why a study found no feasible configuration, per cause (issue 41, item 4).

"No feasible configuration: the counts and reasons above say which" printed no reason: a study
whose every configuration broke a latency target, or a rule of its engine, left the user to
read the storage. :func:`no_feasible_lines` says, per cause, how many configurations it stopped
and, for a measured target, the closest miss (the configuration to relax the target or the
space around).
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Callable, Iterable

from autotune.study.objective import PER_USER, QUALITY, VRAM
from autotune.study.records import TrialRecord, TrialState

__all__ = ["no_feasible_lines"]

# A constraint's value is a distance past its bound (objective.score): relative for memory,
# per-user speed and latency targets, in points for quality. 1e9: the figure was not measured.
_NOT_MEASURED = 1e8


def _constraint_words(name: str) -> tuple[str, str]:
    """(what was broken, how the miss is said: "%" relative or "points")."""
    if name == VRAM:
        return "the memory budget", "%"
    if name == QUALITY:
        return "the quality bound (max_drop_points)", "points"
    if name == PER_USER:
        return "the per-user speed floor (min_per_user_tok_s)", "%"
    if name.startswith("slo_"):
        return f"the latency target {name[4:]}", "%"
    return name, "%"


def _miss(value: float, unit: str) -> str:
    if value >= _NOT_MEASURED:
        return "not measured"
    return f"{value:.2f} points over" if unit == "points" else f"{100 * value:.1f}% past it"


def _cause(reason: str) -> str:
    """A reason's cause, to count by: its first clause with the numbers taken out, so that
    "ubatch 512 exceeds batch 64" and "ubatch 1024 exceeds batch 64" are one cause."""
    reason = reason.removeprefix("invalid: ")  # the judge's word for every rule: the rule's own reason counts
    first = reason.split(": ", 1)[0].strip() or reason
    return re.sub(r"\d+(\.\d+)?", "N", first)[:100]


def no_feasible_lines(found: Iterable[TrialRecord], kind_of: Callable[[str | None], str]) -> list[str]:
    """Per cause, the configurations it stopped: not launched (the rule's or the memory
    model's reason, an example), failed (by kind), measured but over a bound (how many, and the
    closest miss with its trial). Answers from storage count once, as their first trial did.
    ``kind_of``: a failure's reason in a few words (``summary.failure_kind``)."""
    pruned: dict[str, list[TrialRecord]] = {}
    failed: Counter[str] = Counter()
    broken: dict[str, list[tuple[float, TrialRecord]]] = {}
    for r in found:
        if r.answered:
            continue
        if r.state == TrialState.PRUNED:
            pruned.setdefault(_cause(r.prune_reason or "no reason recorded"), []).append(r)
        elif r.state == TrialState.FAIL and not r.retry:
            failed[kind_of(r.fail_reason)] += 1
        elif r.state == TrialState.COMPLETE:
            for name, value in r.constraints.items():
                if value > 0:
                    broken.setdefault(name, []).append((value, r))
    lines = []
    for name, misses in sorted(broken.items(), key=lambda kv: -len(kv[1])):
        what, unit = _constraint_words(name)
        value, closest = min(misses, key=lambda m: m[0])
        lines.append(
            f"{len(misses)} measured configuration{'s' if len(misses) != 1 else ''} broke {what}; "
            f"the closest, trial {closest.number}, was {_miss(value, unit)}"
        )
    for cause, rs in sorted(pruned.items(), key=lambda kv: -len(kv[1])):
        example = rs[0]
        reason = (example.prune_reason or "no reason recorded").removeprefix("invalid: ")
        lines.append(f"{len(rs)} not launched: {reason} (e.g. trial {example.number})")
    for kind, n in failed.most_common():
        lines.append(f"{n} failed: {kind}")
    return lines
