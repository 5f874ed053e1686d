"""One rank's process as its agent sees it: starting it, the handle kept on it, ending it.

A rank starts from the warm pool or cold (``pool.start_rank``) with its torchrun environment
and two private pipes: commands to it and notes from it (``worker``). Ending a rank ends its
process group, every descendant (one that called setsid included) and every process carrying
the rank's tag in its environment (``reaper``): SIGTERM, then SIGKILL after a short grace.
A rank is named by pid and start time, so a reused pid is never signalled. Before that SIGTERM
the rank's stop marker is written: the rank itself takes SIGTERM as a preemption notice unless
the marker says the signal is ours (``drain``).

Non-goals: what a rank does once started (``worker``); reading its output (``output``);
deciding when to end it (``agent``, ``watchdog``).
"""

from __future__ import annotations

import collections
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import IO

from sparkdist._core.env import (
    CTRL_IN_VAR,
    CTRL_OUT_VAR,
    DEEPSPEED_CONFIG_VAR,
    JOB_FILE_VAR,
    PARTITION_FILE_VAR,
    PYSPARK_PARTITION_FILE_VAR,
    PYSPARK_SCHEMA_FILE_VAR,
    RESULT_DIR_VAR,
    RUN_ID_VAR,
    START_TIMEOUT_VAR,
    TASK_VAR,
    RankSeat,
    worker_env,
)
from sparkdist._core.files import write_private_file
from sparkdist._core.run_dir import stop_marker_path
from sparkdist._node.agent.output import LAST_LINES
from sparkdist._node.agent.partition import partition_path, write_schema
from sparkdist._node.agent.spec import AgentSpec
from sparkdist._node.host.interfaces import NodeNetwork
from sparkdist._node.host.reaper import end_processes, start_time
from sparkdist._node.pool.pool import start_rank, warm
from sparkdist._node.pool.rank_process import RankProcess, StartStop
from sparkdist._shipping.code import put_code_first
from sparkdist._wire import protocol
from sparkdist._wire.protocol import Route

logger = logging.getLogger("sparkdist")


class RankHandle:
    """One spawned rank and what its agent knows of it (fields shared with the agent's threads)."""

    def __init__(
        self, seat: RankSeat, proc: RankProcess, ctrl_in: IO[bytes], notes: IO[bytes]
    ) -> None:
        self.seat = seat
        self.proc = proc
        # With the pid, names the process: a pid reused after it ended is never signalled.
        self.proc_started = start_time(proc.pid)
        self.ctrl_in = ctrl_in  # our write end of its command pipe; open until it exits
        self.notes = notes  # the read end of its notes pipe
        self.started = time.monotonic()
        self.ended: float | None = None
        self.ended_at = 0.0
        self.last_lines: collections.deque[str] = collections.deque(maxlen=LAST_LINES)
        self.threads: list[threading.Thread] = []
        self.killed = False
        self.last_beat: float | None = None  # monotonic; set when it joins, then per beat
        self.last_beat_wall = 0.0
        self.hung_for_s: float | None = None
        self.stop_marker = ""  # its ``drain.stop_marker_path``, once spawned
        self.done_at: float | None = None  # monotonic; when it said its outcome is written
        self.done_code = 0  # the exit code it said it exits with then
        self.ended_after_done = False  # we ended it: it did not exit after its outcome

    def tell(self, message: protocol.Message) -> None:
        """Send ``message`` down the rank's command pipe (nothing if it already exited)."""
        try:
            self.ctrl_in.write(protocol.encode(message, Route.WORKER) + b"\n")
            self.ctrl_in.flush()
        except (OSError, ValueError):
            pass  # it already exited; its waiter reports that

    def mark_stopping(self) -> None:
        """Say, before the first signal of our stop, that it is ours: the rank takes SIGTERM
        as a preemption notice otherwise (``drain``)."""
        if self.stop_marker:
            try:
                with open(self.stop_marker, "x"):
                    pass
            except OSError:
                pass  # there already, or the run directory is gone (so is the rank)

    def done(self, code: int) -> None:
        """Record its ``Done``: its outcome is written, it exits with ``code``."""
        self.done_code, self.done_at = code, time.monotonic()

    def exit_code(self) -> int | None:
        """Its exit code: the one it announced if we ended it after its outcome was written
        (``watchdog``), else its process's own (None while it runs)."""
        code = self.proc.returncode
        return self.done_code if code is not None and self.ended_after_done else code

    def heard_from(self) -> None:
        """Record a sign of life (joined, a beat, a report) for the hang watchdog."""
        self.last_beat, self.last_beat_wall = time.monotonic(), time.time()

    def was_stopped(self, code: int | None) -> bool:
        """Whether ``code`` is our stop (SIGTERM, or the SIGKILL after it), not its own death."""
        return self.killed and code in (-signal.SIGTERM, -signal.SIGKILL)


def close_command_pipe(pipe: IO[bytes]) -> None:
    """Close our end of an exited rank's command pipe.

    A rank that died just as a command went to it (the rendezvous, to a rank that failed to
    unpickle its job) leaves that command in the buffer (``tell`` ignored the broken pipe), and
    ``close`` flushes it again: a ``BrokenPipeError`` that is no failure of the agent's (the
    descriptor is closed all the same). Raised, it ended the agent before its goodbye, and the
    driver took the node for lost instead of reporting the rank's own error.
    """
    try:
        pipe.close()
    except OSError:
        pass


