"""Running a node without the driver's control channel (executors that cannot reach the
driver process, as with some Spark Connect deployments).

The rendezvous then goes through Spark itself: every barrier task calls ``allGather`` exactly
once — node 0 with its store's port, every node with its GPUs, and with its DataFrame row
counts when there are any — and hands the result to its workers. Output is kept (bounded) and
returned with the outcomes, so the driver prints it at the end in rank order; a failure is
raised from the task with the failures encoded in its message, so Spark stops the other tasks
at once and the driver can still name the root cause with its traceback.

Non-goals: the connected path (``_agent`` and ``_channel``).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Mapping

from sparkdist._core.env import ROWS_PER_RANK_VAR
from sparkdist._wire import protocol


class DetachedRendezvous:
    """Collects what this node must contribute, then runs the one ``allGather``.

    Args:
        all_gather: the barrier task's ``allGather``.
        node_rank: this node's index (node 0 hosts the store).
        world_size: ranks in the run.
        expects_rows: the run reads a DataFrame: row counts are exchanged too.
        deliver: called with the rendezvous for the workers.
        fail: called with a reason when the rendezvous cannot complete.
        gpus: this task's GPUs (a comma list; empty on CPU), shared with its host-mates.
    """

    def __init__(
        self,
        all_gather: Callable[[str], list[str]],
        node_rank: int,
        world_size: int,
        expects_rows: bool,
        deliver: Callable[[protocol.Rendezvous], None],
        fail: Callable[[str], None],
        gpus: str = "",
    ) -> None:
        self._gpus = gpus
        self._all_gather = all_gather
        self._node_rank = node_rank
        self._world_size = world_size
        self._expects_rows = expects_rows
        self._deliver = deliver
        self._fail = fail
        self._port: int | None = None
        self._rows: dict[str, int] | None = None  # by global rank, as JSON keys it
        self._started = False
        self._lock = threading.Lock()

    def start(self) -> None:
        self._maybe_go()

    def on_store(self, port: int) -> None:
        with self._lock:
            self._port = port
        self._maybe_go()

    def on_rows(self, counts: Mapping[int, int]) -> None:
        with self._lock:
            self._rows = {str(rank): n for rank, n in counts.items()}
        self._maybe_go()

    def _maybe_go(self) -> None:
        with self._lock:
            ready = (self._node_rank != 0 or self._port is not None) and (
                not self._expects_rows or self._rows is not None
            )
            if self._started or not ready:
                return
            self._started = True
            mine = json.dumps(
                {
                    "node": self._node_rank,
                    "port": self._port,
                    "rows": self._rows or {},
                    "gpus": self._gpus,
                }
            )
        threading.Thread(
            target=self._exchange, args=(mine,), daemon=True, name="sparkdist-allgather"
        ).start()

    def _exchange(self, mine: str) -> None:
        try:
            gathered = [json.loads(item) for item in self._all_gather(mine)]
        except Exception as exc:  # the stage is being torn down
            self._fail(f"the barrier allGather failed: {exc}")
            return
        port = next((g["port"] for g in gathered if g["port"] is not None), None)
        env: dict[str, str] = {}
        if self._expects_rows:
            rows = {int(r): int(n) for g in gathered for r, n in g["rows"].items()}
            ordered = [rows.get(r, 0) for r in range(self._world_size)]
            if min(ordered) == 0:
                self._fail(f"some ranks got no rows of the DataFrame (rows per rank: {ordered})")
                return
            env[ROWS_PER_RANK_VAR] = json.dumps(ordered)
        if port is None:
            self._fail("node 0 published no store port")
            return
        task_gpus = {int(g["node"]): str(g["gpus"]) for g in gathered if g["gpus"]}
        self._deliver(protocol.Rendezvous(port, env, task_gpus))
