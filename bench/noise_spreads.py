"""Between-launch spreads of recorded storages (issue 39 item 4): every configuration measured
in more than one launch, within a storage (the finish's rounds, the baselines' finish launches)
and across the storages of one study (the grids' two runs, the seeds of one grid).

    python bench/noise_spreads.py bench/results/h200_grids/*.db bench/results/h200_seeds/*.db \
        bench/results/offload_grids_h200/*.db [--json]

The study's objective metric (aggregate tok/s on these), each launch's median; a configuration's
spread is its launches' range over their median (``autotune.study.noise``); per storage, per
study (its storages pooled by configuration), the median and the worst over configurations, and
the median within-launch spread of its trials (the runs inside one launch) beside it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import optuna

from autotune.study import noise, open_storage

optuna.logging.set_verbosity(optuna.logging.WARNING)


def spreads(launches: dict[str, list[float]]) -> dict[str, float | int | None]:
    ranges = [r for v in launches.values() if (r := noise.relative_range(v)) is not None]
    return {
        "configs": len(ranges),
        "launches": sum(len(v) for v in launches.values() if len(v) > 1),
        "median": statistics.median(ranges) if ranges else None,
        "worst": max(ranges) if ranges else None,
    }


def pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("storages", nargs="+", type=Path)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    pooled: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    within: dict[str, list[float]] = defaultdict(list)
    rows = []
    for path in args.storages:
        storage = open_storage(f"sqlite:///{path}", create=False)
        for summary in optuna.get_all_study_summaries(storage):
            study = optuna.load_study(study_name=summary.study_name, storage=storage)
            metric = noise.objective_metric(study)
            launches = noise.launches_by_config(study, metric)
            est = noise.estimate(study, metric)
            rows.append(
                {
                    "storage": str(path),
                    "study": study.study_name,
                    "metric": metric,
                    "within_launch": est.within,
                    **spreads(launches),
                }
            )
            if est.within is not None:
                within[study.study_name].append(est.within)
            for key, values in launches.items():
                pooled[study.study_name][key] += values
    studies = [
        {
            "study": name,
            "storages": sum(1 for r in rows if r["study"] == name),
            "within_launch": statistics.median(within[name]) if within[name] else None,
            **spreads(launches),
        }
        for name, launches in sorted(pooled.items())
    ]
    if args.json:
        print(json.dumps({"storages": rows, "studies": studies}, indent=2))
        return 0
    print("per storage (configurations launched more than once inside it):")
    for r in rows:
        print(
            f"  {r['storage']}: {r['study']}: within a launch {pct(r['within_launch'])}, between launches "
            f"{pct(r['median'])} median, {pct(r['worst'])} worst over {r['configs']} configurations"
        )
    print("per study (its storages pooled by configuration):")
    for s in studies:
        print(
            f"  {s['study']} ({s['storages']} storages): within a launch {pct(s['within_launch'])}, between "
            f"launches {pct(s['median'])} median, {pct(s['worst'])} worst over {s['configs']} configurations "
            f"({s['launches']} launches)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
