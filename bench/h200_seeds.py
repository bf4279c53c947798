"""Values real H200 studies by the recorded exhaustive grid they searched (issue 14, items 5 and 6).

    python bench/h200_seeds.py [--json]

Reads the storages `bench/h200_grids.sh seeds` and `workers` wrote (bench/results/h200_seeds/)
and the two recorded runs of each grid (bench/results/h200_grids/). For each seed: the study's
pick (its best after the noise-aware finish), that configuration's value by the grid (the mean of
its two grid runs, scored by the study's own objective), the ratio to the grid's best, and what
the study spent launching (the sum of its trials' seconds) against one grid run's launching
seconds. For the two-worker study: how many configurations each worker measured, how many were
measured twice, and whether it covered the grid.

The grid's truth is two runs recorded on another day; the seed studies measured the top
configurations again, many times (their first runs and their finish's rounds). So each pick is
also valued by every measurement of its configuration pooled (the grid's runs, every seed
study's first runs and finish rounds): its pooled mean against the best pooled mean, and
whether the two differ by more than their runs' noise explains (the finish's own test,
``needed_lead``, at 95%): a pick inside it is a tie with the best, not a loss.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from replay import WITHIN, truth_of  # noqa: E402
from replay_backend import RecordedGrid, trial_seconds  # noqa: E402

from autotune.report.text import load_study  # noqa: E402
from autotune.study import records  # noqa: E402
from autotune.study.summary import summarize
from autotune.study.verdict import needed_lead

RESULTS = Path(__file__).resolve().parent / "results"
GRIDS = {"qwen7b": "h200_grid_qwen7b", "llama8b": "h200_grid_llama8b"}


def url(path: Path) -> str:
    return f"sqlite:///{path}"


def grid_of(short: str) -> RecordedGrid:
    return RecordedGrid([url(RESULTS / "h200_grids" / f"{GRIDS[short]}-run{n}.db") for n in (1, 2)])


def grid_best(grid: RecordedGrid) -> tuple[str, float]:
    truths = {key: truth_of(grid, key) for key in grid.configs}
    key = max((k for k, t in truths.items() if t is not None and t.feasible), key=lambda k: truths[k].value)  # type: ignore[union-attr]
    return key, truths[key].value  # type: ignore[union-attr]


def launch_seconds(study) -> tuple[float, int]:
    launched = [r for r in records.records(study) if r.config_key and not r.answered and r.launched]
    return sum(trial_seconds(study.trials[r.number]) for r in launched), len(launched)


def pooled_runs(grid: RecordedGrid, studies: list) -> dict[str, list[float]]:
    """Every measurement of each configuration: the grid's runs, then each study's trials (their
    first runs) and its finish's rounds; configurations the grid finds infeasible left out."""
    metric = grid.header["objective"]["metric"]
    runs: dict[str, list[float]] = {}
    for key in grid.configs:
        truth = truth_of(grid, key)
        if truth is not None and truth.feasible:
            runs[key] = [t.record.median(metric) for t in grid.measured(key)]  # type: ignore[misc]
    for study in studies:
        by_number = {}
        for r in records.measured(study):
            if r.config_key in runs and r.values:
                runs[r.config_key].append(r.values[0])
                by_number[r.number] = r.config_key
        for number, rounds in records.remeasures(study).items():
            for m in rounds.values():
                if number in by_number and not m.failed and m.feasible and m.value is not None:
                    runs[by_number[number]].append(m.value)
    return runs


def pooled_value(runs: dict[str, list[float]], key: str | None) -> dict | None:
    """The pick's pooled mean against the best pooled mean, and whether noise explains the gap."""
    if key is None or key not in runs:
        return None
    means = {k: sum(v) / len(v) for k, v in runs.items() if len(v) >= 2}
    best = max(means, key=means.__getitem__)
    pick = sum(runs[key]) / len(runs[key])
    gap = means[best] / pick - 1
    needed = needed_lead(runs[best], runs[key]) if key != best else 0.0
    return {
        "ratio": pick / means[best],
        "n_runs": len(runs[key]),
        "best_n_runs": len(runs[best]),
        "best_is_pick": key == best,
        "gap": gap,
        "needed": needed,
        "tie_with_best": gap <= needed,
        "best": json.loads(best),
    }


def value_seed(grid: RecordedGrid, path: Path, best_value: float) -> dict:
    study = load_study(url(path))
    summary = summarize(study, str(path))
    pick = summary.best
    picked = records.TrialRecord.of(study.trials[pick["number"]]) if pick else None
    truth = truth_of(grid, picked.config_key) if picked is not None and picked.config_key else None
    spent, n = launch_seconds(study)
    finish = summary.extra.get("finish") or {}
    return {
        "storage": str(path.relative_to(RESULTS.parent.parent)),
        "pick": pick["params"] if pick else None,
        "ratio": truth.value / best_value if truth is not None and truth.feasible else 0.0,
        "launch_seconds": round(spent, 1),
        "launches": n,
        "cost_fraction": spent / grid.measuring_seconds(),
        "finish": finish.get("text"),
        "pick_key": picked.config_key if picked is not None else None,
        "grid_best_launched": any(r.config_key == _best_key(grid) and r.launched for r in records.records(study)),
        "grid_best_in_finish": any(
            by.config_key == _best_key(grid)
            for by in records.measured(study)
            if by.number in (finish.get("trials") or [])
        ),
        "tied": finish.get("tied"),
    }


