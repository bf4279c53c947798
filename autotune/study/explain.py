"""Why the study's best beats its neighbours: one line per configuration one value away.

Made once, at the end of each run (``StudyRunner.run``), and stored with the study
(``why_best``), so that ``study``, ``best``, ``report`` and the dashboard note say the same.
"""

from __future__ import annotations

from typing import Any

import optuna

from autotune.engine.backend import TrialConfig
from autotune.engine.space import DRAFT_OPTION, ConditionalParam
from autotune.engine.metric import metric_named
from autotune.study import records
from autotune.study.admission import budget_text
from autotune.study.judge import judge_for

__all__ = ["explain_best"]


def _gib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**30:.2f} GiB"


def explain_best(prepared: Any, study: optuna.Study, best: dict[str, Any] | None) -> list[str]:
    """Why the best configuration beats its neighbours: one line per single-value change.

    Each alternative is judged by the study's own judge (rules, memory with what the study
    learned, cached quality), and, where the storage holds it, by its latest measured outcome
    (after a resume, a configuration interrupted once and measured later shows the measurement).
    """
    if not best:
        return []
    config = TrialConfig.from_dict(best["params"])
    backend = prepared.backend(config.backend)
    cfg = prepared.cfg
    judge = judge_for(prepared, study)
    candidates = next((c.weights for c in cfg.candidates if c.backend == config.backend), (config.weights,))
    options = {k: v for k, v in cfg.space.items() if k not in ("ctx", "parallel")}
    # The placement dimensions a study on several cards searches without naming them (split
    # mode, proportions): each is a neighbour too, so the summary says why the winner's split wins.
    split = {} if backend.splitting is None else backend.splitting.placement_space(prepared.contexts[config.backend])
    options = {**split, **options}
    draft = next((c.draft for c in cfg.candidates if c.backend == config.backend and c.draft), ())
    if draft:
        options[DRAFT_OPTION] = list(draft)
    dims: list[tuple[str, tuple[Any, ...]]] = [
        ("weights", tuple(candidates)),
        ("ctx", tuple(cfg.space["ctx"])),
        ("parallel", tuple(cfg.space["parallel"])),
    ]
    params = [p for p in backend.parameters(options) if p.choices]
    dims += [(p.name, p.choices) for p in params]
    conditional = {p.name: p for p in params if isinstance(p, ConditionalParam)}
    latest = records.standing_by_key(study, latest=True)
    best_value = best["values"][0] if best.get("values") else None
    lines = []
    for name, choices in dims:
        cond = conditional.get(name)
        if cond is not None and config.as_dict().get(cond.parent) not in cond.parent_values:
            continue  # not drawn for the best (n-max without speculation): changing it changes nothing
        for value in choices:
            data = config.as_dict()
            if data.get(name) == value:
                continue
            data[name] = value
            data = _with_dependents(data, name, conditional, latest.values())
            alt = TrialConfig.from_dict(data)
            label = f"{name} {value}"
            drawn = {k: data[k] for k in sorted(data) if k in conditional and conditional[k].parent == name}
            if drawn:  # the options that changing it brings in, at their best measured values
                label += f" (with {', '.join(f'{k} {v}' for k, v in drawn.items())})"
            verdict = judge.judge(alt)
            if verdict.kind == "invalid":
                lines.append(f"{label}: {verdict.reason}")
                continue
            if verdict.kind == "over_budget" and verdict.estimate is not None and verdict.estimate.per_device_bytes:
                lines.append(f"{label}: does not fit: {verdict.reason.removeprefix('infeasible: ')}")
                continue
            if verdict.kind == "over_budget" and verdict.estimate is not None:
                budget = prepared.contexts[config.backend].vram_budget_bytes
                lines.append(
                    f"{label}: does not fit: needs {_gib(verdict.estimate.total_bytes)} > budget {budget_text(budget)}"
                )
                continue
            if verdict.kind == "low_quality":
                limit = cfg.objective.max_drop_points
                metric = prepared.quality or metric_named(cfg.objective.quality)
                lines.append(
                    f"{label}: loses too much quality: {metric.drop_text(verdict.quality_drop_points)} "
                    f"> max {metric.bound_text(limit)}"
                )
                continue
            r = latest.get(alt.key)
            if r is None:
                lines.append(f"{label}: not measured")
            elif r.state == optuna.trial.TrialState.COMPLETE and r.values:
                violated = [k for k, v in r.constraints.items() if v > 0]
                score = r.values[0]
                tail = f" but violates {', '.join(violated)}" if violated else ""
                cmp = "" if best_value is None else f" ({score - best_value:+.1f})"
                lines.append(f"{label}: measured score {score:.1f}{cmp}{tail} (trial {r.number})")
            else:
                lines.append(f"{label}: {r.reason} (trial {r.number})")
    return lines


def _with_dependents(
    data: dict[str, Any], changed: str, conditional: dict[str, ConditionalParam], measured: Any
) -> dict[str, Any]:
    """``data`` with ``changed`` set, the options that depend on it made consistent: dropped
    where its new value does not draw them, and where it does (speculation switched on: a draft
    and its length), set to the values of the best measured configuration that agrees on
    everything else, else to their first choices. One value changed is then still a
    configuration the study could have drawn, not one the engine refuses for a missing draft."""
    dependents = [p for p in conditional.values() if p.parent == changed]
    if not dependents:
        return data
    for p in dependents:
        if data[changed] not in p.parent_values:
            data.pop(p.name, None)
    wanted = [p for p in dependents if data[changed] in p.parent_values and p.name not in data]
    if not wanted:
        return data
    free = {p.name for p in wanted}
    best: tuple[float, dict[str, Any]] | None = None
    for r in measured:
        if r.config is None or r.state != optuna.trial.TrialState.COMPLETE or not r.values:
            continue
        other = dict(r.config)
        if {k: v for k, v in other.items() if k not in free} == data and (best is None or r.values[0] > best[0]):
            best = (r.values[0], other)
    return best[1] if best is not None else {**data, **{p.name: p.choices[0] for p in wanted}}
