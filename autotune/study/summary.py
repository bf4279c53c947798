"""A study's outcome: counts, the best feasible trial and the Pareto front, from its records.

After the noise-aware finish (``StudyRunner.finish``) the best is the finish's verdict: the
top trials measured again, a winner only where its lead is larger than the noise between runs
can explain, and among configurations that tie, the one with more memory headroom
(``finish_verdict``).
"""

from __future__ import annotations

import math
import re
import statistics
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Sequence

import optuna

from autotune.study.objective import objective_words
from autotune.study import claims, noise, records, speculation_gain
from autotune.study.baseline import compare
from autotune.study.infeasible import no_feasible_lines
from autotune.study.records import TrialRecord, TrialState


@dataclass
class StudySummary:
    """The outcome of a run (``autotune study``) or of a stored study (``autotune best``).

    ``storage`` is always the masked URL: a summary is printed and stored."""

    study_name: str
    storage: str
    n_trials: int
    n_complete: int
    n_failed: int
    n_pruned: int
    n_new: int
    n_measured: int
    interrupted: bool
    elapsed_s: float
    best: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def best_trial(study: optuna.Study) -> TrialRecord | None:
    """The best feasible trial that measured itself (first objective for a Pareto study)."""
    best = None
    for r in records.measured(study):
        if r.feasible and r.values and (best is None or r.values[0] > best.values[0]):  # type: ignore[index]
            best = r
    return best


def pareto_front(study: optuna.Study) -> list[TrialRecord]:
    """Feasible measured trials that no other feasible one beats on every objective."""
    signs = [1.0 if d == optuna.study.StudyDirection.MAXIMIZE else -1.0 for d in study.directions]
    pool = [r for r in records.measured(study) if r.feasible and r.values]

    def dominates(a: TrialRecord, b: TrialRecord) -> bool:
        pairs = [(s * x, s * y) for s, x, y in zip(signs, a.values or (), b.values or ())]
        return all(x >= y for x, y in pairs) and any(x > y for x, y in pairs)

    front = [r for r in pool if not any(dominates(o, r) for o in pool if o is not r)]
    return sorted(front, key=lambda r: -signs[0] * r.values[0])  # type: ignore[index]


def trial_record(r: TrialRecord) -> dict[str, Any]:
    """What ``autotune best`` shows of a trial."""
    return {
        "number": r.number,
        "params": dict(r.config or {}),
        "values": list(r.values) if r.values else None,
        "metrics": {k: v.get("median") for k, v in r.metrics.items()},
        "spreads": {k: v.get("spread") for k, v in r.metrics.items()},
        "quality": r.quality,
        "predicted_vram": r.predicted_vram,
        "measured_vram_bytes": r.measured_vram_bytes,
        "deploy_command": r.deploy_command,
        "engine": r.engine,
        "gpu": r.gpu,
        "artifacts": list(r.artifacts),
    }


# ------------------------------------------------------------------ the finish's verdict

# Peak memory figures closer than this are one footprint seen through measurement noise, not
# headroom worth a slower configuration: per-user speed decides between them instead.
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
        return [m.error if m.failed else "infeasible when measured again" for m in self.rounds
                if m.failed or not m.feasible]

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
        return {"number": self.record.number, "first_value": self.record.values[0],  # type: ignore[index]
                "remeasured": [m.value for m in self.rounds], "median": self.median if self.values else None,
                "mean": self.mean if self.values else None,
                "spread": self.spread if self.values else None, "memory_bytes": self.memory(measured_memory),
                "memory_measured": measured_memory, "per_user_tok_s": self.per_user, "failures": self.failures}


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
    pooled = ((na - 1) * statistics.variance(a) if na > 1 else 0.0) + \
        ((nb - 1) * statistics.variance(b) if nb > 1 else 0.0)
    se = math.sqrt(pooled / df * (1 / na + 1 / nb))
    if se == 0:
        return 0.0  # any quantile times 0: without importing scipy.stats (half a second) for it
    from scipy.stats import t as student

    return float(student.ppf(0.5 + CONFIDENCE / 2, df)) * se / max(abs(statistics.fmean(b)), 1e-9)


def memory_text(n_bytes: float) -> str:
    """A footprint or a difference of footprints in the unit that keeps it from rounding to 0:
    GiB from 0.1 GiB, else MiB, else KiB (a small model's 20 MiB less is no "0.0 GiB less")."""
    if abs(n_bytes) >= 2**30 / 10:
        return f"{n_bytes / 2**30:.2f} GiB"
    if abs(n_bytes) >= 2**20:
        return f"{n_bytes / 2**20:.1f} MiB"
    return f"{n_bytes / 2**10:.0f} KiB"


