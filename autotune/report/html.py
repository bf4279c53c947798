"""The study report as one self-contained HTML file: the winner, the trade-off plots, every trial.

``autotune report`` and ``autotune study --report PATH`` write it. plotly.js is inlined once, so
the file opens offline and can be attached to an issue. What each plot answers is in
docs/report.md; the figures come from the study's records (``records.TrialRecord``)
and its summary (``report.stored_summary``), never from a second reading of the attributes.
"""

from __future__ import annotations

import datetime as dt
import html
from collections import defaultdict
from pathlib import Path
from typing import Any

import optuna

from autotune.study import records
from autotune.study.admission import budget_text
from autotune.study.records import TrialRecord, TrialState
from autotune.errors import ConfigError
from autotune.hardware.gpus import CPU_KEY
from autotune.engine.metric import metric_named
from autotune.study.objective import objective_words
from autotune.report.slo import slo_section
from autotune.report.speculation import speculation_section
from autotune.study.systematic import normalized
from autotune.study.summary import StudySummary, contender_text, counts_text, failure_kind, headline_lines
from autotune.report.html_assets import CSS, SORT_JS

GIB = 2**30
MIB = 2**20
SHOWN_CHARS = 90  # a long reason shows this much of its start and of its end (a traceback's last
# line is its cause); the whole opens on a click
FADED = 0.25


def _gib(n: float | None) -> float | None:
    return None if n is None else n / GIB


def _fmt(x: Any, digits: int = 1) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.{digits}f}"
    return str(x)


def _spread(r: TrialRecord, metric: str) -> float | None:
    m = r.metrics.get(metric) or {}
    return m.get("spread")


def _label(config: dict[str, Any], keys: tuple[str, ...]) -> str:
    return " ".join(
        f"{Path(str(config[k])).name}" if k == "weights" else f"{k}={config[k]}" for k in keys if k in config
    )


def _options(config: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in config.items() if k not in ("backend", "weights", "ctx", "parallel"))


def trial_rows(study: optuna.Study) -> list[TrialRecord]:
    """The trials a person reviews: every configuration's own outcome (answers copied from an
    earlier trial and attempts cut short are left out: they say nothing new)."""
    return [
        r
        for r in records.records(study)
        if r.config and not r.answered and not (r.state == TrialState.FAIL and r.retry)
    ]


def roofline_share(r: TrialRecord) -> float | None:
    """The share of the card's memory bandwidth that streaming the weights takes at the measured
    per-user speed: with ``parallel`` streams, each decode step reads the weights once and gives
    each stream one token, so weights bytes x per-user tok/s is the bandwidth used (KV-cache
    reads left out: a lower bound). None where the GPU's bandwidth is not known, or nothing was
    measured on it (a twin trial, or a CPU study standing in for a card)."""
    bandwidth = (r.gpu or {}).get("mem_bandwidth_gb_s")
    weights = (r.predicted_vram or {}).get("weights_bytes")
    per_user = r.median("per_user_tok_s")
    if not bandwidth or not weights or per_user is None or r.measured_vram_bytes is None:
        return None
    return weights * per_user / (bandwidth * 1e9)


# ------------------------------------------------------------------ figures


