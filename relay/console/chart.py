"""A line chart of one series as inline SVG, drawn on the server: no script, no library."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

WIDTH, HEIGHT, PAD = 600, 120, 4


@dataclass(frozen=True)
class Chart:
    points: str  # the polyline's "x,y x,y ..." in the viewBox
    top: float  # the value at the top edge
    last: float | None
    span_s: float  # seconds from the first sample to the last
    count: int
    width: int = WIDTH
    height: int = HEIGHT


def line_chart(series: Sequence[tuple[datetime, float]]) -> Chart:
    """``series`` (time, value), oldest first, scaled into the chart; the top is the
    largest value (at least 1), the left edge the first sample."""
    if not series:
        return Chart(points="", top=1.0, last=None, span_s=0.0, count=0)
    start, end = series[0][0], series[-1][0]
    span = max((end - start).total_seconds(), 1e-9)
    top = max(1.0, max(v for _, v in series))
    inner_w, inner_h = WIDTH - 2 * PAD, HEIGHT - 2 * PAD
    coords = []
    for at, value in series:
        x = PAD + inner_w * ((at - start).total_seconds() / span if len(series) > 1 else 1.0)
        y = PAD + inner_h * (1 - value / top)
        coords.append(f"{x:.1f},{y:.1f}")
    return Chart(
        points=" ".join(coords), top=top, last=series[-1][1], span_s=(end - start).total_seconds(), count=len(series)
    )
