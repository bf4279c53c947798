"""The finish round's verdict: the leaders as contenders (their runs, median, spread, memory), the lead
each needs over another to count, and which one won or whether they tie."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any, Sequence
import optuna
from autotune.study import records
from autotune.study.records import TrialRecord


# Peak memory figures closer than this are one footprint seen through measurement noise, not
# headroom worth a slower configuration: per-user speed decides between them instead.
def best_trial(study: optuna.Study) -> TrialRecord | None:
    """The best feasible trial that measured itself (first objective for a Pareto study)."""
    best = None
    for r in records.measured(study):
        if r.feasible and r.values and (best is None or r.values[0] > best.values[0]):  # type: ignore[index]
            best = r
    return best


def memory_text(n_bytes: float) -> str:
    """A footprint or a difference of footprints in the unit that keeps it from rounding to 0:
    GiB from 0.1 GiB, else MiB, else KiB (a small model's 20 MiB less is no "0.0 GiB less")."""
    if abs(n_bytes) >= 2**30 / 10:
        return f"{n_bytes / 2**30:.2f} GiB"
    if abs(n_bytes) >= 2**20:
        return f"{n_bytes / 2**20:.1f} MiB"
    return f"{n_bytes / 2**10:.0f} KiB"


def _trials(numbers: list[int]) -> str:
    shown = [str(n) for n in numbers]
    return shown[0] if len(shown) == 1 else ", ".join(shown[:-1]) + " and " + shown[-1]


def _pct(x: float) -> str:
    return f"{x * 100:.1f}%"


SAME_MEMORY = 0.02
# Exact predictions this close are the same figure written twice (float rounding), not a lead.
EXACT_SAME = 1e-9
# A lead is called at this two-sided confidence (pyperf's compare_to uses the same level).
CONFIDENCE = 0.95


def finish_candidates(study: optuna.Study, top: int) -> list[TrialRecord]:
    """The ``top`` best feasible measured trials, best first: what the finish measures again."""
    pool = [r for r in records.measured(study) if r.feasible and r.values]
    return sorted(pool, key=lambda r: -r.values[0])[:top]  # type: ignore[index]


def _relative(a: float, b: float) -> float:
    """How much ``a`` exceeds ``b``, as a fraction of ``b`` (finite, for JSON, when ``b`` is 0)."""
    return (a - b) / max(abs(b), 1e-9)


@dataclass(frozen=True)
class _Contender:
    record: TrialRecord
    rounds: list[records.Remeasure]

    @property
    def values(self) -> list[float]:
        return [m.value for m in self.rounds if not m.failed and m.feasible and m.value is not None]

    @property
    def failures(self) -> list[str]:
        return [
            m.error if m.failed else "infeasible when measured again" for m in self.rounds if m.failed or not m.feasible
        ]

    @property
    def runs(self) -> list[float]:
        """Every value of it: the first measurement and the finish's. The first is biased upwards
        (it was picked for being high), as is every contender's, so the bias mostly cancels in a
        comparison, and it adds a degree of freedom to the noise estimate."""
        return self.values + [self.record.values[0]]  # type: ignore[index]

    @property
    def median(self) -> float:
        """Over every run, the first included: the figure the headline shows (``headline``)."""
        return statistics.median(self.runs)

    @property
    def mean(self) -> float:
        return statistics.fmean(self.runs)

    @property
    def spread(self) -> float:
        """The range of every run of it, relative to the finish's median (shown; not the test)."""
        runs = self.runs
        return (max(runs) - min(runs)) / abs(self.median) if self.median else 0.0

    def memory(self, measured: bool) -> int | None:
        peaks = [m.peak_vram_bytes for m in self.rounds if m.peak_vram_bytes is not None]
        if measured:
            return int(statistics.median(peaks)) if peaks else self.record.measured_vram_bytes
        return (self.record.predicted_vram or {}).get("total_bytes")

    @property
    def per_user(self) -> float | None:
        seen = [m.per_user_tok_s for m in self.rounds if m.per_user_tok_s is not None and not m.failed]
        return statistics.median(seen) if seen else None

    def describe(self, measured_memory: bool) -> dict[str, Any]:
        return {
            "number": self.record.number,
            "first_value": self.record.values[0],  # type: ignore[index]
            "remeasured": [m.value for m in self.rounds],
            "median": self.median if self.values else None,
            "mean": self.mean if self.values else None,
            "spread": self.spread if self.values else None,
            "memory_bytes": self.memory(measured_memory),
            "memory_measured": measured_memory,
            "per_user_tok_s": self.per_user,
            "failures": self.failures,
        }


def needed_lead(a: Sequence[float], b: Sequence[float]) -> float:
    """The lead of the mean of runs ``a`` over that of runs ``b`` (relative to ``b``'s) that the
    runs' noise cannot explain: Student's two-sample t-test with pooled variance at
    ``CONFIDENCE`` (two-sided).

    Not the range of the runs: a range only grows with more runs, so measuring more would call
    fewer winners. Zero where every run of both agreed exactly (the twin without noise)."""
    na, nb = len(a), len(b)
    df = na + nb - 2
    if df < 1:
        return math.inf
    pooled = ((na - 1) * statistics.variance(a) if na > 1 else 0.0) + (
        (nb - 1) * statistics.variance(b) if nb > 1 else 0.0
    )
    se = math.sqrt(pooled / df * (1 / na + 1 / nb))
    if se == 0:
        return 0.0  # any quantile times 0: without importing scipy.stats (half a second) for it
    from scipy.stats import t as student

    return float(student.ppf(0.5 + CONFIDENCE / 2, df)) * se / max(abs(statistics.fmean(b)), 1e-9)


def finish_verdict(study: optuna.Study) -> dict[str, Any] | None:
    """What the finish concluded, from its stored rounds; None where there was no finish, or
    where a later run found a better trial that no finish has measured again.

    A winner is called only when the lead of its mean (over every run: the first measurement
    and the finish's) over the runner-up's is larger than the noise between runs can explain
    (``needed_lead``, a two-sample t-test): measured on an H200, one configuration gave 473 and
    520 tok/s in two runs while each run's own spread was under 0.5%. Every configuration whose
    gap to the leader is inside that noise ties with it; among them the smaller memory footprint
    wins (more headroom for longer prompts and other processes), then the higher per-user speed.
    A configuration that failed, or broke a constraint, when measured again cannot win: a deploy
    line that fails one launch in three is worse than a slower one.
    """
    plan = records.finish_plan(study)
    best = best_trial(study)
    if plan is None or best is None or len(study.directions) > 1:
        return None
    numbers, n_rounds = plan
    if best.number not in numbers:
        return None
    by_number = {r.number: r for r in records.measured(study)}
    stored = records.remeasures(study)
    contenders = [
        _Contender(by_number[n], [stored.get(n, {})[i] for i in range(n_rounds) if i in stored.get(n, {})])
        for n in numbers
        if n in by_number
    ]
    out: dict[str, Any] = {"rounds": n_rounds, "trials": [c.record.number for c in contenders], "chosen": None}
    n_stored = sum(len(c.rounds) for c in contenders)
    if n_stored < len(contenders) * n_rounds:
        out.update(
            verdict="incomplete",
            text=f"finish incomplete: {n_stored} of {len(contenders) * n_rounds} "
            "re-measures stored (run the study again to complete it); "
            "best by its first measurement",
        )
        return out
    if n_rounds == 0:
        return _exact_verdict(out, contenders)
    sound = sorted((c for c in contenders if c.values and not c.failures), key=lambda c: (-c.mean, -c.record.values[0]))  # type: ignore[index]
    measured_memory = all(c.memory(True) is not None for c in sound)
    out["contenders"] = [c.describe(measured_memory) for c in contenders]
    failed = [c.record.number for c in contenders if not c.values or c.failures]
    failed_note = f"; trial {_trials(failed)} failed when measured again" if failed else ""
    if not sound:
        out.update(
            verdict="failed",
            text="every configuration failed when measured again: best by its first measurement, unconfirmed",
        )
        return out
    leader = sound[0]
    if len(sound) == 1:
        out.update(
            verdict="winner",
            chosen=leader.record.number,
            text=f"winner: trial {leader.record.number} (the only one that ran every time{failed_note})",
        )
        return out
    runner_up = sound[1]
    lead = _relative(leader.mean, runner_up.mean)
    needed = needed_lead(leader.runs, runner_up.runs)
    spread = max(leader.spread, runner_up.spread)
    out.update(lead=lead, needed=needed, spread=spread, confidence=CONFIDENCE)
    runs = (
        f"{len(leader.runs)} and {len(runner_up.runs)} runs"
        if len(leader.runs) != len(runner_up.runs)
        else f"{len(leader.runs)} runs each"
    )
    if lead > needed:
        out.update(
            verdict="winner",
            chosen=leader.record.number,
            tied=[leader.record.number],
            text=f"winner: trial {leader.record.number} (lead {_pct(lead)} over trial {runner_up.record.number}, "
            f"beyond the {_pct(needed)} that run-to-run noise explains at {CONFIDENCE:.0%} confidence, "
            f"{runs}; {len(contenders)} configurations measured again {n_rounds}x, interleaved{failed_note})",
        )
        return out
    tied = [c for c in sound if c is leader or _relative(leader.mean, c.mean) <= needed_lead(leader.runs, c.runs)]
    memory = {c.record.number: c.memory(measured_memory) for c in tied}
    least = min((m for m in memory.values() if m is not None), default=None)
    near = [c for c in tied if least is None or (memory[c.record.number] or math.inf) <= least * (1 + SAME_MEMORY)]
    chosen = max(near, key=lambda c: (c.per_user if c.per_user is not None else -math.inf, c.median))
    other = next(c for c in tied if c is not chosen)  # the fastest of the rest
    mine, theirs = memory[chosen.record.number], memory[other.record.number]
    if mine is not None and theirs is not None and theirs > mine * (1 + SAME_MEMORY):
        why = f"{memory_text(theirs - mine)} less memory" + ("" if measured_memory else " (predicted)")
    elif chosen.per_user is not None and other.per_user is not None and chosen.per_user != other.per_user:
        why = f"per-user {chosen.per_user:.1f} vs {other.per_user:.1f} tok/s"
    else:
        why = "the higher median"
    out.update(
        verdict="tie",
        chosen=chosen.record.number,
        tied=[c.record.number for c in tied],
        text=f"tie between trials {_trials([c.record.number for c in tied])} (lead {_pct(lead)}, within "
        f"the {_pct(needed)} that run-to-run noise explains at {CONFIDENCE:.0%} confidence, {runs}): "
        f"chose {chosen.record.number}, {why}"
        f"{failed_note}",
    )
    return out


def _exact_verdict(out: dict[str, Any], contenders: list[_Contender]) -> dict[str, Any]:
    """The verdict where the leaders' figures repeat exactly (a model without noise: the finish
    measured nothing again, ``BaseBackend.repeats_exactly``). Equal figures are one answer, not a
    tie to resolve: the one with the least predicted memory stands for it (more headroom, the
    finish's rule for ties), then the higher per-user speed; any lead at all is a winner's."""
    ranked = sorted(contenders, key=lambda c: -c.record.values[0])  # type: ignore[index]
    top = ranked[0].record.values[0]  # type: ignore[index]
    same = [c for c in ranked if _relative(top, c.record.values[0]) <= EXACT_SAME]  # type: ignore[index]
    memory = {c.record.number: c.memory(False) for c in same}

    def per_user(c: _Contender) -> float:
        value = c.record.median("per_user_tok_s")
        return value if value is not None else -math.inf

    chosen = min(
        same, key=lambda c: (memory[c.record.number] if memory[c.record.number] is not None else math.inf, -per_user(c))
    )
    out.update(
        verdict="winner" if len(same) == 1 else "tie",
        chosen=chosen.record.number,
        tied=[c.record.number for c in same],
        lead=0.0,
        needed=0.0,
    )
    if len(same) == 1:
        runner_up = ranked[1]
        out["lead"] = _relative(top, runner_up.record.values[0])  # type: ignore[index]
        out["text"] = (
            f"winner: trial {chosen.record.number} ({_pct(out['lead'])} above trial "
            f"{runner_up.record.number}; the figures are exact predictions, so nothing was measured again)"
        )
        return out
    mine = memory[chosen.record.number]
    others = [memory[c.record.number] for c in same if c is not chosen]
    if mine is None or any(m is None for m in others):
        why = "the highest per-user speed"
    elif all(m > mine * (1 + SAME_MEMORY) for m in others):  # type: ignore[operator]
        why = f"the least memory ({memory_text(min(others) - mine)} less, predicted)"  # type: ignore[type-var,operator]
    else:
        why = "the least memory (predicted), then the highest per-user speed"
    out["text"] = (
        f"trials {_trials([c.record.number for c in same])} are predicted the same score "
        f"({top:.1f}): one answer, trial {chosen.record.number}, {why}"
    )
    return out


def worth_another_round(verdict: dict[str, Any] | None) -> bool:
    """Whether a finish's tie may be a real gap measured too few times: a lead of at least half
    what noise explains (below that, the configurations are as good as equal, and more runs
    would most likely confirm the tie). On the H200 a 7.7% gap (11 runs each) was called a tie
    on 3 runs each, at a lead of 4.7% against 5.9% (docs/search.md)."""
    return (
        verdict is not None
        and verdict.get("verdict") == "tie"
        and verdict.get("lead", 0.0) >= verdict.get("needed", math.inf) / 2
    )
