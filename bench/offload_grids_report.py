"""Every figure of bench/results/offload_grids_h200/README.md, from the grids' storages (issue 27).

    python bench/offload_grids_report.py [--dir bench/results/offload_grids_h200] [--no-best]

Sections, per grid (dense offload, MoE) and run:
  1. counts (complete, pruned by the judge and why, failed and why, waiting), each run's best
     configuration, both runs side by side per configuration with the between-run spread;
  2. the memory model against NVML for every launched trial: the trial's stored prediction (the
     judge's: the memory model plus what the study had learned from its earlier trials) and the
     memory model alone (that learned correction taken off, as bench/replay_backend.py does), each
     against the measured peak; every failed trial and each baseline that failed, with the
     allocation its engine log names;
  3. the winner against llama.cpp's --fit, as ``autotune best --json`` gives it (--no-best skips
     the subprocess);
  4. the twin (twin-llama.cpp, published constants, and the study's own calibration: in-sample)
     against the mean of the runs' measurements, per configuration, and the Spearman rank
     correlation of the twin's aggregate with the measured one.

Trials are read through autotune.study.records.TrialRecord. The twin needs each grid's model:
the header-only GGUF files bench/offload_grid_models.py writes (under /tmp by default).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any, Mapping, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))

import offload_grid_models  # noqa: E402

from autotune import plugins
from autotune.hardware import gpus as hardware
from autotune.engine import vram
from autotune.engine.backend import StudyContext, TrialConfig, Workload  # noqa: E402
from autotune.measure import Protocol  # noqa: E402
from autotune.modelfiles.models import resolve_model  # noqa: E402
from autotune.report.text import load_study  # noqa: E402
from autotune.study import records  # noqa: E402
from autotune.study.records import TrialRecord, TrialState  # noqa: E402

GRIDS = {"h200-grid-offload-dense": "h200_grid_offload_dense", "h200-grid-moe": "h200_grid_moe"}
PLACEMENT = ("gpu_layers", "n_cpu_moe", "ubatch", "cache_type", "parallel")
METRICS = ("decode_tok_s", "prefill_tok_s", "aggregate_tok_s")
GIB = 2**30


def short(config: Mapping[str, Any]) -> str:
    return " ".join(f"{k}={config[k]}" for k in PLACEMENT if config.get(k) is not None)


def pct(x: float) -> str:
    return f"{100 * x:+.2f}%"


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
    """Spearman's rho: Pearson's correlation of the ranks (ties share their mean rank)."""

    def ranks(xs: Sequence[float]) -> list[float]:
        order = sorted(range(len(xs)), key=lambda i: xs[i])
        out = [0.0] * len(xs)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
                j += 1
            for k in range(i, j + 1):
                out[order[k]] = (i + j) / 2
            i = j + 1
        return out

    ra, rb = ranks(a), ranks(b)
    ma, mb = statistics.fmean(ra), statistics.fmean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    return cov / math.sqrt(sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb))


def load_runs(directory: Path, stem: str, study: str) -> list[tuple[str, Any]]:
    runs = []
    for path in sorted(directory.glob(f"{stem}-run*.db")):
        runs.append((f"sqlite:///{path}", load_study(f"sqlite:///{path}", study)))
    return runs


def reason_kind(r: TrialRecord) -> str:
    text = r.reason
    if text.startswith("infeasible: predicted"):
        return "the memory model: over the budget"
    return text.split(":")[0]


# ----------------------------------------------------------------------------- 1. counts


def counts(name: str, runs: list[tuple[str, Any]]) -> dict[str, dict[str, TrialRecord]]:
    """Prints section 1; returns each run's measurement per configuration key."""
    measured: dict[str, dict[str, TrialRecord]] = {}
    configs: dict[str, Mapping[str, Any]] = {}
    for url, study in runs:
        recs = [r for r in records.records(study) if not r.answered]
        by_state: dict[str, int] = {}
        for r in recs:
            by_state[r.state.name] = by_state.get(r.state.name, 0) + 1
        settled = {r.config_key for r in recs if r.stands_for_config}
        keys = {TrialConfig.from_dict(r.config).key for r in recs if r.config}  # a waiting trial has no key yet
        print(
            f"{name} {Path(url).name}: {len(recs)} trials, {len(settled)} of {len(keys)} configurations settled; "
            + ", ".join(f"{n} {s.lower()}" for s, n in sorted(by_state.items()))
        )
        why: dict[str, int] = {}
        for r in recs:
            if r.state in (TrialState.PRUNED, TrialState.FAIL):
                k = f"{r.state.name.lower()}: {reason_kind(r)}" + (
                    " (retry: cut short from outside)" if r.retry else ""
                )
                why[k] = why.get(k, 0) + 1
        for k, n in sorted(why.items()):
            print(f"    {n} x {k}")
        waiting = [short(r.config) for r in recs if r.state == TrialState.WAITING and r.config]
        if waiting:
            print(f"    never started (device time ran out): {'; '.join(waiting)}")
        run = measured.setdefault(url, {})
        for r in recs:
            if r.state == TrialState.COMPLETE and r.config_key:
                run[r.config_key] = r
                configs[r.config_key] = r.config  # type: ignore[assignment]
        best = max(run.values(), key=lambda r: r.values[0] if r.values else -1)  # type: ignore[index]
        print(
            f"    best: {short(best.config)}: {best.median('aggregate_tok_s'):.1f} tok/s aggregate "  # type: ignore[arg-type]
            f"(trial {best.number}, spread {best.metrics['aggregate_tok_s'].get('spread', 0):.1%})"
        )
    urls = [u for u, _ in runs]
    print(f"\n| configuration | {' | '.join(Path(u).stem.rsplit('-', 1)[-1] for u in urls)} | between runs |")
    print("| --- |" + " --- |" * (len(urls) + 1))
    diffs = []
    for key in sorted(
        configs,
        key=lambda k: -statistics.fmean(measured[u][k].median("aggregate_tok_s") for u in urls if k in measured[u]),
    ):  # type: ignore[misc]
        vals = [measured[u][key].median("aggregate_tok_s") if key in measured[u] else None for u in urls]
        got = [v for v in vals if v is not None]
        spread = (max(got) - min(got)) / statistics.fmean(got) if len(got) > 1 else None  # type: ignore[type-var]
        if spread is not None:
            diffs.append(spread)
        print(
            f"| {short(configs[key])} | "
            + " | ".join("-" if v is None else f"{v:.1f}" for v in vals)
            + f" | {'-' if spread is None else f'{spread:.1%}'} |"
        )
    if diffs:
        print(
            f"\nbetween runs (|r1 - r2| / mean, aggregate tok/s): median {statistics.median(diffs):.1%}, "
            f"max {max(diffs):.1%} over {len(diffs)} configurations measured in both runs"
        )
    return measured


