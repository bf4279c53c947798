"""A study's outcome: counts, the best feasible trial and the Pareto front, from its records.

After the noise-aware finish (``StudyRunner.finish``) the best is the finish's verdict: the
top trials measured again, a winner only where its lead is larger than the noise between runs
can explain, and among configurations that tie, the one with more memory headroom
(``finish_verdict``).
"""

from __future__ import annotations

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
from autotune.study.verdict import best_trial, finish_verdict, memory_text


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


_FIGURES = (
    ("decode_tok_s", "decode"),
    ("aggregate_tok_s", "aggregate"),
    ("per_user_tok_s", "per user"),
    ("prefill_tok_s", "prefill"),
)


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
    lines = [
        ", ".join(figures)
        + f" (median of {runs} runs: the first and {runs - 1} of the finish"
        + (f"; range {spread * 100:.1f}%" if spread is not None else "")
        + ")"
    ]
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
        parts.append(
            f"{label} p50/p95/p99 {'/'.join(f'{v:.0f}' for v in values)} ms"
            + (f" (target {', '.join(mine)})" if mine else "")
        )
    return "; ".join(parts)


def counts_text(summary: StudySummary) -> str:
    """``84 trials: 45 complete, 32 pruned, 0 failed, 7 answered from storage``: every state
    named, so the parts add up to the total (``study``, ``best``, the report, the dashboard)."""
    extra = summary.extra
    parts = [f"{summary.n_complete} complete", f"{summary.n_pruned} pruned", f"{summary.n_failed} failed"]
    for key, words in (
        ("n_answered_from_storage", "answered from storage (an earlier trial's outcome)"),
        ("n_cut_short", "cut short and queued again"),
        ("n_deferred", "not started (their weights would take longer to make than the budget had left)"),
        ("n_running", "still running"),
        ("n_queued", "queued, not started"),
    ):
        if extra.get(key):
            parts.append(f"{extra[key]} {words}")
    return f"{summary.n_trials} trials: " + ", ".join(parts)


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
    n_running = sum(
        1
        for r in all_records
        if r.state not in (TrialState.COMPLETE, TrialState.FAIL, TrialState.PRUNED, TrialState.WAITING)
    )
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
        extra={
            "n_answered_from_storage": n_answered,
            "n_cut_short": n_cut_short,
            **({"n_running": n_running} if n_running else {}),
            **({"n_queued": n_queued} if n_queued else {}),
            **({"n_deferred": n_deferred} if n_deferred else {}),
            **(
                {"failed_by_reason": dict(sorted(failed_by.items(), key=lambda kv: (-kv[1], kv[0])))}
                if failed_by
                else {}
            ),
        },
    )
    if finish is not None:
        summary.extra["finish"] = finish
    if best is None and all_records:  # why nothing is feasible, per cause (issue 41)
        summary.extra["no_feasible"] = no_feasible_lines(all_records, failure_kind)
    # Configurations another worker (this host or another) still measures, or left RUNNING when
    # it died: until they end, the best above may not be the study's.
    measuring = [
        h.as_dict()
        for t, h in claims.running_holders(study)
        if t.user_attrs.get("config_key") and t.user_attrs.get("answered_from") is None
    ]
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
        summary.extra["baseline"] = compare(
            summary.best, baselines, goodput=bool(slo), rounds=noise.baseline_rounds(study), between=spread.between
        )
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
        summary.extra["speculation_gain"] = {
            "slots": [g.as_dict() for g in found],
            "verdict": speculation_gain.verdict(found),
        }
    return summary
