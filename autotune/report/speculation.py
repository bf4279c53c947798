"""The report's speculation section: speculative decoding's gain against parallel slots, one
point per slot count (the best speculation the study measured there over the same configuration
without it), with the break-even line, and the summary's verdict of when it loses.

A section of its own beside ``report_html`` (which calls :func:`speculation_section`), as the
latency section is; what it shows is in docs/usage.md ("Reading speculation's gain against slots").
"""

from __future__ import annotations

import html
from typing import Any, Mapping

__all__ = ["speculation_figure", "speculation_section"]


def speculation_figure(found: Mapping[str, Any]):
    """Gain (x, log) against parallel slots, hover naming the speculation and both trials."""
    import plotly.graph_objects as go

    slots = found["slots"]
    hover = [
        f"x{g['gain']:.2f}: {g['with_tok_s']:.1f} vs {g['without_tok_s']:.1f} tok/s<br>"
        f"{html.escape(', '.join(f'{k}={v}' for k, v in g['speculation'].items()))}<br>"
        f"trials {g['trial']} vs {g['baseline_trial']}"
        for g in slots
    ]
    fig = go.Figure()
    fig.add_scatter(
        x=[g["parallel"] for g in slots],
        y=[g["gain"] for g in slots],
        mode="lines+markers",
        name="best speculation / none",
        hovertext=hover,
    )
    fig.add_hline(
        y=1.0, line_dash="dash", line_color="red", annotation_text="break-even", annotation_position="bottom right"
    )
    fig.update_xaxes(type="log", title_text="parallel slots", dtick=0.30103)
    fig.update_yaxes(type="log", title_text="aggregate tok/s, with / without")
    fig.update_layout(title="Speculative decoding's gain against slots (same other values)", height=420)
    return fig


def speculation_section(extra: Mapping[str, Any]) -> str:
    """The section's HTML ('' for a study without speculation measured both ways)."""
    found = extra.get("speculation_gain")
    if not found:
        return ""
    fig = speculation_figure(found)
    plot = fig.to_html(
        full_html=False, include_plotlyjs=False, div_id="plot-speculation", config={"displaylogo": False}
    )
    return (
        f"<div class='card' id='speculation'><h2>Speculative decoding against slots</h2>"
        f"<p>{html.escape(found['verdict'] or '')}</p>{plot}</div>"
    )