def node_extra_env(spec: AgentSpec, run_dir: str) -> dict[str, str]:
    """What every rank of the node adds to its environment; writes the DeepSpeed config and the
    DataFrame's schema (if any) into ``run_dir`` for them."""
    extra = dict(spec.extra_env)
    if spec.deepspeed_config_json is not None:
        config_path = os.path.join(run_dir, "deepspeed_config.json")
        write_private_file(config_path, spec.deepspeed_config_json.encode())
        extra[DEEPSPEED_CONFIG_VAR] = config_path
    if spec.dataframe_schema_json is not None:
        extra[PYSPARK_SCHEMA_FILE_VAR] = write_schema(run_dir, spec.dataframe_schema_json)
    return extra


def warm_pool(run_env: Mapping[str, str]) -> None:
    """Start, in the background, the zygote this process would fork the ranks of a run whose
    variables are ``run_env`` (its spec's ``extra_env``) from (``pool.warm``), and no rank: for
    an executor a restart of the run may land on.

    A zygote's key reads only the import-time variables and whether the run checkpoints: the
    agent's environment and the run's variables decide both, as in ``spawn_rank``."""
    warm({**os.environ, **run_env})


def spawn_rank(
    spec: AgentSpec,
    seat: RankSeat,
    *,
    run_dir: str,
    job_file: str,
    code_dir: str | None,
    extra_env: Mapping[str, str],
    expects_data: bool,
    network: NodeNetwork | None = None,
    stop: StartStop | None = None,
) -> RankHandle:
    """Start the rank at ``seat`` (warm pool or cold) and return its handle.

    ``network`` is what the agent decided of this node's network (``interfaces``): the
    ``MASTER_ADDR`` as an address and the interface gloo and NCCL use; without it, the spec's
    master as given and no interface.

    Raises:
        StartStopped: ``stop`` (the agent's) came while the start waited; nothing started.
    """
    network = network or NodeNetwork(spec.master_addr)
    env = worker_env(
        os.environ,
        seat,
        master_addr=network.master_addr,
        run_id=spec.run_id,
        restart_count=spec.restart_count,
        max_restarts=spec.max_restarts,
        cuda_visible_devices=spec.gpu_addresses,
        mode=spec.mode,
        host=spec.host,
        extra=extra_env,
        socket_ifname=network.interface,
    )
    cmd_read, cmd_write = os.pipe()
    note_read, note_write = os.pipe()
    env[CTRL_IN_VAR] = str(cmd_read)
    env[CTRL_OUT_VAR] = str(note_write)
    env[JOB_FILE_VAR] = job_file
    env[RESULT_DIR_VAR] = run_dir
    env[START_TIMEOUT_VAR] = str(spec.start_timeout_s)
    put_code_first(env, code_dir)
    if expects_data:
        # One file, two readers: sparkdist.data and pyspark's partition loader.
        env[PARTITION_FILE_VAR] = env[PYSPARK_PARTITION_FILE_VAR] = partition_path(
            run_dir, seat.rank
        )
    try:
        proc = start_rank(env, (cmd_read, note_write), shipped_code=code_dir, stop=stop)
    except BaseException:
        for fd in (cmd_write, note_read):
            os.close(fd)
        raise
    finally:
        # The rank holds its own copies of these ends now (or never will).
        os.close(cmd_read)
        os.close(note_write)
    handle = RankHandle(seat, proc, os.fdopen(cmd_write, "wb"), os.fdopen(note_read, "rb"))
    handle.stop_marker = stop_marker_path(run_dir, seat.rank)
    return handle


def node_tag(spec: AgentSpec, rank: int | None = None) -> dict[str, str]:
    """What this node's (or one rank's) processes carry in their environment."""
    tag = {
        RUN_ID_VAR: spec.run_id,
        TASK_VAR: str(spec.node_rank),  # not GROUP_RANK: a host's tasks share that
        "TORCHELASTIC_RESTART_COUNT": str(spec.restart_count),
    }
    if rank is not None:
        tag["RANK"] = str(rank)
    return tag


def wait_for_exit(
    rank: RankHandle, spec: AgentSpec, on_exit: Callable[[RankHandle, int], None]
) -> None:
    """Wait for the rank to exit, call ``on_exit(rank, code)``, then end its strays.

    Runs on a thread of its own per rank.
    """
    rank.proc.wait()
    code = rank.exit_code()
    assert code is not None  # it exited
    rank.ended = time.monotonic()
    rank.ended_at = time.time()
    on_exit(rank, code)
    # Strays the rank left behind (its children, daemons it started) go with it; here, not
    # on the watching thread, so their grace never delays a failure report.
    end_processes({rank.proc.pid: rank.proc_started}, tag=node_tag(spec, rank.seat.rank))


def end_ranks(ranks: Sequence[RankHandle], spec: AgentSpec) -> None:
    """End ``ranks`` and everything they started (``reaper``); return once they are gone."""
    for rank in ranks:
        if rank.ended is None:
            rank.killed = True
            rank.mark_stopping()
    if not ranks:
        return
    survivors = end_processes({r.proc.pid: r.proc_started for r in ranks}, tag=node_tag(spec))
    if survivors:
        logger.warning(
            "sparkdist: process(es) %s of run %s outlived SIGKILL (stuck in the kernel?)",
            survivors,
            spec.run_id,
        )