def contender_text(c: dict[str, Any]) -> str:
    """One trial of the finish (``finish_verdict``'s contenders) for people: its first score,
    each re-measured one, and what decides a tie."""
    again = ", ".join("failed" if v is None else f"{v:.1f}" for v in c["remeasured"])
    text = f"trial {c['number']}: first {c['first_value']:.1f}, again {again}"
    if c["median"] is not None:
        text += f" (mean {c['mean']:.1f}, median {c['median']:.1f}, range {c['spread'] * 100:.1f}%)"
    memory = "-" if c["memory_bytes"] is None else memory_text(c["memory_bytes"])
    text += f", {memory} {'measured' if c['memory_measured'] else 'predicted'}"
    if c["per_user_tok_s"] is not None:
        text += f", per user {c['per_user_tok_s']:.1f} tok/s"
    if c["failures"]:
        text += f"; {c['failures'][0]}"
    return text


_FIGURES = (("decode_tok_s", "decode"), ("aggregate_tok_s", "aggregate"), ("per_user_tok_s", "per user"),
            ("prefill_tok_s", "prefill"))


def _figures(m: dict[str, Any]) -> list[str]:
    out = [f"{label} {m[key]:.1f} tok/s" for key, label in _FIGURES if m.get(key) is not None]
    if m.get("ttft_ms") is not None:
        out.append(f"TTFT {m['ttft_ms']:.0f} ms")
    return out


def headline_lines(best: dict[str, Any]) -> list[str]:
    """The best's figures for people (``study``, ``best``, the report, the dashboard note): the
    median over every run where the finish measured it again (``headline``), then the first run
    as such; the first run alone where there was no finish."""
    figures = _figures(best.get("metrics") or {})
    if not figures:
        return []
    runs = max((best.get("runs") or {}).values(), default=1)
    if runs < 2:
        return [", ".join(figures)]
    spread = (best.get("spreads") or {}).get("aggregate_tok_s")
    lines = [", ".join(figures) + f" (median of {runs} runs: the first and {runs - 1} of the finish"
             + (f"; range {spread * 100:.1f}%" if spread is not None else "") + ")"]
    first = _figures((best.get("first_run") or {}).get("metrics") or {})
    if first:
        lines.append("first run (the search's, picked for being high): " + ", ".join(first))
    return lines


def latency_line(best: dict[str, Any], slo: Sequence[Sequence[Any]]) -> str | None:
    """The best's latency percentiles and goodput against the study's targets, for people:
    ``goodput 36.2 tok/s (0.12 req/s); TTFT p50/p95/p99 503/2125/3021 ms (target p95 3000)...``."""
    m = best.get("metrics") or {}
    if m.get("goodput_tok_s") is None:
        return None
    targets = {str(k): float(v) for k, v in slo}
    parts = [f"goodput {m['goodput_tok_s']:.1f} tok/s ({m.get('goodput_req_s', 0):.2f} req/s within the targets)"]
    for q, label in (("ttft", "TTFT"), ("itl", "ITL"), ("e2e", "E2E")):
        values = [m.get(f"{q}_p{p}_ms") for p in (50, 95, 99)]
        if any(v is None for v in values):
            continue
        mine = [f"p{k.split('_p')[1].split('_')[0]} {t:g}" for k, t in targets.items() if k.startswith(f"{q}_p")]
        parts.append(f"{label} p50/p95/p99 {'/'.join(f'{v:.0f}' for v in values)} ms"
                     + (f" (target {', '.join(mine)})" if mine else ""))
    return "; ".join(parts)


def counts_text(summary: StudySummary) -> str:
    """``84 trials: 45 complete, 32 pruned, 0 failed, 7 answered from storage``: every state
    named, so the parts add up to the total (``study``, ``best``, the report, the dashboard)."""
    extra = summary.extra
    parts = [f"{summary.n_complete} complete", f"{summary.n_pruned} pruned", f"{summary.n_failed} failed"]
    for key, words in (("n_answered_from_storage", "answered from storage (an earlier trial's outcome)"),
                       ("n_cut_short", "cut short and queued again"),
                       ("n_deferred", "not started (their weights would take longer to make than the budget had left)"),
                       ("n_running", "still running"),
                       ("n_queued", "queued, not started")):
        if extra.get(key):
            parts.append(f"{extra[key]} {words}")
    return f"{summary.n_trials} trials: " + ", ".join(parts)


def _trials(numbers: list[int]) -> str:
    shown = [str(n) for n in numbers]
    return shown[0] if len(shown) == 1 else ", ".join(shown[:-1]) + " and " + shown[-1]


