"""``goodput.py --plot``: each lab run's world size and steps per second over time, the faults
marked, one column per run, in one PNG (matplotlib, an optional extra: ``pip install
matplotlib``; MLflow brings it too).

Drawn from the records' ``timeline`` (every step rank 0 executed: start, end, world) and
``strikes_s``. Steps per second is a moving count over ``WINDOW_S`` of the steps that ended,
repeats after a restart included (what the cluster did, not what counted: the table's
goodput says that).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

#: The moving window of the steps-per-second line.
WINDOW_S = 5.0


def plot(records: list[dict[str, Any]], machine: dict[str, Any], path: Path) -> None:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install matplotlib") from None
    drawn = [r for r in records if r.get("timeline")]
    if not drawn:
        raise SystemExit("--plot: no lab run has steps to draw (run with --lab)")
    figure = Figure(figsize=(4.6 * len(drawn), 4.6), dpi=90)
    FigureCanvasAgg(figure)
    axes = figure.subplots(2, len(drawn), squeeze=False, sharex="col", height_ratios=[1, 2])
    for column, record in enumerate(drawn):
        worlds_ax, rate_ax = axes[0][column], axes[1][column]
        steps = sorted(record["timeline"], key=lambda s: s[1])
        ends = [end for _, end, _ in steps]
        worlds_ax.step(ends, [w for _, _, w in steps], where="post", color="tab:blue")
        worlds_ax.set_ylim(0, max(w for _, _, w in steps) + 1)
        worlds_ax.set_title(
            f"{record['schedule']}\ngoodput {record['goodput']}, {record['faults']} faults",
            fontsize=9,
        )
        rates = [sum(1 for e in ends if t - WINDOW_S < e <= t) / WINDOW_S for t in ends]
        rate_ax.plot(ends, rates, color="tab:green", linewidth=1.2)
        rate_ax.set_ylim(bottom=0)
        for strike in record["strikes_s"]:
            for ax in (worlds_ax, rate_ax):
                ax.axvline(strike, color="tab:red", linestyle="--", linewidth=0.9)
        rate_ax.set_xlabel("seconds since the launch (red: a host killed)")
        if column == 0:
            worlds_ax.set_ylabel("ranks")
            rate_ax.set_ylabel(f"steps/s ({WINDOW_S:g} s window)")
    figure.suptitle(
        f"host killed and brought back every ~{machine.get('lab_interval_s', '?')} s "
        f"(load before {machine.get('loadavg_before', '?')})",
        fontsize=10,
    )
    figure.tight_layout()
    figure.savefig(str(path), format="png")