def _knee(rows: list[TrialRecord], floor: float | None):
    """Aggregate and per-user tok/s against parallel, one line per backend, weights and cache."""
    from plotly.subplots import make_subplots

    best: dict[str, dict[int, TrialRecord]] = defaultdict(dict)
    for r in rows:
        if r.state != TrialState.COMPLETE or r.median("aggregate_tok_s") is None:
            continue
        c = dict(r.config or {})
        line = _label(c, ("backend", "weights", "cache_type"))
        held = best[line].get(c["parallel"])
        if held is None or r.median("aggregate_tok_s") > held.median("aggregate_tok_s"):  # type: ignore[operator]
            best[line][c["parallel"]] = r  # the best of its other knobs (ctx, flash_attn...)
    if not best:
        return None  # nothing measured: an empty log axis drew ticks from 0.125 to 524,288
    fig = make_subplots(rows=1, cols=2, subplot_titles=("aggregate tok/s", "per-user tok/s"))
    for i, (line, by_parallel) in enumerate(sorted(best.items())):
        xs = sorted(by_parallel)
        pts = [by_parallel[x] for x in xs]
        hover = [f"trial {p.number}<br>{html.escape(_options(dict(p.config or {})))}" for p in pts]
        for col, metric in ((1, "aggregate_tok_s"), (2, "per_user_tok_s")):
            fig.add_scatter(
                x=xs,
                y=[p.median(metric) for p in pts],
                mode="lines+markers",
                name=line,
                legendgroup=line,
                showlegend=col == 1,
                row=1,
                col=col,
                hovertext=hover,
                line={"color": _color(i)},
                error_y={
                    "type": "data",
                    "array": [(_spread(p, metric) or 0) * (p.median(metric) or 0) / 2 for p in pts],
                    "visible": True,
                },
            )
    if floor:
        fig.add_hline(
            y=floor,
            line_dash="dash",
            line_color="red",
            row=1,
            col=2,
            annotation_text=f"per-user floor {floor:g}",
            annotation_position="bottom right",
        )
    fig.update_xaxes(type="log", title_text="parallel streams", dtick=0.30103)
    fig.update_layout(
        title="Throughput against parallel streams (best of the other knobs at each point)",
        height=480,
        legend={"orientation": "h", "y": -0.25},
    )
    return fig


def _color(i: int) -> str:
    palette = (
        "#1f77b4",
        "#ff7f0e",
        "#2ca02c",
        "#d62728",
        "#9467bd",
        "#8c564b",
        "#e377c2",
        "#7f7f7f",
        "#bcbd22",
        "#17becf",
    )
    return palette[i % len(palette)]


def memory_unit(largest_bytes: float) -> tuple[str, int]:
    """The unit a memory axis reads in: MiB when every point is under 1 GiB (a small model's
    trials all sat at 0.0 on a GiB axis), else GiB."""
    return ("MiB", MIB) if largest_bytes < GIB else ("GiB", GIB)


