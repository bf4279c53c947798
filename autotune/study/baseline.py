"""How much better than doing nothing: each backend's default launch, measured once per study.

Before the search, a study measures what its user gets without tuning: each backend's
``default_launch`` (llama-server with ``-m`` and ``-ngl`` only, ExLlamaV2's defaults, ...) on the
user's highest-precision candidate, under the study's workload. The summary, ``best`` and the
report then say how many times faster the winner is, aggregate and per user, with both spreads.

The baseline is not a search trial: it is stored as a study attribute (``records.Baseline``),
never admitted by the judge, never the best, never seen by the sampler. A study measures it
once (a resumed study reads it back); a launch that fails is recorded with its reason and the
study goes on; its seconds are spent inside the run, so they count in the budget. ``[study]
baseline = false`` turns it off.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Mapping

import optuna

from autotune import artifacts
from autotune.artifacts import ArtifactError
from autotune.backend import BaseBackend
from autotune.errors import AutotuneError, BackendError, EngineUnavailableError
from autotune.study import records
from autotune.study.prepare import PreparedStudy, highest_precision

WHY_WEIGHTS = "the study's highest-precision candidate (most bytes of weights): what the user has before tuning"


def measure(prepared: PreparedStudy, study: optuna.Study, claim: Callable[[str], bool], worker: str,
            say: Callable[[str], None] | None = None) -> int:
    """Measure each backend's default launch not stored yet; returns the launches made.

    Args:
        claim: Takes ``baseline:<backend>`` for this worker (False: another worker of the study
            holds it and measures it).
        say: Hears one line per launch (it is not a trial: the user must see why nothing is
            searched yet).

    Raises:
        EngineUnavailableError: The engine cannot run at all (every trial would fail too).
    """
    if not prepared.cfg.baseline:
        return 0
    stored = records.baselines(study)
    launches = 0
    for cand in prepared.cfg.candidates:
        name = cand.backend
        if name in stored or name not in prepared.contexts:
            continue
        backend = prepared.backend(name)
        if type(backend).default_launch is BaseBackend.default_launch:
            continue  # declines without being asked (a replay answers only for recorded configurations)
        ctx = prepared.contexts[name]
        weights = highest_precision(backend, cand.weights, ctx)
        launch = backend.default_launch(weights, ctx)
        if launch is None:
            continue  # the backend declines: the summary says nothing about it
        if not claim(name):
            continue
        config = launch.config
        head: dict[str, Any] = {"weights": weights, "weights_why": WHY_WEIGHTS, "config": config.as_dict(),
                                "description": launch.description, "worker": worker}
        try:
            head["deploy_command"] = backend.deploy_command(config, ctx)
        except AutotuneError as exc:
            head["deploy_command"] = f"(no deploy line: {exc})"
        need = ctx.workload.sequence_tokens
        if config.ctx < need:
            records.write_baseline(study, name, **head, error=(
                f"its context of {config.ctx} tokens per user cannot hold the workload's {need} "
                f"(prompt {ctx.workload.prompt_tokens} + output {ctx.workload.output_tokens}): not launched"))
            continue
        if say is not None:
            say(f"baseline: {name}'s default launch on {weights} (not a trial; measured once per study)")
        launches += 1
        start = time.monotonic()
        try:
            artifacts.ensure(backend, weights, ctx, say=say)
            m = backend.run(config, ctx)
        except EngineUnavailableError:
            raise
        except (BackendError, ArtifactError) as exc:
            records.write_baseline(study, name, **head, error=str(exc), seconds=time.monotonic() - start,
                                   **({"log_tail": exc.log_tail[-4000:]} if exc.log_tail else {}))
            continue
        except Exception as exc:  # noqa: BLE001 - a bug in a plugin must not kill the study
            records.write_baseline(study, name, **head, error=f"{type(exc).__name__}: {exc}",
                                   seconds=time.monotonic() - start)
            continue
        records.write_baseline(
            study, name, **head, seconds=time.monotonic() - start, peak_vram_bytes=m.peak_vram_bytes,
            engine={"backend": name, "engine": backend.engine, "version": backend.engine_version()},
            metrics={k: _brief(v.to_dict()) for k, v in m.metrics.items()})
    return launches


def _brief(stat: Mapping[str, Any]) -> dict[str, Any]:
    """What a comparison needs of a Stat (the runs themselves included, not the warm-ups)."""
    return {k: stat.get(k) for k in ("median", "spread", "n", "min", "max", "values", "unit", "warning")}


def _ratio(best: Mapping[str, Any], base: records.Baseline, metric: str) -> dict[str, Any] | None:
    """The winner's median over the baseline's for one metric, and whether it is within noise.

    A ratio of medians moves by about the sum of their relative spreads (each a MAD over its
    median); a ratio closer to 1 than that is not a gain anyone measured, and is called so.
    """
    w = (best.get("metrics") or {}).get(metric)
    b = base.median(metric)
    if w is None or not b:
        return None
    ws = (best.get("spreads") or {}).get(metric) or 0.0
    bs = (base.metrics.get(metric) or {}).get("spread") or 0.0
    ratio = w / b
    return {"winner": w, "winner_spread": ws, "baseline": b, "baseline_spread": bs, "ratio": ratio,
            "within_noise": abs(ratio - 1.0) <= ws + bs}


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def compare(best: Mapping[str, Any] | None, stored: Mapping[str, records.Baseline]) -> dict[str, Any]:
    """Each stored baseline with the winner's ratios against it, and a sentence for people.

    Returns:
        Backend name -> ``weights``, ``deploy_command``, ``description``, ``error``, the baseline's
        ``aggregate_tok_s`` and ``per_user_tok_s`` (median and spread), ``ratio`` (``aggregate``
        and ``per_user``: each with both medians, both spreads, the ratio and ``within_noise``)
        and ``text``.
    """
    out: dict[str, Any] = {}
    for name, base in sorted(stored.items()):
        entry: dict[str, Any] = {
            "weights": base.weights, "weights_why": base.weights_why, "deploy_command": base.deploy_command,
            "description": base.description, "error": base.error, "config": base.config,
        }
        for metric in ("aggregate_tok_s", "per_user_tok_s"):
            m = base.metrics.get(metric)
            entry[metric] = None if m is None else {"median": m.get("median"), "spread": m.get("spread")}
        ratios = {key: _ratio(best, base, metric) for key, metric in
                  (("aggregate", "aggregate_tok_s"), ("per_user", "per_user_tok_s"))} if best and not base.failed else {}
        entry["ratio"] = ratios
        entry["text"] = _text(name, base, ratios, best)
        out[name] = entry
    return out


def _text(name: str, base: records.Baseline, ratios: Mapping[str, Any], best: Mapping[str, Any] | None) -> str:
    where = f"{name}'s default launch"
    if base.failed:
        return f"{where} on {base.weights} failed: {base.error}"
    agg, per_user = ratios.get("aggregate"), ratios.get("per_user")
    if best is None or agg is None:
        figure = base.median("aggregate_tok_s")
        return f"{where} on {base.weights}: aggregate {figure:.1f} tok/s" if figure else f"{where} on {base.weights}"
    parts = []
    for r, label, whose in ((agg, "aggregate tok/s", f"{where}'s"), (per_user, "per-user tok/s", "its")):
        if r is None:
            continue
        figures = (f"{r['winner']:.1f} +- {_pct(r['winner_spread'])} vs {r['baseline']:.1f} +- "
                   f"{_pct(r['baseline_spread'])}")
        if r["within_noise"]:
            parts.append(f"within noise of {whose} {label}: no gain shown ({r['ratio']:.2f}x, {figures})")
        else:
            parts.append(f"{r['ratio']:.1f}x {whose} {label} ({figures})")
    return ", ".join(parts)
