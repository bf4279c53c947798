"""Reading a study back: the best configuration, its deploy command, and text for people."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import optuna

from autotune.config import MAX_STUDY_NAME
from autotune.hardware.gpus import CPU_KEY
from autotune.errors import ConfigError
from autotune.engine.metric import metric_named
from autotune.report.html import write_report
from autotune.study import records
from autotune.study.speculation_gain import SlotGain, gain_lines
from autotune.study.storage import faults, mask_url, open_storage, study_names
from autotune.study.summary import (
    StudySummary,
    contender_text,
    counts_text,
    failures_text,
    headline_lines,
    latency_line,
    summarize,
)
from autotune.study.verdict import memory_text


def load_study(storage: str, study_name: str | None = None) -> optuna.Study:
    """Open a stored study for reading (nothing is created); with no name, the storage's only study.

    Raises:
        ConfigError: no such storage or study, several and none named (the names are listed),
            or a study this autotune would misread.
    """
    shown = mask_url(storage)
    with faults(shown):
        return _load_study(storage, shown, study_name)


def _load_study(storage: str, shown: str, study_name: str | None) -> optuna.Study:
    store = open_storage(storage, create=False)
    names = study_names(store, shown)
    if not names:
        raise ConfigError(f"storage {shown}: holds no study yet (run 'autotune study' first)")
    if study_name is None:
        if len(names) > 1:
            raise ConfigError(f"storage {shown}: holds several studies, pick one with --study ({', '.join(names)})")
        study_name = names[0]
    if study_name not in names:
        raise ConfigError(f"--study {study_name!r}: not in {shown} (studies: {', '.join(names)})")
    study = optuna.load_study(study_name=study_name, storage=store)
    records.check_schema(study, shown)
    return study


def stored_summary(storage: str, study_name: str | None = None) -> StudySummary:
    """The summary of a stored study (``best``, ``report``): the same one ``study`` printed."""
    with faults(mask_url(storage)):
        return summarize(load_study(storage, study_name), mask_url(storage))


def report_file_name(study_name: str) -> Path:
    """The report's default file: ``<study name>.html`` in the working directory, whatever the
    name holds. A name comes from the storage, which another client may have written
    (``../../../X``, ``/etc/x``): its separators and leading dots become ``_``, so the file is
    always one file name here and never a path elsewhere."""
    safe = re.sub(r"[^A-Za-z0-9_.+-]", "_", study_name).lstrip(".") or "study"
    return Path(safe[:MAX_STUDY_NAME] + ".html")


def write_study_report(study: optuna.Study, summary: StudySummary, out: Path) -> Path:
    """The HTML report (``report_html``) of a study and its summary."""
    return write_report(study, summary, out)


def summary_json(summary: StudySummary) -> dict[str, Any]:
    """The JSON object of ``autotune study --json`` and ``autotune best --json``."""
    out: dict[str, Any] = {
        "study": summary.study_name,
        "storage": summary.storage,
        "n_trials": summary.n_trials,
        "n_complete": summary.n_complete,
        "n_failed": summary.n_failed,
        "n_pruned": summary.n_pruned,
        "n_new": summary.n_new,
        "n_measured": summary.n_measured,
        "interrupted": summary.interrupted,
        "elapsed_s": round(summary.elapsed_s, 3),
        "best": summary.best,
    }
    out.update(summary.extra)
    return out


def _gib(n: int | None) -> str:
    return "-" if n is None else memory_text(n)  # a small model's 3 MiB is no "0.00 GiB"


def being_measured_lines(extra: dict[str, Any]) -> list[str]:
    """What the summary says of configurations still RUNNING (``summary.summarize``): measured
    by a live worker, the best may change; left by a dead one, the next run measures them."""
    holders = extra.get("being_measured") or []
    live = [h["text"] for h in holders if h["alive"]]
    dead = [h["text"] for h in holders if not h["alive"]]
    lines = []
    if live:
        lines.append(f"{_configurations(len(live))} still being measured by {', '.join(live)}; the best may change")
    if dead:
        lines.append(
            f"{_configurations(len(dead))} left RUNNING by a dead worker: {', '.join(dead)}; the next "
            "'autotune study' measures it again"
            if len(dead) == 1
            else f"{_configurations(len(dead))} left RUNNING by dead workers: {', '.join(dead)}; the next "
            "'autotune study' measures them again"
        )
    return lines


def _configurations(n: int) -> str:
    return f"{n} configuration{'s' if n != 1 else ''}"


def summary_text(summary: StudySummary) -> str:
    """A few lines for a person: counts, the best configuration, its figures and command."""
    lines = [
        f"study {summary.study_name} ({summary.storage}): {counts_text(summary)}"
        + (f"; this run: {summary.n_new} new, {summary.n_measured} measured" if summary.n_new else "")
        + (" [interrupted]" if summary.interrupted else ""),
    ]
    lines += being_measured_lines(summary.extra)
    if summary.extra.get("failed_by_reason"):
        lines.append(failures_text(summary.extra["failed_by_reason"]))
    best = summary.best
    if not best:
        lines.append("no feasible configuration measured yet")
        # Per cause, what stopped each configuration (study.infeasible): the reason, not a count.
        lines += [f"  {line}" for line in summary.extra.get("no_feasible", [])]
        return "\n".join(
            lines + baseline_lines(summary.extra) + quality_lines(summary.extra) + stopped_lines(summary.extra)
        )
    params = ", ".join(f"{k}={v}" for k, v in best["params"].items())
    lines.append(f"best (trial {best['number']}): {params}")
    finish = summary.extra.get("finish")
    if finish:
        lines.append(f"  {finish['text']}")
    lines += [f"  {line}" for line in headline_lines(best)]
    if summary.extra.get("noise"):  # what the figures above are worth: both spreads, named
        lines.append(f"  {summary.extra['noise']['text']}")
    latency = latency_line(best, summary.extra["slo"]) if summary.extra.get("slo") else None
    if latency:
        lines.append(f"  {latency}")
    q = best.get("quality")
    if q and q.get("drop_points") is not None:
        lines.append(f"  quality: {quality_text(q)}")
    vram = best.get("predicted_vram") or {}
    if (best.get("gpu") or {}).get("key") == CPU_KEY:  # gpu = "cpu": everything is in host memory
        lines.append(f"  host memory: predicted {_gib(vram.get('total_bytes'))}")
    else:
        lines.append(
            f"  VRAM: predicted {_gib(vram.get('total_bytes'))}, measured {_gib(best.get('measured_vram_bytes'))}"
        )
    for a in best.get("artifacts") or ():
        how = f"made in {a['make_seconds']:.1f} s" if a.get("made_now") else "from the artifact cache"
        lines.append(f"  weights {a['weights']}: {a['path']} ({how}, sha256 {str(a['sha256'])[:12]})")
    if best.get("deploy_command"):
        lines.append("  deploy: " + best["deploy_command"])
    lines += baseline_lines(summary.extra)
    if finish and finish.get("contenders"):
        scored = summary.extra.get("objective_words")
        lines.append(
            f"measured again ({finish['rounds']} rounds, interleaved"
            + (f"; each figure the score: {scored}" if scored else "")
            + "):"
        )
        lines += [f"  {contender_text(c)}" for c in finish["contenders"]]
    front = summary.extra.get("pareto_front")
    if front:
        lines.append("Pareto front (throughput vs quality drop):")
        for t in front:
            params = ", ".join(f"{k}={v}" for k, v in t["params"].items())
            metric = metric_named((t.get("quality") or {}).get("metric"))
            lines.append(f"  {t['values'][0]:.1f} tok/s, {metric.drop_text(t['values'][1])}: {params}")
    lines += speculation_lines(summary.extra)
    why = summary.extra.get("why") or []
    if why:
        lines.append("why not a neighbour (one value changed):")
        lines += [f"  {line}" for line in why]
    lines += calibration_lines(summary.extra.get("calibration") or {})
    excluded = summary.extra.get("excluded_before_search") or []
    if excluded:
        lines.append("excluded before the search (could never run):")
        lines += [f"  {line}" for line in excluded]
    return "\n".join(lines + quality_lines(summary.extra) + stopped_lines(summary.extra))


def quality_text(q: dict[str, Any]) -> str:
    """A trial's quality (its stored ``quality``) in its metric's words: "mmlu accuracy 61.20%,
    drop 1.20 points vs gguf:F16 (± 0.50 points, paired), 300 items, within"; "KLD 0.0256 nats
    from gguf:F16"."""
    metric = metric_named(q.get("metric"))
    se = q.get("drop_stderr_points")
    return (
        metric.compared_text(q["value"], q["drop_points"], q["reference_weights"])
        + (f" (± {metric.amount_text(se)}{', paired' if q.get('items_used') else ''})" if se is not None else "")
        + (f", {q['items_used']} items, {q['verdict'] or 'no bound'}" if q.get("items_used") else "")
    )


