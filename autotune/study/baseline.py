"""How much better than doing nothing: what each engine chooses for itself, measured once per study.

Before the search, a study measures what its user gets without tuning: each backend's
``baselines`` (its ``default_launch``: llama-server with ``-m`` only, ExLlamaV2's
defaults, ...; and any other choice the engine makes for itself: llama-server's ``--fit on``
with the user's context and slots) on the user's highest-precision candidate, under the study's
workload. The summary, ``best`` and the report then say how many times faster the winner is than
each ("N x what llama-server's --fit gives"), aggregate and per user, with both spreads.

The user's context and slots (``user_load``), for a launch that takes them from the user: the
most users at once the space's ``parallel`` names (the load the user serves, and the load the
winner is usually measured at), each with the smallest context of the space's ``ctx`` that holds
the workload (prompt + output). The smallest, not the largest: a larger context only costs an
engine memory that its own fitting then takes from the weights, so the baseline gets the most
room any configuration of the study gives it, and the ratio is not inflated by a context the
workload does not use.

A baseline is not a search trial: it is stored as a study attribute (``records.Baseline``, keyed
``<backend>`` for the default launch and ``<backend>:<name>`` for the others), never admitted
by the judge, never the best, never seen by the sampler. A study measures each once (a resumed
study reads it back); a launch that fails is recorded with its reason and the study goes on; its
seconds are spent inside the run, so they count in the budget, and together they take at most
``cost.BASELINE_SHARE`` of it (issue 39 item 3): one the share or the budget cuts short, or
leaves unlaunched, is recorded so ("cut short by the budget") and measured again by a resume
(item 7), as is one that failed for the machine's sake. ``[study] baseline = false`` turns
them all off.
"""

from __future__ import annotations

import re
import statistics
import time
from typing import Any, Callable, Mapping

import optuna

from autotune.modelfiles import artifacts
from autotune.modelfiles.artifacts import ArtifactError
from autotune.engine.backend import BaseBackend, DefaultLaunch, UserLoad, Workload
from autotune.errors import AutotuneError, BackendError, EngineUnavailableError
from autotune.measure import deadline
from autotune.engine.space import BackendSpace
from autotune.study import records
from autotune.study import budget_cut as cost
from autotune.study.noise import baseline_launches, relative_range
from autotune.study.prepare import highest_precision
from autotune.study.prepared import PreparedStudy

WHY_WEIGHTS = "the study's highest-precision candidate (most bytes of weights): what the user has before tuning"


def user_load(entry: BackendSpace, workload: Workload) -> UserLoad:
    """The user's context and slots from one backend's space (the module docstring says why
    these): the most users the space names, the smallest context that holds the workload (the
    largest the space names where none does: that launch is then recorded as unable to hold it)."""
    need = workload.sequence_tokens
    parallel = max(entry.parallel)
    holding = [c for c in entry.ctx if c >= need]
    if holding:
        ctx = min(holding)
        why = f"the smallest [space] ctx that holds the workload's {need} tokens"
    else:
        ctx = max(entry.ctx)
        why = f"the largest [space] ctx (none holds the workload's {need} tokens)"
    return UserLoad(ctx, parallel, f"ctx {ctx}: {why}; {parallel} users: the most [space] parallel names")


# Failures that are not the launch's own, in studies stored before ``Baseline.retry`` (their
# words then): the budget ended it, or the machine had no port for it.
_NOT_ITS_OWN = re.compile(r"budget \([^)]*\) ran out|cut short by the budget|no free TCP port", re.IGNORECASE)


def measure_again(base: records.Baseline) -> bool:
    """Whether a resume measures ``base`` again: it failed for the budget's or the machine's
    sake (item 7), not its own; a stale failure would otherwise stay in every summary."""
    return base.failed and (base.retry or bool(_NOT_ITS_OWN.search(base.error or "")))


def title_of(backend: str, title: str) -> str:
    """How the summary names a baseline ("N x what <title> gives")."""
    return title or f"{backend}'s default launch"