def _best_key(grid: RecordedGrid) -> str:
    return grid_best(grid)[0]


def workers(grid: RecordedGrid, path: Path) -> dict:
    study = load_study(url(path))
    launched = [r for r in records.records(study) if r.config_key and not r.answered and r.launched]
    per_key = Counter(r.config_key for r in launched)
    trials = [t for t in study.trials if t.datetime_start is not None and t.datetime_complete is not None]
    span = (max(t.datetime_complete for t in trials) - min(t.datetime_start for t in trials)).total_seconds()
    return {
        "span_s": round(span, 1),
        "span_vs_one_gpu_launch_seconds": span / grid.measuring_seconds(),
        "storage": str(path.relative_to(RESULTS.parent.parent)),
        "per_worker": dict(Counter(str(r.worker) for r in launched)),
        "configurations_launched": len(per_key),
        "launched_twice": sorted(k for k, n in per_key.items() if n > 1),
        "grid_configurations_launched": len(launched_by_grid := {k for k in grid.configs if grid.launched(k)}),
        "missing_from_grid": sorted(launched_by_grid - set(per_key)),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    out: dict = {"grids": {}}
    for short in GRIDS:
        grid = grid_of(short)
        best_key, best_value = grid_best(grid)
        seeds = sorted((RESULTS / "h200_seeds").glob(f"{GRIDS[short]}-seed*.db"))
        rows = [value_seed(grid, p, best_value) for p in seeds]
        runs = pooled_runs(grid, [load_study(url(p)) for p in seeds])
        for r in rows:
            r["pooled"] = pooled_value(runs, r.pop("pick_key"))
        out["grids"][short] = {
            "grid_best": grid.configs[best_key].as_dict(),
            "grid_best_value": best_value,
            "grid_launch_seconds": grid.measuring_seconds(),
            "seeds": rows,
            "within_3pct": sum(r["ratio"] >= 1 - WITHIN for r in rows),
        }
        two = RESULTS / "h200_seeds" / f"{GRIDS[short]}-2workers.db"
        if two.exists():
            out["grids"][short]["two_workers"] = {**workers(grid, two), "pick": value_seed(grid, two, best_value)}
    if args.json:
        print(json.dumps(out, indent=2, default=str))
        return 0
    for short, g in out["grids"].items():
        print(
            f"{short}: grid best {g['grid_best_value']:.1f} ({g['grid_best']}), one grid run launches for "
            f"{g['grid_launch_seconds']:.0f} s"
        )
        for r in g["seeds"]:
            print(
                f"  {Path(r['storage']).stem}: pick/best {r['ratio']:.3f}, {r['launches']} launches, "
                f"{r['launch_seconds']:.0f} s = {r['cost_fraction']:.2f} of the grid; {r['pick']}"
            )
            print(f"      finish: {r['finish']}")
            print(f"      grid's best launched: {r['grid_best_launched']}, in the finish: {r['grid_best_in_finish']}")
            pl = r["pooled"]
            if pl is not None:
                print(
                    f"      pooled ({pl['n_runs']} runs of the pick, {pl['best_n_runs']} of the pooled best): "
                    f"pick/best {pl['ratio']:.3f}, "
                    + (
                        "the pooled best itself"
                        if pl["best_is_pick"]
                        else f"gap {pl['gap'] * 100:.1f}% {'within' if pl['tie_with_best'] else 'beyond'} the "
                        f"{pl['needed'] * 100:.1f}% noise explains: {'a tie with' if pl['tie_with_best'] else 'slower than'} "
                        f"{pl['best']['weights'].rsplit('/', 1)[-1]} p{pl['best']['parallel']} {pl['best']['cache_type']}"
                    )
                )
        if g["seeds"]:
            print(
                f"  within 3% of the grid's best: {g['within_3pct']} of {len(g['seeds'])}; pooled: the best or "
                f"a tie with it in {sum(1 for r in g['seeds'] if r['pooled'] and r['pooled']['tie_with_best'])} "
                f"of {len(g['seeds'])}"
            )
        else:
            print("  no seed study recorded")
        if "two_workers" in g:
            w = g["two_workers"]
            print(
                f"  two workers: first trial start to last trial end {w['span_s']:.0f} s = "
                f"{w['span_vs_one_gpu_launch_seconds']:.2f} x one GPU's launch seconds for the grid"
            )
            print(f"  two workers: pick/best {w['pick']['ratio']:.3f}; finish: {w['pick']['finish']}")
            print(
                f"  two workers: {w['per_worker']} launches, {w['configurations_launched']} configurations, "
                f"launched twice: {len(w['launched_twice'])}; of the {w['grid_configurations_launched']} the grid "
                f"launched, not launched here: {len(w['missing_from_grid'])}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