def _pct(x: float) -> str:
    return f"{x * 100:.1f}%"


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
    contenders = [_Contender(by_number[n], [stored.get(n, {})[i] for i in range(n_rounds) if i in stored.get(n, {})])
                  for n in numbers if n in by_number]
    out: dict[str, Any] = {"rounds": n_rounds, "trials": [c.record.number for c in contenders], "chosen": None}
    n_stored = sum(len(c.rounds) for c in contenders)
    if n_stored < len(contenders) * n_rounds:
        out.update(verdict="incomplete", text=f"finish incomplete: {n_stored} of {len(contenders) * n_rounds} "
                                              "re-measures stored (run the study again to complete it); "
                                              "best by its first measurement")
        return out
    if n_rounds == 0:
        return _exact_verdict(out, contenders)
    sound = sorted((c for c in contenders if c.values and not c.failures),
                   key=lambda c: (-c.mean, -c.record.values[0]))  # type: ignore[index]
    measured_memory = all(c.memory(True) is not None for c in sound)
    out["contenders"] = [c.describe(measured_memory) for c in contenders]
    failed = [c.record.number for c in contenders if not c.values or c.failures]
    failed_note = f"; trial {_trials(failed)} failed when measured again" if failed else ""
    if not sound:
        out.update(verdict="failed", text="every configuration failed when measured again: "
                                          "best by its first measurement, unconfirmed")
        return out
    leader = sound[0]
    if len(sound) == 1:
        out.update(verdict="winner", chosen=leader.record.number,
                   text=f"winner: trial {leader.record.number} (the only one that ran every time{failed_note})")
        return out
    runner_up = sound[1]
    lead = _relative(leader.mean, runner_up.mean)
    needed = needed_lead(leader.runs, runner_up.runs)
    spread = max(leader.spread, runner_up.spread)
    out.update(lead=lead, needed=needed, spread=spread, confidence=CONFIDENCE)
    runs = f"{len(leader.runs)} and {len(runner_up.runs)} runs" if len(leader.runs) != len(runner_up.runs) \
        else f"{len(leader.runs)} runs each"
    if lead > needed:
        out.update(verdict="winner", chosen=leader.record.number, tied=[leader.record.number],
                   text=f"winner: trial {leader.record.number} (lead {_pct(lead)} over trial {runner_up.record.number}, "
                        f"beyond the {_pct(needed)} that run-to-run noise explains at {CONFIDENCE:.0%} confidence, "
                        f"{runs}; {len(contenders)} configurations measured again {n_rounds}x, interleaved{failed_note})")
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
    out.update(verdict="tie", chosen=chosen.record.number, tied=[c.record.number for c in tied],
               text=f"tie between trials {_trials([c.record.number for c in tied])} (lead {_pct(lead)}, within "
                    f"the {_pct(needed)} that run-to-run noise explains at {CONFIDENCE:.0%} confidence, {runs}): "
                    f"chose {chosen.record.number}, {why}"
                    f"{failed_note}")
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

    chosen = min(same, key=lambda c: (memory[c.record.number] if memory[c.record.number] is not None else math.inf,
                                      -per_user(c)))
    out.update(verdict="winner" if len(same) == 1 else "tie", chosen=chosen.record.number,
               tied=[c.record.number for c in same], lead=0.0, needed=0.0)
    if len(same) == 1:
        runner_up = ranked[1]
        out["lead"] = _relative(top, runner_up.record.values[0])  # type: ignore[index]
        out["text"] = (f"winner: trial {chosen.record.number} ({_pct(out['lead'])} above trial "
                       f"{runner_up.record.number}; the figures are exact predictions, so nothing was measured again)")
        return out
    mine = memory[chosen.record.number]
    others = [memory[c.record.number] for c in same if c is not chosen]
    if mine is None or any(m is None for m in others):
        why = "the highest per-user speed"
    elif all(m > mine * (1 + SAME_MEMORY) for m in others):  # type: ignore[operator]
        why = f"the least memory ({memory_text(min(others) - mine)} less, predicted)"  # type: ignore[type-var,operator]
    else:
        why = "the least memory (predicted), then the highest per-user speed"
    out["text"] = (f"trials {_trials([c.record.number for c in same])} are predicted the same score "
                   f"({top:.1f}): one answer, trial {chosen.record.number}, {why}")
    return out


