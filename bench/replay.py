"""Replay autotune's own study runner against recorded exhaustive grids, to compare search strategies.

    python bench/replay.py --grid sqlite:///bench/results/h200_grids/h200_grid_qwen7b-run1.db \\
        --grid sqlite:///bench/results/h200_grids/h200_grid_qwen7b-run2.db --seeds 20 \\
        --strategies random,tpe,prior --budget-fraction 0.25 [--json] [--out PREFIX]

Storages that hold the same study are runs of one grid; storages of several studies are
several grids, replayed one after the other. For each grid, strategy and seed, the real
``StudyRunner`` runs a replay study (the grid's study file with the replay backend of
``replay_backend.py`` in place of the real one, bench/<file>.toml found by its ``[study]``
name, or ``--study-file``) in an in-memory storage while the next launch is expected to end
within ``--budget-fraction`` of the grid's measuring seconds (recorded seconds; the same rule
as the runner's own ``budget``). Its pick is the study's best trial; the
pick is valued by the grid's truth (the mean of the runs' measurements of that configuration)
against the best truth among the configurations that are feasible by that truth (per-user
floor and memory). A launch interrupted from outside (the recording's machine time ran out) is
no outcome; a configuration with no other launch is "unsettled" (replayed as a failure at no
cost, counted). See docs/search.md.

A strategy is one registered with ``register_strategies`` (``autotune plugins`` lists them:
the core's tpe, prior, random, nsga2 and grid, the twin's twin, any plugin's), replayed as
``[study] sampler = NAME`` without the prior head start unless the strategy's own default
turns it on (``prior``). ``NAME+probe`` adds the runner's probe (``[study] probe_margin =
0.15``), and "multifidelity" is ``prior+probe``: the replay backend answers a launch the probe
stops with the recorded first run, and charges the recorded seconds less the later runs
(estimated from the trial's own rates: the grids stored seconds per trial, not per run).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import statistics
import sys
import time
import tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

import optuna

sys.path.insert(0, str(Path(__file__).resolve().parent))

from replay_backend import REPLAY_BACKEND, RecordedGrid, ReplayBackend, ReplayPlugin  # noqa: E402

from autotune import plugins
from autotune.hardware import gpus as hardware
from autotune.study import objective as objective_mod
from autotune.engine.backend import BaseBackend, StudyContext, TrialConfig, Workload  # noqa: E402
from autotune.config import Objective, parse_study_config  # noqa: E402
from autotune.errors import AutotuneError, ConfigError, handle_errors  # noqa: E402
from autotune.measure import Protocol  # noqa: E402
from autotune.modelfiles.models import load_model_catalog, resolve_model  # noqa: E402
from autotune.engine.strategy import BaseStrategy  # noqa: E402
from autotune.study import cost, records, storage  # noqa: E402
from autotune.study.prepare import PreparedStudy, prepare_study  # noqa: E402
from autotune.study.records import TrialState  # noqa: E402
from autotune.study.runner import StudyRunner  # noqa: E402
from autotune.study.verdict import best_trial

BENCH = Path(__file__).resolve().parent
WITHIN = 0.03
# Every replay gets a fresh Optuna in-memory storage (``in_memory_storages``): nothing touches
# the disk, replays cannot see each other's trials, and a trial's forty attribute writes cost
# microseconds instead of SQL statements (an in-memory SQLite database made replays 4x slower).
MEMORY_STORAGE = "memory:replay"


@contextlib.contextmanager
def in_memory_storages() -> Iterator[None]:
    """Let the core open ``MEMORY_STORAGE`` as an ``optuna.storages.InMemoryStorage``.

    ``autotune.study.storage.open_storage`` knows only files and databases; until it takes an
    in-memory URL itself, the replay wraps it here (and only here, for the replay's duration).
    """
    real = storage.open_storage

    def open_storage(url: str, *, create: bool = True) -> optuna.storages.BaseStorage:
        return optuna.storages.InMemoryStorage() if url == MEMORY_STORAGE else real(url, create=create)

    storage.open_storage = open_storage  # type: ignore[assignment]
    try:
        yield
    finally:
        storage.open_storage = real  # type: ignore[assignment]


# ----------------------------------------------------------------------------- strategies


class _BudgetSpent(Exception):
    pass


def spend_budget(runner: StudyRunner, backend: ReplayBackend, budget_s: float) -> None:
    """Run until the recorded seconds spent reach ``budget_s``, or nothing is left to launch.

    The runner's own budget starts no launch it expects not to finish within the budget (the
    median of the launches so far); here the trial's callback applies the same rule to the
    recorded seconds (what runs between two launches costs nothing). A trial is finished when
    its callback runs.
    """
    costs: list[float] = []

    def stop_when_spent(event: Any) -> None:
        spent = backend.log.spent_s
        if spent > sum(costs):
            costs.append(spent - sum(costs))
        if spent >= budget_s or (costs and spent + statistics.median(costs) > budget_s):
            raise _BudgetSpent

    if budget_s <= 0:
        return
    try:
        runner.run(n_trials=10**6, callback=stop_when_spent)
    except _BudgetSpent:
        pass


@dataclass(frozen=True)
class Strategy:
    """A search strategy as a study runs it.

    Args:
        study: ``[study]`` keys of the replay study (sampler, prior...).
        drive: Runs the study until the budget (recorded seconds) is spent.
    """

    name: str
    study: Mapping[str, Any]
    doc: str
    drive: Callable[[StudyRunner, ReplayBackend, float], None] = spend_budget


PROBE = "+probe"
NO_PROBE = "+noprobe"  # probe_margin = 0: the study as it ran before the probe's default (issue 39)
PROBE_MARGIN = 0.15
# Names of earlier replays (docs/search.md, bench/results/) for what is now a composition.
ALIASES = {"multifidelity": "prior" + PROBE}


def replayed(registered: BaseStrategy, probe: bool | None = None) -> Strategy:
    """A registered strategy as the replay runs it: the prior head start only where the strategy
    itself defaults to it (a plain ``tpe`` replays TPE alone, not the real study's default).
    ``probe``: True on, False off (``probe_margin = 0``), None the runner's default (on where
    the forecast says it pays: ``cost.auto_probe``)."""
    study: dict[str, Any] = {"sampler": registered.name, "prior": bool(registered.prior)}
    doc = registered.description or registered.name
    if probe is False:
        study["probe_margin"] = 0.0
        doc += "; no probe (probe_margin = 0)"
        return Strategy(registered.name + NO_PROBE, study, doc)
    if probe:
        study["probe_margin"] = PROBE_MARGIN
        doc += f"; every launch's first run a probe: more than {PROBE_MARGIN:.0%} below the leader, it stops there"
    return Strategy(registered.name + (PROBE if probe else ""), study, doc)


def strategy_named(name: str, registry: Mapping[str, BaseStrategy]) -> Strategy | None:
    """``NAME``, ``NAME+probe`` or an alias, from the registry; None when it names none."""
    base = ALIASES.get(name, name)
    probe: bool | None = True if base.endswith(PROBE) else False if base.endswith(NO_PROBE) else None
    base = base.removesuffix(PROBE).removesuffix(NO_PROBE)
    if base not in registry:
        return None
    return replace(replayed(registry[base], probe), name=name)


# ----------------------------------------------------------------------------- the replay study


def study_file_for(name: str, given: Sequence[Path]) -> Path:
    """The study file of a recorded study: among ``--study-file``, else bench/*.toml, the one
    whose ``[study] name`` is ``name``."""
    for path in list(given) or sorted(BENCH.glob("*.toml")):
        try:
            doc = tomllib.loads(path.read_text(encoding="utf-8"))
        except (OSError, tomllib.TOMLDecodeError) as exc:
            if given:
                raise ConfigError(f"--study-file {path}: {exc}") from None
            continue
        if doc.get("study", {}).get("name") == name:
            return path
    where = "the --study-file given" if given else f"{BENCH}/*.toml"
    raise ConfigError(f"no study file among {where} has [study] name = {name!r}; give it with --study-file")


def twin_of(engine: str) -> BaseBackend:
    """The registered backend of ``engine`` that predicts (its twin)."""
    for b in plugins.get_backends().values():
        if b.engine == engine and b.predictor is not None:
            return b
    raise ConfigError(f"no backend of engine {engine!r} predicts (no twin installed): --model cannot be checked")


def shape_mismatch(grid: RecordedGrid, model_ref: str, doc: Mapping[str, Any]) -> str | None:
    """Why ``model_ref`` is not the model the grid ran, from the real backend's recorded memory
    predictions: the engine's twin must give the same KV-cache bytes (the shape's layers and
    KV heads) and weights bytes within 10% (the twin computes a format's bytes from the shape;
    the real backend read the file). None when all agree."""
    twin = twin_of(grid.engine)
    cfg = parse_study_config(doc)
    ctx = StudyContext(
        gpu=hardware.get_gpu(grid.header["gpu"]["key"]),
        model=resolve_model(model_ref),
        workload=Workload(cfg.prompt_tokens, cfg.output_tokens),
        vram_budget_bytes=int(grid.header["vram_budget_bytes"]),
        protocol=Protocol(),
    )
    for key, recorded in grid.predicted.items():
        c = grid.configs[key]
        probe = replace(c, backend=twin.name, weights=grid.format_of[c.weights])
        try:
            mine = twin.estimate_memory(probe, ctx)
        except AutotuneError as exc:
            return f"{key}: {exc}"
        if abs(mine.kv_bytes - recorded.kv_bytes) > 0.005 * recorded.kv_bytes:
            return f"{key}: recorded KV {recorded.kv_bytes} bytes, {model_ref} gives {mine.kv_bytes}"
        if abs(mine.weights_bytes - recorded.weights_bytes) > 0.10 * recorded.weights_bytes:
            return f"{key}: recorded weights {recorded.weights_bytes} bytes, {model_ref} gives {mine.weights_bytes}"
    return None


def replay_model(grid: RecordedGrid, doc: Mapping[str, Any], study_file: Path, given: str | None) -> str:
    """The model a replay study names: ``--model``, else the study file's when it resolves
    (a catalog key, or a file that is here), else the one catalog model whose shape gives the
    recorded memory predictions (the grid's files are not here, and a study stores only its
    model's name)."""
    ref = str(doc.get("model", {}).get("ref", ""))
    if given:
        why = shape_mismatch(grid, given, doc)
        if why:
            raise ConfigError(f"--model {grid.name}={given}: not the model the grid ran: {why}")
        return given
    for candidate in (str(study_file.parent / ref), ref):
        try:
            resolve_model(candidate)
            return candidate
        except AutotuneError:
            pass
    fitting = [m for m in load_model_catalog() if shape_mismatch(grid, m, doc) is None]
    if len(fitting) != 1:
        how_many = "no" if not fitting else "more than one"
        raise ConfigError(
            f"grid '{grid.name}': its model {ref} is not here and {how_many} catalog model has its "
            f"shape ({', '.join(fitting) or 'none'}); name it with --model {grid.name}=KEY"
        )
    return fitting[0]


def replay_study_doc(grid: RecordedGrid, doc: Mapping[str, Any], model: str, strategy: Strategy) -> dict[str, Any]:
    """The grid's study file with the replay backend (weights as formats) on the recorded card."""
    out = copy.deepcopy(dict(doc))
    study = {k: v for k, v in out.get("study", {}).items() if k not in ("budget", "n_trials", "storage", "prior")}
    study.update(strategy.study)
    out["study"] = study
    out["hardware"] = {k: v for k, v in out.get("hardware", {}).items() if k != "gpu_index"}
    out["hardware"]["gpu"] = grid.header["gpu"]["key"]
    out["model"] = {**out.get("model", {}), "ref": model}
    candidates = out.get("candidates", [])
    if len(candidates) != 1 or candidates[0].get("backend") != grid.backend:
        raise ConfigError(
            f"grid '{grid.name}': the study file must have one [[candidates]] entry, of backend "
            f"{grid.backend!r}, the recorded one"
        )
    out["candidates"] = [{"backend": REPLAY_BACKEND, "weights": [grid.format_of[w] for w in candidates[0]["weights"]]}]
    out["backends"] = {k: v for k, v in out.get("backends", {}).items() if k != grid.backend}
    return out


def prepare_replay(
    grid: RecordedGrid, doc: Mapping[str, Any], study_file: Path, model: str, strategy: Strategy
) -> PreparedStudy:
    """Prepare the replay study, refusing one that would judge otherwise than the recording."""
    cfg = parse_study_config(
        replay_study_doc(grid, doc, model, strategy), source=f"{study_file} (replay)", path=study_file
    )
    prepared = prepare_study(cfg, storage=MEMORY_STORAGE)
    recorded_budget = int(grid.header["vram_budget_bytes"])
    if prepared.vram_budget_bytes != recorded_budget:
        raise ConfigError(
            f"{study_file}: [hardware] gives a budget of {prepared.vram_budget_bytes} bytes; the grid "
            f"'{grid.name}' was recorded with {recorded_budget}"
        )
    if cfg.objective != parse_objective(grid):
        raise ConfigError(
            f"{study_file}: [objective] differs from the one grid '{grid.name}' was recorded with "
            f"({grid.header['objective']})"
        )
    return prepared


# ----------------------------------------------------------------------------- truth


@dataclass(frozen=True)
class Truth:
    value: float
    feasible: bool


def truth_of(grid: RecordedGrid, key: str) -> Truth | None:
    """A configuration's truth: the objective of the mean of its runs' measurements (None:
    never measured). Feasible by the study's own constraints on those means."""
    measured = [t.record for t in grid.measured(key)]
    if not measured:
        return None
    objective = parse_objective(grid)
    metric = statistics.fmean(r.median(objective.metric) for r in measured)  # type: ignore[misc]
    users = [r.median("per_user_tok_s") for r in measured if r.median("per_user_tok_s") is not None]
    peaks = [r.measured_vram_bytes for r in measured if r.measured_vram_bytes is not None]
    drops = [r.quality_drop_points for r in measured if r.quality_drop_points is not None]
    # What the runner scores memory by: the measured peak, else the prediction.
    used = int(statistics.fmean(peaks)) if peaks else grid.predicted[key].total_bytes
    s = objective_mod.score(
        objective,
        metric,
        used,
        int(grid.header["vram_budget_bytes"]),
        statistics.fmean(drops) if drops else None,
        statistics.fmean(users) if users else None,
    )  # type: ignore[arg-type]
    return Truth(s.values[0], s.feasible)


def parse_objective(grid: RecordedGrid) -> Objective:
    """The grid's objective as recorded (latency targets, stored as JSON lists, back as pairs;
    a grid recorded before they existed has none)."""
    stored = dict(grid.header["objective"])
    stored["slo"] = tuple((str(k), float(v)) for k, v in stored.get("slo") or ())
    return Objective(**stored)


def between_runs(grid: RecordedGrid) -> dict[str, Any]:
    """Relative spread of the objective metric between runs, per configuration measured in
    at least two: (max - min) / mean."""
    metric = grid.header["objective"]["metric"]
    spreads = []
    for key in grid.configs:
        values = [t.record.median(metric) for t in grid.measured(key)]
        if len(values) >= 2:
            spreads.append((max(values) - min(values)) / statistics.fmean(values))  # type: ignore[type-var]
    return {
        "n_configs": len(spreads),
        "median_rel_diff": statistics.median(spreads) if spreads else None,
        "max_rel_diff": max(spreads) if spreads else None,
    }


# ----------------------------------------------------------------------------- one replay


@dataclass
class Outcome:
    seed: int
    pick: str | None
    ratio: float
    cost_fraction: float
    launches: int
    pick_feasible: bool
    pruned_but_measured: list[str] = field(default_factory=list)
    probe_stops: int = 0
    unsettled: int = 0  # launches of configurations the grid never settled


def replay_once(
    grid: RecordedGrid,
    backend: ReplayBackend,
    prepared: PreparedStudy,
    strategy: Strategy,
    seed: int,
    budget_s: float,
    best: float,
) -> Outcome:
    backend.reset(seed)
    runner = StudyRunner(prepared, seed=seed)
    strategy.drive(runner, backend, budget_s)
    if backend.log.unrecorded:
        raise AutotuneError(
            f"replay of '{grid.name}' ({strategy.name}, seed {seed}) launched what the grid pruned: "
            f"{backend.log.unrecorded}; its judge disagrees with the recorded one"
        )
    # Configurations the grid measured that this replay's judge refused for memory: the
    # judge's learned correction differed from the recording's (counted, should be none).
    pruned_but_measured = sorted(
        {
            key
            for r in records.records(runner.study, (TrialState.PRUNED,))
            if r.config
            and not r.answered
            and (r.prune_reason or "").startswith("infeasible: predicted")
            and grid.measured(key := grid.recorded_key(TrialConfig.from_dict(r.config)))
        }
    )
    top = best_trial(runner.study)
    pick = grid.recorded_key(TrialConfig.from_dict(top.config)) if top is not None and top.config else None
    truth = truth_of(grid, pick) if pick else None
    feasible = truth is not None and truth.feasible
    return Outcome(
        seed,
        pick,
        truth.value / best if feasible and truth else 0.0,  # type: ignore[union-attr]
        backend.log.spent_s / grid.measuring_seconds(),
        len(backend.log.launches),
        feasible,
        pruned_but_measured,
        backend.log.probe_stops,
        len(backend.log.unsettled),
    )


def figures(outcomes: Sequence[Outcome]) -> dict[str, Any]:
    return {
        "within_3pct": sum(o.ratio >= 1 - WITHIN for o in outcomes) / len(outcomes),
        "median_ratio": statistics.median(o.ratio for o in outcomes),
        "median_cost_fraction": statistics.median(o.cost_fraction for o in outcomes),
        "n_seeds": len(outcomes),
        "median_launches": statistics.median(o.launches for o in outcomes),
        "median_probe_stops": statistics.median(o.probe_stops for o in outcomes),
        "infeasible_picks": sum(not o.pick_feasible for o in outcomes),
        "unsettled_launches": sum(o.unsettled for o in outcomes),
    }


def replay_grid(
    grid: RecordedGrid, study_file: Path, model: str | None, strategies: Sequence[Strategy], seeds: int, fraction: float
) -> dict[str, Any]:
    doc = tomllib.loads(study_file.read_text(encoding="utf-8"))
    backend = ReplayBackend(grid)
    plugin_name = f"replay:{grid.name}"
    plugins.register_plugin(ReplayPlugin(backend), name=plugin_name, source=str(Path(__file__).name))
    try:
        model = replay_model(grid, doc, study_file, model)
        truths = {k: t for k in grid.configs if (t := truth_of(grid, k)) is not None}
        feasible = {k: t for k, t in truths.items() if t.feasible}
        if not feasible:
            raise ConfigError(f"grid '{grid.name}': no configuration is feasible by the recorded measurements")
        best_key = max(feasible, key=lambda k: feasible[k].value)
        best = feasible[best_key].value
        measuring_s = grid.measuring_seconds()
        budget_s = fraction * measuring_s
        out: dict[str, Any] = {
            "study": grid.name,
            "storages": grid.storages,
            "study_file": _shown(study_file),
            "replay_model": model,
            "n_configs": len(grid.configs),
            "n_measured": len(truths),
            "n_feasible": len(feasible),
            "n_pruned": sum(1 for k in grid.configs if not grid.launched(k)) - len(grid.unsettled()),
            "unsettled": [json.loads(k) for k in grid.unsettled()],
            "measuring_s": measuring_s,
            "budget_fraction": fraction,
            "budget_s": budget_s,
            "best": {"config": json.loads(best_key), "truth": best},
            "between_runs": between_runs(grid),
            "noise": (
                "each replayed trial answers from one of the recorded runs of its configuration, drawn at random"
                if len(grid.runs) > 1
                else "one recorded run: replayed trials answer exactly as recorded"
            ),
            "strategies": {},
            "seeds": {},
        }
        for strategy in strategies:
            prepared = prepare_replay(grid, doc, study_file, model, strategy)
            outcomes = [replay_once(grid, backend, prepared, strategy, seed, budget_s, best) for seed in range(seeds)]
            pruned = sorted({k for o in outcomes for k in o.pruned_but_measured})
            out["strategies"][strategy.name] = {**figures(outcomes), "pruned_but_measured": pruned}
            out["seeds"][strategy.name] = [
                {
                    "seed": o.seed,
                    "pick": json.loads(o.pick) if o.pick else None,
                    "ratio": o.ratio,
                    "pick_feasible": o.pick_feasible,
                    "cost_fraction": o.cost_fraction,
                    "launches": o.launches,
                }
                for o in outcomes
            ]
            out.setdefault("forecast", forecast_of(prepared, grid))
        return out
    finally:
        plugins.unregister_plugin(plugin_name)


def forecast_of(prepared: PreparedStudy, grid: RecordedGrid) -> dict[str, Any] | None:
    """What the study's cost forecast (``autotune.study.cost``) says of one launch, beside the
    grid's recorded mean launch, and whether the probe is on by default here (``auto_probe``)."""
    fc = cost.forecast(prepared)
    if fc is None:
        return None
    launched = [k for k in grid.configs if grid.launched(k)]
    recorded = grid.measuring_seconds() / len(launched) if launched else None
    saved = 1 - fc.trial.probed_s(fc.protocol.warmup_runs) / fc.trial.seconds if fc.trial.seconds else 0.0
    return {
        "trial_s": fc.trial.seconds,
        "trial_range_s": list(fc.trial_range),
        "start_s": fc.trial.start_s,
        "run_s": fc.trial.run_s,
        "recorded_launch_s": recorded,
        "probe_saves": saved,
        "probe_default": saved >= cost.PROBE_PAYS,
    }


# ----------------------------------------------------------------------------- command line


def group_grids(urls: Sequence[str], study: str | None) -> list[RecordedGrid]:
    """Storages holding the same study are runs of one grid."""
    by_name: dict[str, list[str]] = {}
    for url in urls:
        names = storage.study_names(storage.open_storage(url, create=False), url)
        if study is not None:
            names = [n for n in names if n == study]
        if len(names) != 1:
            raise ConfigError(
                f"--grid {url}: holds {'no study' if not names else 'several studies'} "
                f"{'named ' + study if study else '(' + ', '.join(names) + ')'}; name one with --study"
            )
        by_name.setdefault(names[0], []).append(url)
    return [RecordedGrid(group, name) for name, group in by_name.items()]


def text_report(result: Mapping[str, Any]) -> str:
    lines = []
    for g in result["grids"]:
        spread = g["between_runs"]
        lines += [
            f"grid {g['study']}: {g['n_configs']} configurations, {g['n_measured']} measured "
            f"({g['n_feasible']} feasible), {g['n_pruned']} pruned; {len(g['storages'])} run(s), "
            f"{g['measuring_s']:.0f} s of measuring per run; replay model {g['replay_model']}",
            f"  best by the grid's truth: {g['best']['truth']:.1f} ({_short(g['best']['config'])})",
            f"  between runs: median {_pct(spread['median_rel_diff'])}, worst {_pct(spread['max_rel_diff'])} "
            f"over {spread['n_configs']} configurations; noise: {g['noise']}",
            f"  budget: {g['budget_fraction']:.2f} x {g['measuring_s']:.0f} s = {g['budget_s']:.0f} s of recorded "
            "launches",
        ]
        fc = g.get("forecast")
        if fc:
            lines.append(
                f"  forecast: one launch {fc['trial_s']:.1f} s (start {fc['start_s']:.1f} s, runs of "
                f"{fc['run_s']:.2f} s; recorded mean {fc['recorded_launch_s']:.1f} s); a probe stop would save "
                f"{_pct(fc['probe_saves'])}: probe {'on' if fc['probe_default'] else 'off'} by default "
                f"(on from {_pct(cost.PROBE_PAYS)})"
            )
        if g["unsettled"]:
            hits = ", ".join(f"{n} {f['unsettled_launches']}" for n, f in g["strategies"].items())
            lines.append(
                f"  unsettled (every recorded launch interrupted; a replayed launch of one fails at no "
                f"cost): {'; '.join(_short(c) for c in g['unsettled'])}; such launches over all seeds: {hits}"
            )
        lines += _table(g["strategies"])
        lines.append("")
    if len(result["grids"]) > 1:
        lines.append("all grids together:")
        lines += _table(result["strategies"])
    return "\n".join(lines) + "\n"


def _table(strategies: Mapping[str, Mapping[str, Any]]) -> list[str]:
    out = [
        f"  {'strategy':<14}{'within 3%':>10}{'median pick/best':>18}{'median cost':>13}{'launches':>10}"
        f"{'probe stops':>13}{'seeds':>7}"
    ]
    for name, f in strategies.items():
        out.append(
            f"  {name:<14}{f['within_3pct']:>10.2f}{f['median_ratio']:>18.3f}{f['median_cost_fraction']:>13.3f}"
            f"{f['median_launches']:>10g}{f['median_probe_stops']:>13g}{f['n_seeds']:>7}"
        )
    return out


def _shown(path: Path) -> str:
    """A path as a reader of the results would type it: relative to here when it is below."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def _short(config: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in config.items() if k != "backend")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--grid",
        action="append",
        required=True,
        metavar="STORAGE_URL",
        help="storage of a recorded grid study; repeat for more runs of it, or for other grids",
    )
    ap.add_argument("--study", help="the study to read when a storage holds several")
    ap.add_argument(
        "--study-file",
        action="append",
        type=Path,
        default=[],
        help="the grid's study file (default: the bench/*.toml whose [study] name is the recorded one)",
    )
    ap.add_argument(
        "--model",
        action="append",
        default=[],
        metavar="STUDY=REF",
        help="the model a grid ran, as a catalog key or file (default: its study file's, else the "
        "catalog model with the recorded KV-cache shape)",
    )
    ap.add_argument("--seeds", type=int, default=20, help="replays per strategy (seeds 0..N-1)")
    registry = plugins.get_strategies()
    known = [*registry, *ALIASES]
    ap.add_argument(
        "--strategies",
        default="random,tpe,prior,twin,multifidelity",
        help=f"comma-separated: {', '.join(known)}, or NAME{PROBE} for any of them with the probe",
    )
    ap.add_argument(
        "--budget-fraction",
        type=float,
        default=0.25,
        help="recorded seconds each replay may launch, as a fraction of the grid's measuring seconds",
    )
    ap.add_argument("--json", action="store_true", help="print JSON instead of the table")
    ap.add_argument("--out", type=Path, help="also write PREFIX.txt and PREFIX.json")
    args = ap.parse_args(argv)
    names = [s.strip() for s in args.strategies.split(",") if s.strip()]
    found = {n: strategy_named(n, registry) for n in names}
    unknown = [n for n, s in found.items() if s is None]
    if unknown or not names:
        ap.error(
            f"--strategies {args.strategies!r}: unknown {', '.join(unknown) or '(none given)'} "
            f"(known: {', '.join(known)}, each also as NAME{PROBE})"
        )
    args.strategy_list = [found[n] for n in names]
    if args.seeds < 1:
        ap.error(f"--seeds {args.seeds}: must be at least 1")
    if not 0 < args.budget_fraction <= 1:
        ap.error(f"--budget-fraction {args.budget_fraction}: must be > 0 and <= 1")
    args.models = {}
    for item in args.model:
        study, sep, ref = item.partition("=")
        if not sep or not study or not ref:
            ap.error(f"--model {item!r}: use STUDY=REF (a recorded study's name and a catalog key or model file)")
        args.models[study] = ref
    return args


def run(args: argparse.Namespace) -> dict[str, Any]:
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    started = time.monotonic()
    grids = []
    for grid in group_grids(args.grid, args.study):
        study_file = study_file_for(grid.name, args.study_file)
        with in_memory_storages():
            grids.append(
                replay_grid(
                    grid, study_file, args.models.get(grid.name), args.strategy_list, args.seeds, args.budget_fraction
                )
            )
    pooled = {}
    for strategy in args.strategy_list:
        outcomes = [
            Outcome(s["seed"], None, s["ratio"], s["cost_fraction"], s["launches"], s["pick_feasible"])
            for g in grids
            for s in g["seeds"][strategy.name]
        ]
        pooled[strategy.name] = figures(outcomes)
    return {
        "grids": grids,
        "strategies": pooled,
        "within": WITHIN,
        "strategy_docs": {s.name: s.doc for s in args.strategy_list},
        "elapsed_s": time.monotonic() - started,
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    with handle_errors():
        result = run(args)
    text = text_report(result)
    if args.out is not None:
        args.out.with_suffix(".txt").write_text(text, encoding="utf-8")
        args.out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    print(json.dumps(result, indent=1) if args.json else text, end="" if not args.json else "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
