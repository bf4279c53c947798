"""The report's latency section (a study with latency targets): latency against throughput per
configuration with the target lines, the goodput winner, and what the targets cost.

A section of its own beside ``report_html`` (which calls :func:`slo_section`), so that the
report's layout and this plot change apart. What it shows is in docs/workload.md and
docs/report.md.
"""

from __future__ import annotations

import html
from collections.abc import Mapping, Sequence
from typing import Any

from autotune.study.records import TrialRecord, TrialState

__all__ = ["slo_cost", "slo_section"]

_QUANTITIES = (("ttft", "TTFT"), ("itl", "ITL"), ("e2e", "E2E"))


def _within_other_constraints(r: TrialRecord) -> bool:
    """Feasible if the latency targets were dropped: every constraint but theirs met."""
    return all(v <= 0 for k, v in r.constraints.items() if not k.startswith("slo_"))


def slo_cost(rows: Sequence[TrialRecord], metric: str, best: int | None = None) -> dict[str, Any] | None:
    """The goodput winner (the summary's ``best``, else the feasible trial of the best
    ``metric``) and the best
    aggregate throughput with the latency targets left out (every other constraint still
    met), and what the targets cost in aggregate tok/s. None when nothing was measured."""
    done = [r for r in rows if r.state == TrialState.COMPLETE and r.median("aggregate_tok_s") is not None]
    free = [r for r in done if _within_other_constraints(r)]
    if not free:
        return None
    fastest = max(free, key=lambda r: r.median("aggregate_tok_s") or 0.0)
    feasible = [r for r in done if r.feasible and r.median(metric) is not None]
    winner = next((r for r in feasible if r.number == best), None) or (
        max(feasible, key=lambda r: r.median(metric) or 0.0) if feasible else None
    )
    out: dict[str, Any] = {
        "fastest": fastest.number,
        "fastest_tok_s": fastest.median("aggregate_tok_s"),
        "fastest_missed": sorted(
            k.removeprefix("slo_") for k, v in fastest.constraints.items() if k.startswith("slo_") and v > 0
        ),
        "winner": None if winner is None else winner.number,
    }
    if winner is not None:
        agg = winner.median("aggregate_tok_s") or 0.0
        out.update(
            winner_tok_s=agg,
            winner_value=winner.median(metric),
            cost=1 - agg / out["fastest_tok_s"] if out["fastest_tok_s"] else 0.0,
        )
    return out


def _figure(rows: Sequence[TrialRecord], slo: Mapping[str, float], cost: Mapping[str, Any]):
    from plotly.subplots import make_subplots

    shown = [(q, label) for q, label in _QUANTITIES if any(k.startswith(q + "_") for k in slo)] or [("ttft", "TTFT")]
    fig = make_subplots(rows=1, cols=len(shown), subplot_titles=[f"{label} (ms)" for _, label in shown])
    done = [r for r in rows if r.state == TrialState.COMPLETE and r.median("aggregate_tok_s") is not None]
    for col, (q, label) in enumerate(shown, 1):
        percentiles = sorted({int(k.split("_p")[1].split("_")[0]) for k in slo if k.startswith(q + "_")}) or [95]
        for p in percentiles:
            key = f"{q}_p{p}_ms"
            for ok in (True, False):
                pts = [r for r in done if r.feasible == ok and r.median(key) is not None]
                if not pts:
                    continue
                fig.add_scatter(
                    x=[r.median("aggregate_tok_s") for r in pts],
                    y=[r.median(key) for r in pts],
                    mode="markers",
                    name=f"{label} p{p}, {'within every target' if ok else 'infeasible'}",
                    opacity=1.0 if ok else 0.35,
                    row=1,
                    col=col,
                    hovertext=[f"trial {r.number}<br>{html.escape(_config(r))}" for r in pts],
                )
            if key in slo:
                fig.add_hline(
                    y=slo[key],
                    line_dash="dash",
                    line_color="red",
                    row=1,
                    col=col,
                    annotation_text=f"target p{p} {slo[key]:g} ms",
                    annotation_position="top left",
                )
        for number, symbol, name in (
            (cost.get("winner"), "star", "goodput winner"),
            (cost.get("fastest"), "x", "best throughput without the targets"),
        ):
            r = next((r for r in done if r.number == number), None)
            key = f"{q}_p{percentiles[-1]}_ms"
            if r is not None and r.median(key) is not None:
                fig.add_scatter(
                    x=[r.median("aggregate_tok_s")],
                    y=[r.median(key)],
                    mode="markers",
                    marker={"symbol": symbol, "size": 16, "color": "black"},
                    name=name,
                    showlegend=col == 1,
                    row=1,
                    col=col,
                    hovertext=[f"trial {r.number}"],
                )
    fig.update_xaxes(title_text="aggregate tok/s")
    fig.update_layout(
        title="Latency against throughput, per configuration (medians of its runs)",
        height=480,
        legend={"orientation": "h", "y": -0.25},
    )
    return fig


def _config(r: TrialRecord) -> str:
    return ", ".join(f"{k}={v}" for k, v in (r.config or {}).items())


def slo_section(rows: Sequence[TrialRecord], objective: Mapping[str, Any], best: int | None = None) -> str:
    """The section's HTML (its plot without plotly.js, which the report inlines once); empty for
    a study without latency targets."""
    slo = {str(k): float(v) for k, v in objective.get("slo") or ()}
    if not slo:
        return ""
    metric = str(objective.get("metric", "goodput_tok_s"))
    cost = slo_cost(rows, metric, best)
    if cost is None:
        return "<p class='absent' id='slo-absent'>(latency: no trial measured yet)</p>"
    if cost["winner"] is None:
        text = (
            f"No configuration met every target. The best throughput without them: trial {cost['fastest']}, "
            f"{cost['fastest_tok_s']:.1f} tok/s aggregate."
        )
    else:
        missed = ", ".join(cost["fastest_missed"])
        text = (
            f"Winner under the targets (by {metric}): trial {cost['winner']}, {cost['winner_value']:.2f} "
            f"({cost['winner_tok_s']:.1f} tok/s aggregate). Best throughput without the targets: trial "
            f"{cost['fastest']}, {cost['fastest_tok_s']:.1f} tok/s"
            + (f" (misses {missed})" if missed else "")
            + f". What the targets cost: {100 * cost['cost']:.1f}% of the aggregate throughput."
        )
    plot = _figure(rows, slo, cost).to_html(
        full_html=False, include_plotlyjs=False, div_id="plot-slo", config={"displaylogo": False}
    )
    return f"<div id='slo'><h2>Latency targets</h2><p id='slo-cost'>{html.escape(text)}</p>{plot}</div>"