def _vram(rows: list[TrialRecord], budget: int | None):
    """Throughput against memory: measured and predicted peak per trial, the budget line, and
    what was refused or infeasible, faded, with its reason. The axis spans the points, in MiB
    for a small model; a budget far beyond them is named in the title instead of drawn (a
    17 GiB line squeezed 40 MiB of trials against the axis). None when nothing was measured."""
    import plotly.graph_objects as go

    ok = [r for r in rows if r.state == TrialState.COMPLETE and r.feasible and r.median("aggregate_tok_s") is not None]
    if not ok:
        return None
    bad = [r for r in rows if r not in ok]
    every = [b for r in rows for b in (r.measured_vram_bytes, (r.predicted_vram or {}).get("total_bytes")) if b]
    unit, scale = memory_unit(max(every, default=0))
    fig = go.Figure()

    def scaled(n: float | None) -> float | None:
        return None if n is None else n / scale

    def hover(r: TrialRecord) -> str:
        tail = (
            ""
            if r in ok
            else "<br><b>"
            + html.escape(
                r.reason
                if r.state != TrialState.COMPLETE
                else "infeasible: " + ", ".join(k for k, v in r.constraints.items() if v > 0)
            )
            + "</b>"
        )
        return (
            f"trial {r.number} {html.escape(_label(dict(r.config or {}), ('backend', 'weights')))}<br>"
            f"{html.escape(_options(dict(r.config or {})))} parallel={(r.config or {}).get('parallel')}{tail}"
        )

    measured = [r for r in ok if r.measured_vram_bytes is not None]
    fig.add_scatter(
        x=[scaled(r.measured_vram_bytes) for r in measured],
        y=[r.median("aggregate_tok_s") for r in measured],
        mode="markers",
        name="measured peak",
        marker={"size": 9, "color": "#1f77b4"},
        hovertext=[hover(r) for r in measured],
        hoverinfo="text+x+y",
    )
    predicted = [r for r in ok if (r.predicted_vram or {}).get("total_bytes")]
    fig.add_scatter(
        x=[scaled(r.predicted_vram["total_bytes"]) for r in predicted],  # type: ignore[index]
        y=[r.median("aggregate_tok_s") for r in predicted],
        mode="markers",
        name="predicted",
        marker={"size": 9, "symbol": "circle-open", "color": "#ff7f0e"},
        hovertext=[hover(r) for r in predicted],
        hoverinfo="text+x+y",
    )
    shown_bad = [r for r in bad if (r.predicted_vram or {}).get("total_bytes") or r.measured_vram_bytes]
    fig.add_scatter(
        x=[scaled(r.measured_vram_bytes or r.predicted_vram["total_bytes"]) for r in shown_bad],  # type: ignore[index]
        y=[r.median("aggregate_tok_s") or 0.0 for r in shown_bad],
        mode="markers",
        name="pruned, failed or infeasible (0: not launched)",
        opacity=FADED,
        marker={"size": 8, "symbol": "x", "color": "#7f7f7f"},
        hovertext=[hover(r) for r in shown_bad],
        hoverinfo="text+x+y",
    )
    title = "Throughput against GPU memory (each point a trial)"
    if budget and budget <= 2 * max(every, default=0):
        fig.add_vline(
            x=budget / scale,
            line_dash="dash",
            line_color="red",
            annotation_text=f"budget {budget_text(budget)}",
            annotation_position="top left",
        )
    elif budget:
        title += f"; the budget, {budget_text(budget)}, lies far beyond them"
    fig.update_layout(title=title, height=480, xaxis_title=f"memory ({unit})", yaxis_title="aggregate tok/s")
    return fig


def _pareto(rows: list[TrialRecord], study: optuna.Study):
    """Throughput against quality drop, the non-dominated trials joined."""
    import plotly.graph_objects as go

    pts = [
        r
        for r in rows
        if r.state == TrialState.COMPLETE
        and r.quality_drop_points is not None
        and r.median("aggregate_tok_s") is not None
    ]
    if not pts:
        return None
    front = [
        r
        for r in pts
        if not any(
            o.median("aggregate_tok_s") >= r.median("aggregate_tok_s")
            and o.quality_drop_points <= r.quality_drop_points  # type: ignore[operator]
            and (
                o.median("aggregate_tok_s") > r.median("aggregate_tok_s")
                or o.quality_drop_points < r.quality_drop_points
            )  # type: ignore[operator]
            for o in pts
        )
    ]
    front.sort(key=lambda r: r.quality_drop_points)  # type: ignore[arg-type,return-value]
    fig = go.Figure()
    metric = metric_named((pts[0].quality or {}).get("metric"))
    fig.add_scatter(
        x=[metric.drop_figure(r.quality_drop_points) for r in pts],
        y=[r.median("aggregate_tok_s") for r in pts],
        mode="markers",  # type: ignore[arg-type]
        name="trials",
        opacity=0.5,
        hovertext=[
            f"trial {r.number} {html.escape(_label(dict(r.config or {}), ('backend', 'weights')))}" for r in pts
        ],
    )
    fig.add_scatter(
        x=[metric.drop_figure(r.quality_drop_points) for r in front],
        y=[r.median("aggregate_tok_s") for r in front],  # type: ignore[arg-type]
        mode="lines+markers",
        name="Pareto front",
        line={"color": "#d62728"},
        hovertext=[
            f"trial {r.number} {html.escape(_label(dict(r.config or {}), ('backend', 'weights')))}" for r in front
        ],
    )
    fig.update_layout(
        title="Throughput against quality drop (lower drop is better)",
        height=440,
        xaxis_title=metric.drop_label,
        yaxis_title="aggregate tok/s",
    )
    return fig