def measure(
    prepared: PreparedStudy,
    study: optuna.Study,
    claim: Callable[[str], bool],
    worker: str,
    say: Callable[[str], None] | None = None,
    budget_s: float | None = None,
    expect: Callable[[str], tuple[float, str] | None] | None = None,
) -> int:
    """Measure each backend's baselines not stored yet (or stored as failed for the budget's or
    the machine's sake: ``measure_again``); returns the launches made.

    Args:
        claim: Takes ``baseline:<key>`` (``Baseline.key``) for this worker (False: another
            worker of the study holds it and measures it).
        say: Hears one line per launch (it is not a trial: the user must see why nothing is
            searched yet), and what they cost against the budget.
        budget_s: This run's budget; the baselines end by ``cost.BASELINE_SHARE`` of it.
        expect: ``Baseline.key`` -> (seconds it is expected to take, on what): one expected to
            outlast what is left of the budget is not launched (a resume measures it).

    Raises:
        EngineUnavailableError: The engine cannot run at all (every trial would fail too).
    """
    if not prepared.cfg.baseline:
        return 0
    stored = {key: base for key, base in records.baselines(study).items() if not measure_again(base)}
    start = time.monotonic()
    share_at = None if budget_s is None else start + cost.BASELINE_SHARE * budget_s
    share = (
        f"the baselines' share of the budget ({cost.BASELINE_SHARE:.0%} of {budget_s or 0:g} s = "
        f"{cost.BASELINE_SHARE * (budget_s or 0):.3g} s) ran out"
    )
    with deadline.within(share_at, share):
        launches = _measure_each(prepared, study, claim, worker, say, stored, expect)
    spent = time.monotonic() - start
    if launches and say is not None and (budget_s or spent >= 1):  # a model's baselines cost nothing to say
        of = (
            f" ({spent / budget_s:.0%} of the {budget_s:g} s budget; at most {cost.BASELINE_SHARE:.0%})"
            if budget_s
            else ""
        )
        say(f"baseline: {launches} launch{'es' if launches != 1 else ''} took {spent:.0f} s{of}")
    return launches


def _measure_each(
    prepared: PreparedStudy,
    study: optuna.Study,
    claim: Callable[[str], bool],
    worker: str,
    say: Callable[[str], None] | None,
    stored: Mapping[str, records.Baseline],
    expect: Callable[[str], tuple[float, str] | None] | None,
) -> int:
    launches = 0
    for cand in prepared.cfg.candidates:
        name = cand.backend
        entry = prepared.space.entries.get(name)
        if entry is None or name not in prepared.contexts:
            continue
        backend = prepared.backend(name)
        kind = type(backend)
        if kind.default_launch is BaseBackend.default_launch and kind.baselines is BaseBackend.baselines:
            continue  # declines without being asked (a replay answers only for recorded configurations)
        ctx = prepared.contexts[name]
        weights = highest_precision(backend, cand.weights, ctx)
        try:
            launches_of = backend.baselines(weights, ctx, user_load(entry, ctx.workload))
        except Exception as exc:  # noqa: BLE001 - a bug in a plugin must not kill the study
            if say is not None:
                say(f"baseline: {name} could not say its baselines ({type(exc).__name__}: {exc}); none measured")
            continue
        seen: set[str] = set()
        for launch in launches_of:
            key = records.baseline_key(name, launch.name)
            if key in seen or key in stored:
                continue  # measured once per study (a second launch of one name is the plugin's slip)
            seen.add(key)
            if not claim(key):
                continue
            launches += _measure_one(
                backend, launch, weights, ctx, study, worker, say, expect(key) if expect is not None else None
            )
    return launches