# ----------------------------------------------------------------------------- 2. memory


def memory(name: str, runs: list[tuple[str, Any]]) -> None:
    print(f"\n{name}: predicted GPU bytes vs NVML peak, every launched trial")
    print("| run | trial | configuration | stored prediction | model alone | NVML peak | stored err | model err |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    stored_err, model_err = [], []
    for url, study in runs:
        residuals: list[int] = []
        for r in sorted(records.records(study), key=lambda r: r.number):
            if r.answered:
                continue
            correction = vram.learned_correction(residuals) or 0
            if r.launched and r.predicted_vram and r.measured_vram_bytes:
                p = int(r.predicted_vram["total_bytes"])
                m = int(r.measured_vram_bytes)
                s_err, m_err = (p - m) / m, (p - correction - m) / m
                stored_err.append(s_err)
                model_err.append(m_err)
                print(
                    f"| {Path(url).stem.rsplit('-', 1)[-1]} | {r.number} | {short(r.config)} | {p / GIB:.3f} GiB | "  # type: ignore[arg-type]
                    f"{(p - correction) / GIB:.3f} GiB | {m / GIB:.3f} GiB | {pct(s_err)} | {pct(m_err)} |"
                )
            if r.state == TrialState.COMPLETE and r.vram_residual_bytes is not None:
                residuals.append(int(r.vram_residual_bytes))
    for label, errs in (("stored prediction", stored_err), ("memory model alone", model_err)):
        a = [abs(e) for e in errs]
        print(
            f"{label}: {len(errs)} trials, median |error| {statistics.median(a):.2%}, max |error| {max(a):.2%} "
            f"(signed {min(errs):+.2%} .. {max(errs):+.2%}), within 2%: {sum(x <= 0.02 for x in a)}/{len(a)}"
        )
    for url, study in runs:
        for r in records.records(study):
            if r.state == TrialState.FAIL:
                tail = (r.log_tail or "").strip().splitlines()[-1:] or ["(no engine log)"]
                print(
                    f"failed: {Path(url).stem} trial {r.number} {short(r.config)}: {r.fail_reason}; launched "  # type: ignore[arg-type]
                    f"{r.launched}, retry {r.retry}, judge's prediction "
                    f"{int(r.predicted_vram['total_bytes']) / GIB:.3f} GiB; log: {tail[0][:160]}"
                )  # type: ignore[index]
        budget = int(study.user_attrs["vram_budget_bytes"])
        for key, b in records.baselines(study).items():
            if b.failed:
                alloc = re.search(r"allocating ([\d.]+) MiB", b.error or "")
                size = re.search(r"buffer of size (\d+)", b.error or "")
                print(
                    f"baseline {key} ({Path(url).stem}) failed: {b.config}: it asked for one "
                    f"{alloc.group(1) if alloc else '?'} MiB CUDA buffer ({int(size.group(1)) / GIB:.2f} GiB"
                    if size
                    else f"baseline {key} failed: {(b.error or '')[:200]}",
                    end="",
                )
                if size:
                    print(f", the weights of every layer) against the study's budget of {budget / GIB:.2f} GiB")


# ----------------------------------------------------------------------------- 3. --fit


def versus_fit(name: str, runs: list[tuple[str, Any]]) -> None:
    print(f"\n{name}: the winner against llama.cpp's --fit (autotune best --json)")
    for url, study in runs:
        out = subprocess.run(
            [
                sys.executable,
                "-c",
                "import sys; from autotune.cli import main; sys.exit(main())",
                "best",
                "--storage",
                url,
                "--study",
                name,
                "--json",
            ],
            capture_output=True,
            text=True,
            check=True,
        )
        d = json.loads(out.stdout)
        fit = d["baseline"]["llama-server:fit"]
        agg = fit["ratio"].get("aggregate", {})
        print(f"  {Path(url).stem}: {fit['text']}")
        if agg:
            print(
                f"    ratio {agg['ratio']:.3f}: winner {agg['winner']:.2f} +- {agg['winner_spread']:.1%}, "
                f"--fit {agg['baseline']:.2f} +- {agg['baseline_spread']:.1%}, within noise {agg['within_noise']}"
            )
        stored = records.baselines(study).get("llama-server:fit")
        if stored is not None and stored.peak_vram_bytes:
            print(
                f"    --fit's NVML peak {stored.peak_vram_bytes / GIB:.2f} GiB of the study's budget "
                f"{int(study.user_attrs['vram_budget_bytes']) / GIB:.2f} GiB"
            )


# ----------------------------------------------------------------------------- 4. twin


def twin_check(
    name: str, runs: list[tuple[str, Any]], measured: Mapping[str, Mapping[str, TrialRecord]], model_ref: str
) -> None:
    """Twin vs measurement, asked three ways: as the study asked it (no ``host_threads``
    setting: the host's whole memory bandwidth runs the host layers), with the thread count the
    trials' own deploy commands name (``-t N``), and with the study's stored calibration (fitted
    on these very runs: in-sample, shown for what the study's own prior would say afterwards)."""
    twin = plugins.get_backends()["twin-llama.cpp"]
    study = runs[0][1]
    header = study.user_attrs
    wl = header.get("workload") or {}
    base = StudyContext(
        gpu=hardware.get_gpu(header["gpu"]["key"]),
        model=resolve_model(model_ref),
        workload=Workload(int(wl.get("prompt_tokens", 1024)), int(wl.get("output_tokens", 48))),
        vram_budget_bytes=int(header["vram_budget_bytes"]),
        protocol=Protocol(),
    )
    keys = sorted({k for run in measured.values() for k in run})
    threads = {
        int(t)
        for run in measured.values()
        for r in run.values()
        for t in re.findall(r" -t (\d+) ", r.deploy_command or "")
    }
    calibrations = [c for _, s in runs if (c := records.stored_calibrations(s).get("llama-server"))]
    asked = {"as the study asked it (no host_threads setting)": [base]}
    if len(threads) == 1:
        asked[f"host_threads = {next(iter(threads))} (the trials' own -t)"] = [
            replace(base, settings={"host_threads": next(iter(threads))})
        ]
    asked["the study's calibration, no host_threads (fitted on these runs: in-sample)"] = [
        replace(base, calibration=c) for c in calibrations
    ]
    print(
        f"\n{name}: twin-llama.cpp vs the mean of the runs, workload "
        f"{base.workload.prompt_tokens}+{base.workload.output_tokens} tokens, model {base.model.key}"
    )
    rows = []
    for key in keys:
        recs = [run[key] for run in measured.values() if key in run]
        c = TrialConfig.from_dict(recs[0].config)  # type: ignore[arg-type]
        probe = replace(c, backend=twin.name, weights="gguf:" + Path(c.weights).stem.rsplit("-", 1)[-1])
        preds = {label: [twin.predictor.predict(probe, ctx) for ctx in ctxs] for label, ctxs in asked.items()}
        meas = {m: statistics.fmean(r.median(m) for r in recs) for m in METRICS}  # type: ignore[misc]
        rows.append((c, meas, preds))
    labels = list(asked)
    print(
        "| configuration | measured decode / prefill / aggregate | "
        + " | ".join(f"twin/measured ({i + 1})" for i in range(len(labels)))
        + " |"
    )
    print("| --- | --- |" + " --- |" * len(labels))
    for c, meas, preds in rows:
        cells = []
        for label in labels:
            p = preds[label][0]
            cells.append(" / ".join(f"{p[m] / meas[m]:.2f}" for m in METRICS))
        print(f"| {short(c.as_dict())} | {' / '.join(f'{meas[m]:.1f}' for m in METRICS)} | {' | '.join(cells)} |")
    for i, label in enumerate(labels):
        print(f"({i + 1}) {label}:")
        for m in METRICS:
            ratios = [p[m] / meas[m] for _, meas, preds in rows for p in preds[label]]
            print(
                f"  {m}: twin/measured median {statistics.median(ratios):.2f}, range {min(ratios):.2f}-{max(ratios):.2f}"
                f" over {len(ratios)} predictions"
            )
        twin_agg = [statistics.fmean(p["aggregate_tok_s"] for p in preds[label]) for _, _, preds in rows]
        real = [meas["aggregate_tok_s"] for _, meas, _ in rows]
        top_twin = max(range(len(rows)), key=lambda j: twin_agg[j])
        top = max(range(len(rows)), key=lambda j: real[j])
        print(
            f"  ranking of aggregate tok/s over {len(rows)} configurations: Spearman {spearman(twin_agg, real):.2f}; "
            f"the twin's top ({short(rows[top_twin][0].as_dict())}) is measured at {real[top_twin] / real[top]:.1%} "
            f"of the best ({short(rows[top][0].as_dict())})"
        )


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", type=Path, default=Path(__file__).resolve().parent / "results" / "offload_grids_h200")
    ap.add_argument(
        "--models",
        type=Path,
        default=Path("/tmp/offload_grid_models"),
        help="where bench/offload_grid_models.py writes (or wrote) the header-only GGUFs",
    )
    ap.add_argument("--no-best", action="store_true", help="skip section 3 (autotune best, one process per run)")
    args = ap.parse_args(argv)
    offload_grid_models.main(["--out", str(args.models)])
    model_of = {study: str(args.models / f"{stem}.gguf") for stem, study in offload_grid_models.STUDY_OF.items()}
    for name, stem in GRIDS.items():
        runs = load_runs(args.dir, stem, name)
        print(f"\n=============== {name} ({len(runs)} runs)\n")
        measured = counts(name, runs)
        memory(name, runs)
        if not args.no_best:
            versus_fit(name, runs)
        twin_check(name, runs, measured, model_of[name])
    return 0


if __name__ == "__main__":
    sys.exit(main())