def _roofline(rows: list[TrialRecord]):
    import plotly.graph_objects as go

    pts = [(r, roofline_share(r)) for r in rows if r.state == TrialState.COMPLETE]
    pts = [(r, s) for r, s in pts if s is not None]
    if not pts:
        return None
    fig = go.Figure()
    fig.add_bar(
        x=[f"#{r.number}" for r, _ in pts],
        y=[100 * s for _, s in pts],
        hovertext=[
            html.escape(_label(dict(r.config or {}), ("backend", "weights", "parallel", "cache_type"))) for r, _ in pts
        ],
    )
    fig.update_layout(
        title="Share of the memory-bandwidth roofline (weights streamed per decode step)",
        height=400,
        xaxis_title="trial",
        yaxis_title="% of the card's bandwidth",
        xaxis={"type": "category"},
    )
    return fig


# ------------------------------------------------------------------ the page


def _table(rows: list[TrialRecord]) -> str:
    metric = metric_named(next(((r.quality or {}).get("metric") for r in rows if r.quality), None))
    head = [
        "trial",
        "state",
        "backend",
        "weights",
        "ctx",
        "parallel",
        "options",
        "aggregate tok/s",
        "spread",
        "per-user tok/s",
        "VRAM predicted GiB",
        "VRAM measured GiB",
        "score",
        metric.drop_label,
        "reason",
    ]
    out = [
        "<table id='trials' class='sortable'><thead><tr>"
        + "".join(f"<th>{h}</th>" for h in head)
        + "</tr></thead><tbody>"
    ]
    for r in rows:
        c = dict(r.config or {})
        spread = _spread(r, "aggregate_tok_s")
        cells = [
            r.number,
            r.state.name,
            c.get("backend"),
            Path(str(c.get("weights"))).name,
            c.get("ctx"),
            c.get("parallel"),
            _options(c),
            r.median("aggregate_tok_s"),
            None if spread is None else 100 * spread,
            r.median("per_user_tok_s"),
            _gib((r.predicted_vram or {}).get("total_bytes")),
            _gib(r.measured_vram_bytes),
            r.values[0] if r.values else None,
            None if r.quality_drop_points is None else metric.drop_figure(r.quality_drop_points),
            None
            if r.state == TrialState.COMPLETE and r.feasible
            else (
                r.reason
                if r.state != TrialState.COMPLETE
                else "infeasible: " + ", ".join(k for k, v in r.constraints.items() if v > 0)
            ),
        ]
        tds = []
        for v in cells[:-1]:
            sort = "" if not isinstance(v, (int, float)) or isinstance(v, bool) else f" data-sort='{v}'"
            tds.append(f"<td{sort}>{html.escape(_fmt(v, 2))}</td>")
        tds.append(f"<td class='reason'>{_collapsed(_fmt(cells[-1]))}</td>")
        out.append("<tr>" + "".join(tds) + "</tr>")
    out.append("</tbody></table>")
    return "\n".join(out)


def _collapsed(text: str) -> str:
    """A reason as HTML: whole when short, else its start with the rest behind a click (a
    converter's traceback in every row made a failed study's table 48,432 px tall)."""
    if len(text) <= 2 * SHOWN_CHARS + 20:
        return html.escape(text)
    return (
        f"<details><summary>{html.escape(text[:SHOWN_CHARS].rstrip())} ... "
        f"{html.escape(text[-SHOWN_CHARS:].lstrip())}</summary>{html.escape(text)}</details>"
    )