def _measure_one(
    backend: BaseBackend,
    launch: DefaultLaunch,
    weights: str,
    ctx: Any,
    study: optuna.Study,
    worker: str,
    say: Callable[[str], None] | None,
    expected: tuple[float, str] | None = None,
) -> int:
    """Launch, measure and store one baseline (its failure too); 1 if it was launched."""
    name, config = backend.name, launch.config
    title = title_of(name, launch.title)
    head: dict[str, Any] = {
        "weights": weights,
        "weights_why": WHY_WEIGHTS,
        "config": config.as_dict(),
        "description": launch.description,
        "worker": worker,
        "title": launch.title,
    }
    try:
        head["deploy_command"] = backend.deploy_command(config, ctx)
    except AutotuneError as exc:
        head["deploy_command"] = f"(no deploy line: {exc})"
    need = ctx.workload.sequence_tokens
    if config.ctx < need:
        records.write_baseline(
            study,
            name,
            launch.name,
            **head,
            error=(
                f"its context of {config.ctx} tokens per user cannot hold the workload's {need} "
                f"({ctx.workload.need_text}): not launched"
            ),
        )
        return 0
    over = deadline.passed()
    bound = deadline.current()
    if over is None and expected is not None and bound is not None and expected[0] > bound.left_s():
        # A launch the budget would end before it measures anything: not started, said why.
        over = deadline.Deadline(
            bound.at_s,
            f"it is expected to take {expected[0]:.0f} s ({expected[1]}), more "
            f"than the {max(bound.left_s(), 0):.0f} s left before {bound.reason.split(' ran out')[0]} runs out",
        )
    if over is not None:  # nothing left of the budget (or of the baselines' share) to launch it in
        records.write_baseline(
            study,
            name,
            launch.name,
            **head,
            retry=True,
            error=(f"{cost.CUT_SHORT}: not launched, {over.reason}; a run with budget left measures it"),
        )
        if say is not None:
            say(f"baseline: {title} not launched: {over.reason}")
        return 0
    if say is not None:
        say(f"baseline: {title} on {weights} (not a trial; measured once per study)")
    start = time.monotonic()
    try:
        artifacts.ensure(backend, weights, ctx, say=say)
        m = backend.run(config, ctx)
    except EngineUnavailableError:
        raise
    except (BackendError, ArtifactError) as exc:
        cut = cost.cut_short(exc)
        records.write_baseline(
            study,
            name,
            launch.name,
            **head,
            error=cut or str(exc),
            seconds=time.monotonic() - start,
            **({"retry": True} if cut else {}),
            **({"log_tail": exc.log_tail[-4000:]} if exc.log_tail else {}),
        )
        return 1
    except Exception as exc:  # noqa: BLE001 - a bug in a plugin must not kill the study
        cut = cost.cut_short(exc)
        records.write_baseline(
            study,
            name,
            launch.name,
            **head,
            error=cut or f"{type(exc).__name__}: {exc}",
            seconds=time.monotonic() - start,
            **({"retry": True} if cut else {}),
        )
        return 1
    records.write_baseline(
        study,
        name,
        launch.name,
        **head,
        seconds=time.monotonic() - start,
        peak_vram_bytes=m.peak_vram_bytes,
        engine={"backend": name, "engine": backend.engine, "version": backend.engine_build(ctx)},
        metrics={k: _brief(v.to_dict()) for k, v in m.metrics.items()},
    )
    return 1


def _brief(stat: Mapping[str, Any]) -> dict[str, Any]:
    """What a comparison needs of a Stat (the runs themselves included, not the warm-ups)."""
    return {k: stat.get(k) for k in ("median", "spread", "n", "min", "max", "values", "unit", "warning")}


def _figure(
    base: records.Baseline, rounds: Mapping[int, Mapping[str, Any]], metric: str
) -> tuple[float | None, float, int]:
    """The baseline's figure of ``metric``: (median, spread, launches). Measured again by the
    finish (beside the leaders, interleaved), the median over its launches and their range;
    else its one launch's median and spread."""
    launches = baseline_launches(base, rounds, metric)
    if len(launches) > 1:
        return statistics.median(launches), relative_range(launches) or 0.0, len(launches)
    return base.median(metric), (base.metrics.get(metric) or {}).get("spread") or 0.0, 1