def speculation_lines(extra: dict[str, Any]) -> list[str]:
    """When speculation loses, then its gain at each slot count (study/speculation_gain.py)."""
    found = extra.get("speculation_gain")
    if not found:
        return []
    slots = [SlotGain(**g) for g in found["slots"]]
    return [found["verdict"], *gain_lines(slots)]


def stopped_lines(extra: dict[str, Any]) -> list[str]:
    """The last line: why the (last) run's search ended."""
    return [f"why the search ended: {extra['stopped']}"] if extra.get("stopped") else []


def baseline_lines(extra: dict[str, Any]) -> list[str]:
    """The "vs doing nothing" section: each baseline (``study.baseline``: each engine's default
    launch, and any other choice it makes for itself, such as llama.cpp's --fit), what the best
    gains over each, and the line the user runs today."""
    found = extra.get("baseline") or {}
    if not found:
        return []
    lines = [
        "vs doing nothing (what each engine chooses for itself: its default launch and, where it has one, "
        "its own fitting; each measured once before the search, not a trial):"
    ]
    for entry in found.values():
        lines.append(f"  {entry['text']}")
        lines.append(f"    weights {entry['weights']} ({entry['weights_why']}); {entry['description']}")
        if entry.get("deploy_command"):
            lines.append(f"    today: {entry['deploy_command']}")
    return lines


