"""Reading a study back: the best configuration, its deploy command, and text for people."""

from __future__ import annotations

from typing import Any

import optuna

from autotune.errors import ConfigError
from autotune.study import StudySummary, open_storage, summarize


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
    summary.extra["excluded_before_search"] = study.user_attrs.get("excluded_before_search", [])
    summary.extra["why"] = study.user_attrs.get("why_best", [])
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
    front = summary.extra.get("pareto_front")
    if front:
        lines.append("Pareto front (throughput vs quality drop):")
        for t in front:
            params = ", ".join(f"{k}={v}" for k, v in t["params"].items())
            lines.append(f"  {t['values'][0]:.1f} tok/s, {t['values'][1]:+.2f} points: {params}")
    why = summary.extra.get("why") or []
    if why:
        lines.append("why not a neighbour (one value changed):")
        lines += [f"  {line}" for line in why]
    excluded = summary.extra.get("excluded_before_search") or []
    if excluded:
        lines.append("excluded before the search (could never run):")
        lines += [f"  {line}" for line in excluded]
    return "\n".join(lines)


def explain_best(prepared: Any, study: optuna.Study, best: dict[str, Any] | None) -> list[str]:
    """Why the best configuration beats its neighbours: one line per single-value change.

    Each alternative is judged the way a trial would be, without launching anything: the
    rules (``check``), the memory model against the budget, the artifact's cached quality,
    and, when the storage holds it, the measured outcome.
    """
    from autotune.backend import TrialConfig
    from autotune.study import quality_drop_cached

    if not best:
        return []
    config = TrialConfig.from_dict(best["params"])
    backend = prepared.backend(config.backend)
    ctx = prepared.contexts[config.backend]
    cfg = prepared.cfg
    candidates = next((c.weights for c in cfg.candidates if c.backend == config.backend), (config.weights,))
    options = {k: v for k, v in cfg.space.items() if k not in ("ctx", "parallel")}
    dims: list[tuple[str, tuple[Any, ...]]] = [
        ("weights", tuple(candidates)), ("ctx", tuple(cfg.space["ctx"])), ("parallel", tuple(cfg.space["parallel"])),
    ]
    dims += [(p.name, p.choices) for p in backend.parameters(options)]
    by_key = {}
    for t in study.get_trials(deepcopy=False):
        key = t.user_attrs.get("config_key")
        if key and t.user_attrs.get("answered_from") is None and key not in by_key:
            by_key[key] = t
    best_value = best["values"][0] if best.get("values") else None
    lines = []
    for name, choices in dims:
        for value in choices:
            data = config.as_dict()
            if data.get(name) == value:
                continue
            data[name] = value
            alt = TrialConfig.from_dict(data)
            label = f"{name} {value}"
            reasons = prepared.space.check(alt, ctx)
            if reasons:
                lines.append(f"{label}: invalid: {'; '.join(reasons)}")
                continue
            mem = backend.estimate_memory(alt, ctx)
            if mem.total_bytes > ctx.vram_budget_bytes:
                lines.append(f"{label}: does not fit: needs {_gib(mem.total_bytes)} > budget {_gib(ctx.vram_budget_bytes)}")
                continue
            drop = quality_drop_cached(prepared, study, alt)
            limit = cfg.objective.max_drop_points
            if drop is not None and limit is not None and drop > limit:
                lines.append(f"{label}: loses too much quality: {drop:.2f} points > max {limit:g}")
                continue
            t = by_key.get(alt.key)
            if t is None:
                lines.append(f"{label}: not measured")
            elif t.state == optuna.trial.TrialState.COMPLETE:
                violated = [k for k, v in t.constraints.items() if v > 0]
                score = t.values[0]
                tail = f" but violates {', '.join(violated)}" if violated else ""
                cmp = "" if best_value is None else f" ({score - best_value:+.1f})"
                lines.append(f"{label}: measured score {score:.1f}{cmp}{tail} (trial {t.number})")
            else:
                why = t.user_attrs.get("prune_reason") or t.user_attrs.get("fail_reason") or t.state.name
                lines.append(f"{label}: {why} (trial {t.number})")
    return lines
