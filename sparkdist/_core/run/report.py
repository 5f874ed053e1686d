"""A run's report as a small PNG: each rank's timeline, and every node's system samples.

Drawn with matplotlib's object API on an Agg canvas (no pyplot, no global backend switch, safe
on any thread); matplotlib is imported only here, when a report is asked for.

Non-goals: collecting the data (``RunResult``), logging the file (``_tracking``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sparkdist._core.errors import ConfigError

if TYPE_CHECKING:
    from sparkdist._core.run.result import RunResult

#: Most ranks drawn one bar each; a larger world draws the first ones and says so.
MAX_DRAWN_RANKS = 64
_WIDTH_IN, _DPI = 9.0, 80


def render_report(result: RunResult, path: str) -> str:
    """Write ``result``'s report to ``path`` (PNG) and return the path.

    Raises:
        ConfigError: matplotlib is not installed.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ConfigError(
            "drawing a run report needs matplotlib: pip install matplotlib (it comes with mlflow)"
        ) from exc
    samples = result.system_samples
    panels = 1 + (2 if samples else 0)
    ranks = result.timeline[:MAX_DRAWN_RANKS]
    timeline_in = max(1.8, 0.6 + 0.22 * len(ranks))  # room for the title and the axis
    figure = Figure(figsize=(_WIDTH_IN, timeline_in + 2.2 * (panels - 1)), dpi=_DPI)
    FigureCanvasAgg(figure)
    axes = figure.subplots(
        panels, 1, squeeze=False, sharex=True, height_ratios=[timeline_in] + [2.2] * (panels - 1)
    )[:, 0]
    starts = [t.started_at for t in ranks] + [s.time for s in samples]
    origin = min(starts) if starts else 0.0
    _draw_timeline(axes[0], result, origin)
    if samples:
        _draw_samples(axes[1], axes[2], result, origin)
    axes[-1].set_xlabel("seconds since the first rank started")
    figure.suptitle(f"sparkdist run {result.run_id}: {result.world_size} rank(s), {result.mode}")
    figure.tight_layout()
    figure.savefig(path, format="png")
    return path


def _draw_timeline(ax: Any, result: RunResult, origin: float) -> None:
    ranks = result.timeline[:MAX_DRAWN_RANKS]
    for t in ranks:
        y = t.rank
        first = t.first_step_at if t.first_step_at is not None else t.ended_at
        last = t.last_step_at if t.last_step_at is not None else first
        pieces = [
            (t.started_at, first, "#c8c8c8"),  # start-up: spawn to the first step
            (first, last, "#1f77b4"),  # training: first to last step
            (last, max(t.ended_at, last), "#e0b080"),  # wind-down: last step to exit
        ]
        for begin, end, colour in pieces:
            if end > begin:
                ax.broken_barh([(begin - origin, end - begin)], (y - 0.4, 0.8), color=colour)
    ax.set_yticks([t.rank for t in ranks])
    ax.set_yticklabels([f"rank {t.rank}" for t in ranks], fontsize=7)
    ax.invert_yaxis()
    more = len(result.timeline) - len(ranks)
    ax.set_title(
        "ranks: start-up (grey), steps (blue), wind-down (tan)"
        + (f"; {more} more rank(s) not drawn" if more > 0 else ""),
        fontsize=9,
    )


def _draw_samples(cpu_ax: Any, memory_ax: Any, result: RunResult, origin: float) -> None:
    for node in sorted({s.node for s in result.system_samples}):
        # name -> (times, values): a metric missing from a sample is a gap, not a shift.
        series: dict[str, tuple[list[float], list[float]]] = {}
        for sample in result.system_samples:
            if sample.node == node:
                for name, value in sample.metrics.items():
                    times, values = series.setdefault(name, ([], []))
                    times.append(sample.time - origin)
                    values.append(value)
        lines = [(cpu_ax, "cpu_utilization_percentage", "CPU", "-")]
        lines += [
            (cpu_ax, name, name.removesuffix("_utilization_percentage"), "--")
            for name in sorted(series)
            if name.startswith("gpu_") and name.endswith("_utilization_percentage")
        ]
        lines += [
            (memory_ax, "system_memory_usage_megabytes", "host", "-"),
            (memory_ax, "ranks_memory_rss_megabytes", "ranks (RSS)", "--"),
        ]
        for ax, name, label, style in lines:
            if name in series:
                times, values = series[name]
                ax.plot(times, values, style, marker=".", label=f"node {node} {label}")
    cpu_ax.set_ylabel("utilisation %")
    memory_ax.set_ylabel("memory MB")
    for ax in (cpu_ax, memory_ax):
        ax.set_ylim(bottom=0)
        if ax.get_lines():
            ax.legend(fontsize=7, loc="upper left")