def worth_another_round(verdict: dict[str, Any] | None) -> bool:
    """Whether a finish's tie may be a real gap measured too few times: a lead of at least half
    what noise explains (below that, the configurations are as good as equal, and more runs
    would most likely confirm the tie). On the H200 a 7.7% gap (11 runs each) was called a tie
    on 3 runs each, at a lead of 4.7% against 5.9% (docs/search.md)."""
    return (verdict is not None and verdict.get("verdict") == "tie"
            and verdict.get("lead", 0.0) >= verdict.get("needed", math.inf) / 2)


_OUT_OF_MEMORY = re.compile(r"out of memory|\bOOM\b|failed to allocate|CUDA_ERROR_OUT_OF_MEMORY", re.IGNORECASE)
_EXITED = re.compile(r"exited with (?:code|status) (-?\d+)")


def failure_kind(reason: str | None) -> str:
    """A failed trial's reason in a few words, to group a study's failures by: out of memory,
    the engine's exit code, else the reason's first clause."""
    if not reason:
        return "no reason recorded"
    if _OUT_OF_MEMORY.search(reason):
        return "out of memory"
    exited = _EXITED.search(reason)
    if exited:
        return f"engine exited (code {exited.group(1)})"
    first = reason.split(": ", 1)[0].strip()
    return first if len(first) <= 60 else first[:57] + "..."


def failures_text(kinds: dict[str, int]) -> str:
    """``3 trials failed: 2 out of memory, 1 engine exited (code 1)``."""
    n = sum(kinds.values())
    return f"{n} trial{'s' if n != 1 else ''} failed: " + ", ".join(f"{k} {kind}" for kind, k in kinds.items())


def headline(best: dict[str, Any], first: TrialRecord, rounds: Sequence[records.Remeasure]) -> dict[str, Any]:
    """The best's figures as the finish measured them: each metric's median over every run of
    the configuration (the first, which the search picked for being high, and each round of the
    finish), its spread the range of those runs relative to that median. The first run's own
    figures are kept as ``first_run``; ``runs`` counts the runs behind each figure.

    A metric a round did not store (rounds from before rounds stored metrics) is taken from the
    runs that did: per-user speed from ``per_user_tok_s``, else the first run alone."""
    sound = [m for m in rounds if not m.failed and m.feasible]
    out = dict(best)
    out["first_run"] = {"metrics": dict(best.get("metrics") or {}), "spreads": dict(best.get("spreads") or {})}
    metrics, spreads, runs = {}, {}, {}
    for key, value in (best.get("metrics") or {}).items():
        seen = [value] if value is not None else []
        for m in sound:
            again = (m.metrics or {}).get(key)
            if again is None and key == "per_user_tok_s":
                again = m.per_user_tok_s
            if again is not None:
                seen.append(again)
        if len(seen) < 2:  # no run of the finish saw it: the first run's figure, named as such
            metrics[key], spreads[key], runs[key] = value, (best.get("spreads") or {}).get(key), len(seen)
            continue
        mid = statistics.median(seen)
        metrics[key], runs[key] = mid, len(seen)
        spreads[key] = (max(seen) - min(seen)) / abs(mid) if mid else 0.0
    out.update(metrics=metrics, spreads=spreads, runs=runs)
    return out


def chosen_best(study: optuna.Study, finish: dict[str, Any] | None = None) -> TrialRecord | None:
    """The study's best: the finish's choice where it made one (``finish``: its verdict, if the
    caller has it), else the best feasible trial."""
    finish = finish_verdict(study) if finish is None else finish
    if finish is not None and finish["chosen"] is not None:
        return next(r for r in records.measured(study) if r.number == finish["chosen"])
    return best_trial(study)


def _best_of(study: optuna.Study, best: TrialRecord | None, finish: dict[str, Any] | None) -> dict[str, Any] | None:
    if best is None:
        return None
    shown = trial_record(best)
    if finish is None or best.number not in finish.get("trials", ()):
        return shown
    stored = records.remeasures(study).get(best.number, {})
    return headline(shown, best, [stored[i] for i in range(finish["rounds"]) if i in stored])