def _causes(rows: list[TrialRecord], summary: StudySummary) -> str:
    """Why trials failed or were not launched, the most common cause first, with counts and
    one example each: what a study with nothing to deploy must show before anything else."""
    groups: dict[tuple[str, str], list[TrialRecord]] = defaultdict(list)  # one cause: numbers, paths aside
    for r in rows:
        if r.state == TrialState.FAIL:
            groups[("failed", normalized(r.fail_reason or ""))].append(r)
        elif r.state == TrialState.PRUNED and r.prune_reason and not summary.best:
            groups[("not launched", normalized(r.prune_reason))].append(r)
    stop = summary.extra.get("systematic_failure")
    if not groups and not stop:
        return ""
    ranked = sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0]))
    items = "".join(
        f"<li><b>{len(found)} {how}: {html.escape(failure_kind(found[-1].reason))}</b> (trial{'s' if len(found) > 1 else ''} "
        f"{html.escape(', '.join(str(r.number) for r in found[:8]))}{', ...' if len(found) > 8 else ''})"
        f"<br>{_collapsed(found[-1].reason)}</li>"
        for (how, _), found in ranked[:6]
    )
    more = len(ranked) - 6
    head = (
        f"<p>Why the search ended: {_collapsed(str(summary.extra['stopped']))}</p>"
        if stop and summary.extra.get("stopped")
        else ""
    )
    return (
        f"<div class='card' id='causes'><h2>Why trials failed{' or were not launched' if not summary.best else ''}"
        f"</h2>{head}<ol>{items}</ol>"
        + (f"<p>and {more} other causes (the table below)</p>" if more > 0 else "")
        + "</div>"
    )


def _winner(summary: StudySummary) -> str:
    best = summary.best
    if not best:
        return "<div class='card'><h2>No feasible configuration measured yet</h2></div>"
    params = ", ".join(f"{k}={v}" for k, v in best["params"].items())
    parts = [f"<div class='card' id='winner'><h2>Winner: trial {best['number']}</h2><p>{html.escape(params)}</p>"]
    figures = headline_lines(best)
    spreads = best.get("spreads") or {}
    if len(figures) == 1 and spreads.get("aggregate_tok_s") is not None:  # one run: its own spread
        figures[0] += f", measured spread {100 * spreads['aggregate_tok_s']:.1f}%"
    parts += [f"<p>{html.escape(line)}</p>" for line in figures]
    if summary.extra.get("noise"):  # both spreads, named (study/noise.py)
        parts.append(f"<p id='noise'>{html.escape(summary.extra['noise']['text'])}</p>")
    baselines = summary.extra.get("baseline") or {}
    if baselines:  # what each engine chooses for itself (study/baseline.py): how much better than doing nothing
        items = "".join(
            f"<li><b>{html.escape(b['text'])}</b><br>weights {html.escape(str(b['weights']))}: "
            f"{html.escape(b['weights_why'])}; {html.escape(b['description'])}"
            f"<pre>{html.escape(b.get('deploy_command') or '')}</pre></li>"
            for b in baselines.values()
        )
        parts.append(
            f"<div id='baseline'><p>Against doing nothing (what each engine chooses for itself: its default "
            f"launch and, where it has one, its own fitting; each measured once before the search, not a "
            f"trial):</p><ul>{items}</ul></div>"
        )
    finish = summary.extra.get("finish")
    if finish:
        parts.append(f"<p>{html.escape(finish['text'])}</p>")
        if finish.get("contenders"):
            parts.append(
                "<ul>" + "".join(f"<li>{html.escape(contender_text(c))}</li>" for c in finish["contenders"]) + "</ul>"
            )
    if best.get("deploy_command"):
        parts.append(f"<p>deploy:</p><pre>{html.escape(best['deploy_command'])}</pre>")
    parts.append("</div>")
    return "\n".join(parts)


