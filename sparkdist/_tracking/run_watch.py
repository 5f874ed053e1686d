"""What the driver learns of a launch besides its metrics: every rank's steps (for the timeline,
the step rates on the progress line and straggler detection) and every node's system samples.

One ``RunWatch`` per launch, fed by the tracker on the control channel's reader threads (so
each call is cheap: a straggler check runs at most once a second). It keeps the current
attempt only: a restart starts the timeline and the rates afresh.

Non-goals: the straggler rule itself (``_core.stragglers``), drawing or logging (the tracker,
``progress``, ``mlflow_run``).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Mapping, Sequence

from sparkdist._core.launch.config import LaunchConfig
from sparkdist._core.launch.numbering import known_task_hosts, task_of_rank
from sparkdist._core.launch.placement import Placement
from sparkdist._core.run.result import RankTimeline, SystemSample
from sparkdist._core.run.stragglers import RateSpread, StragglerEvent, StragglerWatch, Straggling
from sparkdist._wire.payload import Outcome
from sparkdist._wire.protocol import Report, Sample


def spawn_timeline(outcomes: Sequence[Outcome], node_of: Mapping[int, int]) -> list[RankTimeline]:
    """Each rank's spawn and exit as its agent saw them (``RunWatch.timeline`` adds its steps);
    ``node_of`` maps a rank to the node (task) that ran it."""
    return [
        RankTimeline(o.rank, node_of[o.rank], o.host, o.ended_at - o.wall_time_s, o.ended_at)
        for o in outcomes
    ]


#: Samples kept for ``RunResult`` (the oldest go first): a week of one node at 10 s, or a
#: day of seven.
MAX_KEPT_SAMPLES = 60_000


class RunWatch:
    """Per-rank steps and per-node samples of one launch (see the module docstring)."""

    def __init__(self, config: LaunchConfig, placement: Placement) -> None:
        self._config = config
        self._placement = placement
        self._lock = threading.Lock()
        self.samples: list[SystemSample] = []
        self._node_gpus: dict[int, list[str]] = {}  # from the nodes' samples
        self._sample_steps: dict[int, int] = {}
        self.new_attempt()

    def new_attempt(self) -> None:
        """A (re)start: every rank's steps count from nothing again."""
        with self._lock:
            self._stragglers = StragglerWatch(
                self._config.straggler_fraction, self._config.straggler_window_s
            )
            self._reports: dict[int, int] = {}
            self._steps: dict[int, tuple[float, float, int]] = {}  # rank: first, last, step

    def report(self, message: Report) -> tuple[list[StragglerEvent], RateSpread | None] | None:
        """A rank's report; when a straggler check ran, its episodes and the rates' spread."""
        wall, now = time.time(), time.monotonic()
        rank = message.rank
        with self._lock:
            count = self._reports[rank] = self._reports.get(rank, 0) + 1
            step = message.step if message.step is not None else count
            first = self._steps[rank][0] if rank in self._steps else wall
            self._steps[rank] = (first, wall, step)
            watch = self._stragglers
            watch.observe(rank, step, now)
            if not watch.due(now):
                return None
            return watch.check(now), watch.spread

    def sample(self, message: Sample, host: str) -> tuple[int, SystemSample]:
        """A node's sample: its index among the node's samples, and the record kept."""
        record = SystemSample(message.node, host, message.time, dict(message.metrics))
        with self._lock:
            index = self._sample_steps[message.node] = self._sample_steps.get(message.node, -1) + 1
            if message.gpus:
                self._node_gpus[message.node] = message.gpus.split(",")
            if len(self.samples) >= MAX_KEPT_SAMPLES:
                del self.samples[: MAX_KEPT_SAMPLES // 10]
            self.samples.append(record)
        return index, record

    def where(self, rank: int, node_hosts: Mapping[int, str]) -> str:
        """Where ``rank`` runs, in words: its node, host and GPU (as far as known)."""
        hosts = known_task_hosts(node_hosts, self._placement.num_tasks)
        node, local_rank = task_of_rank(rank, hosts, self._placement.processes_per_task)
        host = node_hosts.get(node)
        place = f"node {node}" + (f" on {host}" if host else "")
        if not self._placement.use_gpu:
            return f"{place}, CPU"
        gpus = list(self._placement.driver_gpus) or self._node_gpus.get(node, [])
        if local_rank < len(gpus):
            return f"{place}, GPU {gpus[local_rank]}"
        return f"{place}, its local rank {local_rank}'s GPU"

    def straggler_line(self, event: Straggling, node_hosts: Mapping[int, str]) -> str:
        """The warning (and MLflow tag) naming a straggler."""
        behind_s = time.monotonic() - event.since
        return (
            f"rank {event.rank} ({self.where(event.rank, node_hosts)}) is a straggler: "
            f"{event.rate:.3g} steps/s for {behind_s:.0f} s, below "
            f"{self._config.straggler_fraction:g} of the median rank's {event.median:.3g} "
            "steps/s"
        )

    def timeline(self, spawned: list[RankTimeline]) -> list[RankTimeline]:
        """``spawned`` (spawn and exit, by rank) with the steps seen added."""
        with self._lock:
            steps = dict(self._steps)
        return [
            dataclasses.replace(t, first_step_at=s[0], last_step_at=s[1], steps=s[2])
            if (s := steps.get(t.rank)) is not None
            else t
            for t in spawned
        ]
