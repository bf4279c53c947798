"""Reading a study back: the best configuration, its deploy command, and text for people."""

from __future__ import annotations

from typing import Any

import optuna

from autotune.errors import ConfigError
from autotune.study import StudySummary, open_storage, summarize, trial_record


def load_study(storage: str, study_name: str | None = None) -> optuna.Study:
    """Open a stored study; with no name, the storage's only study.

    Raises:
        ConfigError: no such study, or several and none named (the names are listed).
    """
    store = open_storage(storage)
    names = [s.study_name for s in optuna.get_all_study_summaries(store, include_best_trial=False)]
    if not names:
        raise ConfigError(f"storage {storage}: holds no study yet (run 'autotune study' first)")
    if study_name is None:
        if len(names) > 1:
            raise ConfigError(f"storage {storage}: holds several studies, pick one with --study ({', '.join(names)})")
        study_name = names[0]
    if study_name not in names:
        raise ConfigError(f"--study {study_name!r}: not in {storage} (studies: {', '.join(names)})")
    return optuna.load_study(study_name=study_name, storage=store)


def stored_summary(storage: str, study_name: str | None = None) -> StudySummary:
    study = load_study(storage, study_name)
    summary = summarize(None, study)
    summary.storage = storage
    return summary


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
    return "-" if n is None else f"{n / 2**30:.2f} GiB"


def summary_text(summary: StudySummary) -> str:
    """A few lines for a person: counts, the best configuration, its figures and command."""
    lines = [
        f"study {summary.study_name} ({summary.storage}): {summary.n_trials} trials, "
        f"{summary.n_complete} complete, {summary.n_pruned} pruned, {summary.n_failed} failed"
        + (f"; this run: {summary.n_new} new, {summary.n_measured} measured" if summary.n_new else "")
        + (" [interrupted]" if summary.interrupted else ""),
    ]
    best = summary.best
    if not best:
        lines.append("no feasible configuration measured yet")
        return "\n".join(lines)
    params = ", ".join(f"{k}={v}" for k, v in best["params"].items())
    lines.append(f"best (trial {best['number']}): {params}")
    m = best.get("metrics") or {}
    figures = []
    for key, label in (("decode_tok_s", "decode"), ("aggregate_tok_s", "aggregate"), ("per_user_tok_s", "per user"),
                       ("prefill_tok_s", "prefill")):
        if m.get(key) is not None:
            figures.append(f"{label} {m[key]:.1f} tok/s")
    if m.get("ttft_ms") is not None:
        figures.append(f"TTFT {m['ttft_ms']:.0f} ms")
    if figures:
        lines.append("  " + ", ".join(figures))
    q = best.get("quality")
    if q and q.get("drop_points") is not None:
        se = q.get("drop_stderr_points")
        lines.append(
            f"  quality: {q['metric']} {q['value']:.4f}, {q['drop_points']:+.2f} points vs {q['reference_weights']}"
            + (f" (+- {se:.2f})" if se is not None else "")
        )
    vram = best.get("predicted_vram") or {}
    lines.append(f"  VRAM: predicted {_gib(vram.get('total_bytes'))}, measured {_gib(best.get('measured_vram_bytes'))}")
    if best.get("deploy_command"):
        lines.append("  deploy: " + best["deploy_command"])
    return "\n".join(lines)