def quality_lines(extra: dict[str, Any]) -> list[str]:
    """The "quality" section: what the bound costs, and how each artifact's paired drop was
    decided (within, over, or undecided and then the policy)."""
    lines = []
    if extra.get("quality_power"):
        lines.append(extra["quality_power"])
    decisions = extra.get("quality_decisions") or []
    if decisions:
        lines.append("quality, artifact by artifact (paired drop vs the reference, 95% interval):")
        for d in decisions:
            verdict = "admitted" if d.get("admitted") else ("refused" if d.get("admitted") is False else "scored")
            lines.append(f"  {d['weights']}: {verdict} ({d.get('decided_by')}): {d.get('how')}")
    return lines


def _percent(fraction: float | None) -> str:
    return "-" if fraction is None else f"{100 * fraction:.0f}%"


def calibration_lines(calibrations: dict[str, Any]) -> list[str]:
    """The "twin calibration" section: per real backend, what its model backend refit on the
    study's measured trials (``study/calibration.py``): each constant before and after, and the
    model's median error on those trials before and after."""
    if not calibrations:
        return []
    lines = ["twin calibration (refit on this study's measured trials; the prior and `estimate --study` use it):"]
    for backend, cal in sorted(calibrations.items()):
        if "error" in cal:
            lines.append(f"  {backend}: {cal.get('predictor')} could not calibrate: {cal['error']}")
            continue
        lines.append(
            f"  {backend} by {cal.get('predictor')} on {cal.get('gpu')}, {cal.get('n')} trials: median error "
            f"{_percent(cal.get('median_abs_error_before'))} -> {_percent(cal.get('median_abs_error_after'))}"
        )
        before, after = cal.get("before") or {}, cal.get("after") or {}
        lines.append(
            "    " + ", ".join(f"{name} {before[name]:.4g} -> {after[name]:.4g}" for name in before if name in after)
        )
    return lines