def summarize(study: optuna.Study, shown_storage: str) -> StudySummary:
    """The summary of a study as stored, the one ``study``, ``best``, ``report`` and the
    dashboard note show: counts, the best trial (the finish's choice, where it made one), the
    baselines, and what the last run stored beside the trials (whether it converged, what was
    excluded before the search, why the best beats its neighbours, the twin's calibration)."""
    all_records = records.records(study)
    states = [r.state for r in all_records]
    n_answered = sum(1 for r in all_records if r.answered)
    # An attempt cut short (interrupted, its worker killed) is queued again and says nothing
    # about its configuration: counted apart, not as a failure of the configuration.
    n_cut_short = sum(1 for r in all_records if r.state == TrialState.FAIL and r.retry and not r.deferred)
    n_deferred = sum(1 for r in all_records if r.state == TrialState.FAIL and r.deferred)
    # Why the failed ones failed, most common first: a count alone sends the user to the logs.
    # Still RUNNING (another worker measures it, or one died): named, so the parts add up.
    # WAITING: queued by the strategy (the prior, a cut-short retry) and not started yet
    n_queued = sum(1 for r in all_records if r.state == TrialState.WAITING)
    n_running = sum(1 for r in all_records if r.state not in (TrialState.COMPLETE, TrialState.FAIL, TrialState.PRUNED,
                                                              TrialState.WAITING))
    failed_by = Counter(failure_kind(r.fail_reason) for r in all_records if r.state == TrialState.FAIL and not r.retry)
    finish = finish_verdict(study)
    best = chosen_best(study, finish)
    summary = StudySummary(
        study_name=study.study_name,
        storage=shown_storage,
        n_trials=len(all_records),
        n_complete=states.count(TrialState.COMPLETE),
        n_failed=states.count(TrialState.FAIL) - n_cut_short - n_deferred,
        n_pruned=states.count(TrialState.PRUNED) - n_answered,
        n_new=0,
        n_measured=0,
        interrupted=False,
        elapsed_s=0.0,
        best=_best_of(study, best, finish),
        extra={"n_answered_from_storage": n_answered, "n_cut_short": n_cut_short,
               **({"n_running": n_running} if n_running else {}),
               **({"n_queued": n_queued} if n_queued else {}),
               **({"n_deferred": n_deferred} if n_deferred else {}),
               **({"failed_by_reason": dict(sorted(failed_by.items(), key=lambda kv: (-kv[1], kv[0])))} if failed_by else {})},
    )
    if finish is not None:
        summary.extra["finish"] = finish
    if best is None and all_records:  # why nothing is feasible, per cause (issue 41)
        summary.extra["no_feasible"] = no_feasible_lines(all_records, failure_kind)
    # Configurations another worker (this host or another) still measures, or left RUNNING when
    # it died: until they end, the best above may not be the study's.
    measuring = [h.as_dict() for t, h in claims.running_holders(study)
                 if t.user_attrs.get("config_key") and t.user_attrs.get("answered_from") is None]
    if measuring:
        summary.extra["being_measured"] = measuring
    if len(study.directions) > 1:
        summary.extra["pareto_front"] = [trial_record(r) for r in pareto_front(study)]
    objective = records.study_header(study).get("objective") or {}
    if objective:  # what the finish's figures are: the score, which may not be a rate alone
        summary.extra["objective_words"] = objective_words(objective)
    slo = objective.get("slo")
    if slo:  # the latency targets, for the best's latency line (latency_line)
        summary.extra["slo"] = [list(pair) for pair in slo]
    spread = noise.estimate(study)
    if not spread.silent:  # both spreads, each named (a model's study has neither)
        summary.extra["noise"] = spread.as_dict() | {"text": spread.text()}
    baselines = records.baselines(study)
    if baselines:  # each backend's default launch, and how many times faster the best is
        summary.extra["baseline"] = compare(summary.best, baselines, goodput=bool(slo),
                                            rounds=noise.baseline_rounds(study), between=spread.between)
    decisions = records.quality_decisions(study)
    if decisions:
        summary.extra["quality_decisions"] = decisions
    attrs = study.user_attrs
    if records.QUALITY_POWER_ATTR in attrs:
        summary.extra["quality_power"] = attrs[records.QUALITY_POWER_ATTR]
    last_run = attrs.get(records.LAST_RUN_ATTR)
    if isinstance(last_run, dict) and "converged" in last_run:
        summary.extra["converged"] = bool(last_run["converged"])
    if isinstance(last_run, dict) and last_run.get("stopped"):  # why the last run's search ended
        summary.extra["stopped"] = last_run["stopped"]
    if isinstance(last_run, dict) and last_run.get("systematic_failure"):
        summary.extra["systematic_failure"] = last_run["systematic_failure"]
    summary.extra["excluded_before_search"] = attrs.get(records.EXCLUDED_ATTR, [])
    summary.extra["why"] = attrs.get(records.WHY_BEST_ATTR, [])
    summary.extra["calibration"] = records.stored_calibrations(study)
    found = speculation_gain.gains(all_records)
    if found:  # speculation measured with and without at the same other values (issue 47)
        summary.extra["speculation_gain"] = {"slots": [g.as_dict() for g in found],
                                             "verdict": speculation_gain.verdict(found)}
    return summary