def _about(study: optuna.Study, rows: list[TrialRecord], summary: StudySummary) -> str:
    header = records.study_header(study)
    gpu = header.get("gpu") or next((r.gpu for r in rows if r.gpu), None) or {}
    engines = sorted(
        {
            f"{(r.engine or {}).get('backend')}: {(r.engine_facts or {}).get('engine_version') or (r.engine or {}).get('version')}"
            for r in rows
            if r.engine
        }
    )
    starts = [t.datetime_start for t in study.get_trials(deepcopy=False) if t.datetime_start]
    ends = [t.datetime_complete for t in study.get_trials(deepcopy=False) if t.datetime_complete]
    when = f"{min(starts):%Y-%m-%d %H:%M} to {max(ends or starts):%Y-%m-%d %H:%M}" if starts else "-"
    items = [
        ("study", f"{summary.study_name} ({summary.storage})"),
        ("trials", counts_text(summary)),
        # gpu = "cpu": the study's device is the host, named "CPU: ...", no GPU.
        (
            "device" if gpu.get("key") == CPU_KEY else "GPU",
            f"{gpu.get('name', '-')} ({gpu.get('key', '-')}, {_fmt(_gib(gpu.get('vram_bytes')))} GiB, "
            f"{gpu.get('mem_bandwidth_gb_s', '-')} GB/s)"
            if gpu
            else "-",
        ),
        ("model", str(header.get("model", "-"))),
        ("memory budget", budget_text(header.get("vram_budget_bytes"))),
        ("objective", objective_words(header.get("objective") or {})),
        ("study file", str(header.get("study_file", "-"))),
        ("engines", "; ".join(engines) or "-"),
        ("ran", when),
    ]
    return (
        "<table id='about'>" + "".join(f"<tr><th>{k}</th><td>{html.escape(v)}</td></tr>" for k, v in items) + "</table>"
    )


ABSENT = {  # what a plot with no point to draw says instead
    "knee": "throughput against parallel streams: no trial was measured",
    "vram": "throughput against memory: no feasible trial was measured",
    "pareto": "throughput against quality drop: no quality measured",
    "roofline": "roofline: no trial measured on a GPU of known bandwidth: the twin predicts, a CPU study has no card",
}


def render(study: optuna.Study, summary: StudySummary) -> str:
    """The report's HTML (one string, plotly.js inlined once)."""
    import plotly.offline

    rows = trial_rows(study)
    header = records.study_header(study)
    objective = header.get("objective") or {}
    figures = [
        ("knee", _knee(rows, objective.get("min_per_user_tok_s"))),
        ("vram", _vram(rows, header.get("vram_budget_bytes"))),
        ("pareto", _pareto(rows, study)),
        ("roofline", _roofline(rows)),
    ]
    plots = []
    for name, fig in figures:
        if fig is None:
            plots.append(f"<p class='absent' id='{name}-absent'>({ABSENT[name]})</p>")
            continue
        plots.append(
            fig.to_html(full_html=False, include_plotlyjs=False, div_id=f"plot-{name}", config={"displaylogo": False})
        )
    why = summary.extra.get("why") or []
    why_html = (
        (
            "<h2>Why not a neighbour (one value changed)</h2><ul>"
            + "".join(f"<li>{html.escape(line)}</li>" for line in why)
            + "</ul>"
        )
        if why
        else ""
    )
    generated = dt.datetime.now().strftime("%Y-%m-%d %H:%M")
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>autotune report: {html.escape(summary.study_name)}</title>
<style>{CSS}</style><script>{plotly.offline.get_plotlyjs()}</script></head>
<body><h1>autotune report: {html.escape(summary.study_name)}</h1>
{"" if summary.best else _causes(rows, summary)}
{_about(study, rows, summary)}
{_winner(summary)}
{_causes(rows, summary) if summary.best else ""}
{"".join(plots)}
{slo_section(rows, objective, (summary.best or {}).get("number"))}
{speculation_section(summary.extra)}
{why_html}
<h2>Every configuration's own trial ({len(rows)} of {summary.n_trials}: answers from storage and attempts
cut short left out; click a column to sort)</h2>
{_table(rows)}
<p><small>written by autotune on {generated}</small></p>
<script>{SORT_JS}</script>
</body></html>
"""


def write_report(study: optuna.Study, summary: StudySummary, out: Path) -> Path:
    """Write the report to ``out`` (its directory must exist) and return the path."""
    if not out.parent.is_dir():
        raise ConfigError(f"--out {out}: the directory {out.parent} does not exist")
    out.write_text(render(study, summary), encoding="utf-8")
    return out