def _ratio(
    best: Mapping[str, Any],
    base: records.Baseline,
    metric: str,
    rounds: Mapping[int, Mapping[str, Any]] | None = None,
    between: float | None = None,
) -> dict[str, Any] | None:
    """The winner's median over the baseline's for one metric, and whether it is within noise.

    A ratio of medians moves by about the sum of their relative spreads (each a MAD over its
    median), and a ratio of launches by at least what two launches of one configuration differ
    (``between``: the study's between-launch spread, ``study/noise.py``); a ratio closer to 1
    than the larger is not a gain anyone measured, and is called so.
    """
    w = (best.get("metrics") or {}).get(metric)
    b, bs, b_runs = _figure(base, rounds or {}, metric)
    if w is None or not b:
        return None
    ws = (best.get("spreads") or {}).get(metric) or 0.0
    ratio = w / b
    # After the finish the winner's figure is a median over its runs, its spread their range
    # (summary.headline): said as a range, not as "+-", which is a single run's MAD spread.
    runs = (best.get("runs") or {}).get(metric) or 1
    noise = max(ws + bs, between or 0.0)
    return {
        "winner": w,
        "winner_spread": ws,
        "winner_runs": runs,
        "baseline": b,
        "baseline_spread": bs,
        "baseline_runs": b_runs,
        "between_launches": between,
        "ratio": ratio,
        "within_noise": abs(ratio - 1.0) <= noise,
    }


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def compare(
    best: Mapping[str, Any] | None,
    stored: Mapping[str, records.Baseline],
    *,
    goodput: bool = False,
    rounds: Mapping[str, Mapping[int, Mapping[str, Any]]] | None = None,
    between: float | None = None,
) -> dict[str, Any]:
    """Each stored baseline with the winner's ratios against it, and a sentence for people.

    Returns:
        ``Baseline.key`` (``<backend>`` for the default launch, ``<backend>:<name>`` for the
        others) -> ``backend``, ``name``, ``title``, ``weights``, ``deploy_command``,
        ``description``, ``error``, the baseline's ``aggregate_tok_s`` and ``per_user_tok_s``
        (median and spread), ``ratio`` (``aggregate`` and ``per_user``: each with both medians,
        both spreads, the ratio and ``within_noise``) and ``text``. With ``goodput`` (a study
        with latency targets) ``goodput_tok_s`` too, and its ratio as ``goodput``: the
        baseline's requests were counted against the same targets. ``rounds``: the finish's
        launches of each baseline (``noise.baseline_rounds``); ``between``: the study's
        between-launch spread.
    """
    measured = (("aggregate", "aggregate_tok_s"), ("per_user", "per_user_tok_s"))
    if goodput:
        measured = (("goodput", "goodput_tok_s"), *measured)
    out: dict[str, Any] = {}
    for key, base in sorted(stored.items()):
        entry: dict[str, Any] = {
            "backend": base.backend,
            "name": base.name,
            "title": title_of(base.backend, base.title),
            "weights": base.weights,
            "weights_why": base.weights_why,
            "deploy_command": base.deploy_command,
            "description": base.description,
            "error": base.error,
            "config": base.config,
            "seconds": base.seconds,
            "retry": measure_again(base),
        }
        for _, metric in measured:
            m = base.metrics.get(metric)
            entry[metric] = None if m is None else {"median": m.get("median"), "spread": m.get("spread")}
        ratios = (
            {k: _ratio(best, base, metric, (rounds or {}).get(key), between) for k, metric in measured}
            if best and not base.failed
            else {}
        )
        entry["ratio"] = ratios
        entry["text"] = _text(entry["title"], base, ratios, best)
        out[key] = entry
    return out


def _text(title: str, base: records.Baseline, ratios: Mapping[str, Any], best: Mapping[str, Any] | None) -> str:
    if base.failed and measure_again(base):  # the budget's or the machine's doing, not the engine's
        return f"{title} on {base.weights} not measured: {base.error}; the next run measures it"
    if base.failed:
        return f"{title} on {base.weights} failed: {base.error}"
    agg, per_user = ratios.get("aggregate"), ratios.get("per_user")
    if best is None or agg is None:
        figure = base.median("aggregate_tok_s")
        return f"{title} on {base.weights}: aggregate {figure:.1f} tok/s" if figure else f"{title} on {base.weights}"
    parts = []
    rows = [
        (agg, f"what {title} gives in aggregate tok/s", f"of what {title} gives in aggregate tok/s"),
        (per_user, "in per-user tok/s", "in per-user tok/s"),
    ]
    if ratios.get("goodput"):  # first: a study with latency targets is scored by it
        rows.insert(
            0,
            (
                ratios["goodput"],
                f"what {title} gives in goodput tok/s (requests within the targets)",
                f"of what {title} gives in goodput tok/s",
            ),
        )
    elif "goodput" in ratios and base.median("goodput_tok_s") == 0:  # no ratio to 0, but the fact is the news
        parts.append(
            f"no request of {title} met the targets (goodput 0 tok/s; the winner's "
            f"{(best.get('metrics') or {}).get('goodput_tok_s', 0):.1f})"
        )
    # "3.1x what llama-server's --fit gives in aggregate tok/s (A, range a% over 3 runs, vs B +- b%),
    # 2.0x in per-user ..." (A +- a% where the winner was measured once)
    for r, gain, noise in rows:
        if r is None:
            continue
        runs = r.get("winner_runs") or 1
        winner = (
            f"{r['winner']:.1f}, range {_pct(r['winner_spread'])} over {runs} runs,"
            if runs > 1
            else f"{r['winner']:.1f} +- {_pct(r['winner_spread'])}"
        )
        b_runs = r.get("baseline_runs") or 1
        baseline = (
            f"{r['baseline']:.1f}, range {_pct(r['baseline_spread'])} over {b_runs} runs"
            if b_runs > 1
            else f"{r['baseline']:.1f} +- {_pct(r['baseline_spread'])}"
        )
        between = r.get("between_launches")
        figures = f"{winner} vs {baseline}" + (f"; launches differ by {_pct(between)}" if between else "")
        if r["within_noise"]:
            parts.append(f"within noise {noise}: no gain shown ({r['ratio']:.2f}x, {figures})")
        else:
            parts.append(f"{r['ratio']:.1f}x {gain} ({figures})")
    return ", ".join(parts)
