"""Goodput under faults: how much of the wall time a training run spends in steps that count,
when a rank (local) or a host (lab) is lost every ``--interval-s`` seconds.

One training function (``train``) runs everywhere: ``--steps`` steps of a small DDP model over
gloo, each step padded with a sleep to ``--step-s`` (the step's compute, simulated so the
figures do not depend on who else uses the cores), and a ``--state-mb`` checkpoint (the model
and a ballast tensor) every ``--checkpoint-every`` steps. Rank 0 appends ``(attempt, step,
start, end)`` for every step it finishes to ``steps.log`` in the run's directory; every rank
notes its pid at entry, which is how the faults find it. Variants:

- ``sparkdist periodic``: ``Distributor(2, use_gpu=False, max_restarts=1000,
  checkpoint_dir=...)``, ``runtime.save_checkpoint(state, step)`` every P steps;
- ``sparkdist async+drain``: the same with ``async_=True``, and ``runtime.should_stop()`` every
  step (on a notice: save that step, return; sparkdist restarts without using max_restarts);
- ``pyspark``: ``TorchDistributor(num_processes=2, local_mode=True, use_gpu=False)``, which has
  no restarts: the user's own loop catches the error and launches again, and rank 0
  ``torch.save``s the state every P steps and every rank loads it at start (user code, here
  ``run_pyspark``).

Fault schedules (the same for every variant; the first fault ``--interval-s`` after the
launch, each next one ``--interval-s`` after the previous struck; a fault that finds no rank
running waits for the next one to start): ``none``; ``crash`` (SIGKILL to rank 1); ``preempt``
(SIGTERM to rank 1: a preemption notice). With ``--lab``, in the multi-host lab (3 hosts, one
executor core each, 2 ranks, ``min_processes=1``): ``host-kill`` (every process of rank 1's
host SIGKILLed, then the host brought back) and ``host-sigterm`` (SIGTERM to rank 1's executor
JVM, as YARN or Kubernetes send; that run's driver sets ``spark.python.task.killTimeout=30s``,
see docs/restarts.md); each lab run has a driver application of its own.

Figures per run: ``goodput`` (sum of the durations of the steps that count, i.e. the last
execution of each step index, over the wall time from the first launch to the result),
``lost_per_fault`` ((steps executed - steps) / faults), ``restarts`` (sparkdist's),
``relaunches`` (by user code), ``recovery_s`` (median, from a fault to the first step of the
next attempt). A run still going at ``--cap-s`` is stopped and reported ``unfinished``; then only
steps its last checkpoint covers count.

Usage (see benchmarks/README.md)::

    python benchmarks/goodput.py --quick             # smoke test (~3 min)
    python benchmarks/goodput.py --out goodput.json  # local mode, every variant and schedule
    python benchmarks/goodput.py --lab               # plus the lab (needs root or user namespaces)

Non-goals: GPUs, real models (the step is a sleep), Spark's own task retries (barrier stages
have none).
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _harness import Bench, append_records, classic_session, emit, format_table, rounded

SCRIPT = "goodput"
NUM_PROCESSES = 2
#: The rank the local faults strike (and whose host the lab's faults strike).
TARGET_RANK = 1
#: sparkdist's restarts: as many as a run needs (a user would pick a number).
MAX_RESTARTS = 1000
SIGNALS = {"crash": signal.SIGKILL, "preempt": signal.SIGTERM}
LOCAL_VARIANTS = ("sparkdist periodic", "sparkdist async+drain", "pyspark")
LAB_VARIANTS = {"host-kill": "sparkdist periodic", "host-sigterm": "sparkdist async+drain"}


# --- the training function: every rank, under every launcher ---------------------------------


def train(config: dict[str, Any]) -> dict[str, Any]:
    """``config["steps"]`` steps; checkpoints as ``config["variant"]`` says; see the module doc.

    Self-contained (the lab's driver gets its source): imports inside, no module globals.
    """
    import os
    import socket
    import time

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    on_sparkdist = config["variant"].startswith("sparkdist")
    draining = config["variant"] == "sparkdist async+drain"
    if on_sparkdist:
        from sparkdist import runtime
    run_dir, rank = config["run_dir"], int(os.environ["RANK"])
    relaunch, restart = config["relaunch"], runtime.restart_count() if on_sparkdist else 0
    with open("/proc/self/stat") as stat:  # start time: a pid the faults may strike, not reused
        started = stat.read().rsplit(")", 1)[1].split()[19]
    note = os.path.join(run_dir, f"rank-{rank}")
    with open(note + ".tmp", "w") as out:
        out.write(f"{relaunch} {restart} {os.getpid()} {started} {socket.gethostname()}\n")
    os.replace(note + ".tmp", note)

    if rank == 0:  # when the launcher handed over: the function's own start-up follows
        with open(os.path.join(run_dir, "entered.log"), "a") as out:
            out.write(f"{relaunch} {restart} {time.time():.6f}\n")

    dist.init_process_group("gloo")
    world = dist.get_world_size()
    requested = runtime.requested_world_size() if on_sparkdist else world
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    ballast = torch.zeros(config["state_mb"] * 2**18)  # float32: the checkpoint's bulk
    user_path = os.path.join(run_dir, "user-checkpoint.pt")
    start = 0
    if on_sparkdist:
        found = runtime.load_checkpoint()
        if found is not None:
            model.load_state_dict(found.state["model"])
            ballast, start = found.state["ballast"], found.step
    elif os.path.exists(user_path):
        saved = torch.load(user_path, weights_only=True)
        model.load_state_dict(saved["model"])
        ballast, start = saved["ballast"], saved["step"]
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(rank))
    log = -1
    if rank == 0:
        log = os.open(os.path.join(run_dir, "steps.log"), os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    # The same global work on fewer ranks (an elastic restart) takes longer.
    pause = config["step_s"] * requested / world

    def save(step: int, async_: bool) -> None:
        state = {"model": model.state_dict(), "ballast": ballast}
        if on_sparkdist:
            runtime.save_checkpoint(state, step, async_=async_, keep_last=2)
        elif rank == 0:  # what a TorchDistributor user writes: rank 0 saves, atomically
            torch.save({**state, "step": step}, user_path + ".tmp")
            os.replace(user_path + ".tmp", user_path)

    total, every = config["steps"], config["checkpoint_every"]
    for step in range(start, total):
        began = time.time()
        optimizer.zero_grad()
        ddp(x).pow(2).mean().backward()
        optimizer.step()
        time.sleep(pause)
        if log >= 0:
            line = f"{relaunch} {restart} {step} {began:.6f} {time.time():.6f} {world}\n"
            os.write(log, line.encode())
        done = step + 1
        saved = done % every == 0 and done < total
        if saved:
            save(done, async_=draining)
        if draining and runtime.should_stop():  # a notice: save this step, return
            if not saved:
                save(done, async_=False)
            return {"stopped_at": done}
    return {"start": start, "world": world}


# --- faults ----------------------------------------------------------------------------------


class Faults:
    """Strike rank ``TARGET_RANK`` every ``interval_s`` (``signum`` None: never), and stop the
    run at ``cap_s`` (``on_cap``), on a thread of the driver's process.

    A rank is found by the note it writes at entry (``rank-N``: attempt, pid, start time,
    host); each attempt is struck once at most.
    """

    def __init__(
        self,
        run_dir: Path,
        signum: int | None,
        interval_s: float,
        cap_s: float,
        on_cap: Callable[[], None],
    ) -> None:
        self.run_dir, self.signum, self.interval_s = run_dir, signum, interval_s
        self.cap_s, self.on_cap = cap_s, on_cap
        self.strikes: list[dict[str, Any]] = []
        self.capped = False
        self.launched = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="goodput-faults", daemon=True)

    def __enter__(self) -> Faults:
        self.launched = time.time()
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        due = self.launched + self.interval_s
        while not self._stop.wait(0.02):
            now = time.time()
            if now >= self.launched + self.cap_s:
                self.capped = True
                self.on_cap()
                return
            if self.signum is None or now < due:
                continue
            target = self.target()
            if target is None:
                continue
            struck = self.strike(target)
            self.strikes.append({"at": struck, "attempt": target["attempt"]})
            due = struck + self.interval_s

    def note(self) -> dict[str, Any] | None:
        """The target rank's latest note, unless its attempt was struck already."""
        try:
            fields = (self.run_dir / f"rank-{TARGET_RANK}").read_text().split()
        except FileNotFoundError:
            return None
        attempt = [int(fields[0]), int(fields[1])]
        if any(s["attempt"] == attempt for s in self.strikes):
            return None
        return {"attempt": attempt, "pid": int(fields[2]), "started": fields[3], "host": fields[4]}

    def target(self) -> dict[str, Any] | None:
        """The target rank, if it is alive (same pid, same start time, not a zombie)."""
        found = self.note()
        if found is None:
            return None
        try:
            with open(f"/proc/{found['pid']}/stat", encoding="ascii") as stat:
                after = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            return None
        return found if after[19] == found["started"] and after[0] != "Z" else None

    def strike(self, target: dict[str, Any]) -> float:
        assert self.signum is not None
        with contextlib.suppress(ProcessLookupError):
            os.kill(target["pid"], self.signum)
        return time.time()


# --- one run, its figures --------------------------------------------------------------------


def figures_of(
    run_dir: Path,
    steps: int,
    started: float,
    wall_s: float,
    strikes: list[dict[str, Any]],
    finished: bool,
    attempts: list[list[int]],
) -> dict[str, Any]:
    """Goodput, steps lost per fault, recovery, from rank 0's ``steps.log``."""
    rows = []
    log = run_dir / "steps.log"
    if log.exists():
        for line in log.read_text().splitlines():
            relaunch, restart, step, began, ended, world = line.split()
            rows.append(
                ([int(relaunch), int(restart)], int(step), float(began), float(ended), int(world))
            )
    last: dict[int, tuple[float, float]] = {}
    for _, step, began, ended, _ in sorted(rows, key=lambda r: r[3]):
        last[step] = (began, ended)
    counted = steps if finished else checkpointed_step(run_dir)
    useful = sum(e - b for s, (b, e) in last.items() if s < counted)
    entries = []
    if (run_dir / "entered.log").exists():
        for line in (run_dir / "entered.log").read_text().splitlines():
            relaunch, restart, at = line.split()
            entries.append(([int(relaunch), int(restart)], float(at)))
    recoveries, handovers = [], []
    for strike in strikes:
        later = [r[2] for r in rows if r[0] > strike["attempt"] and r[2] >= strike["at"]]
        if later:
            recoveries.append(min(later) - strike["at"])
        entered = [at for a, at in entries if a > strike["attempt"] and at >= strike["at"]]
        if entered:
            handovers.append(min(entered) - strike["at"])
    # Steps each attempt ran that the next one ran again (what each fault cost).
    starts = {tuple(a): min(r[1] for r in rows if r[0] == a) for a, *_ in rows}
    order = sorted(starts)
    lost_by_attempt = [
        sum(1 for r in rows if tuple(r[0]) == a and r[1] >= starts[b])
        for a, b in zip(order, order[1:], strict=False)
    ]
    step_times = sorted(e - b for b, e in last.values())
    return {
        "finished": finished,
        "wall_s": rounded(wall_s, 2),
        "goodput": rounded(useful / wall_s if wall_s else None, 3),
        "counted_steps": counted,
        "executed_steps": len(rows),
        "faults": len(strikes),
        "lost_per_fault": rounded((len(rows) - counted) / len(strikes), 1) if strikes else None,
        "attempts": len(attempts),
        "relaunches": max(0, len({a[0] for a in attempts}) - 1),
        "restarts": len(attempts) - len({a[0] for a in attempts}),
        "recovery_s": rounded(statistics.median(recoveries) if recoveries else None, 2),
        "recoveries_s": [rounded(r, 2) for r in recoveries],
        "fault_to_function_s": rounded(statistics.median(handovers) if handovers else None, 2),
        "lost_by_attempt": lost_by_attempt,
        "step_s_median": rounded(step_times[len(step_times) // 2] if step_times else None, 3),
        "worlds": sorted({r[4] for r in rows}),
        "strikes_s": [rounded(s["at"] - started, 1) for s in strikes],  # after the launch
    }


def checkpointed_step(run_dir: Path) -> int:
    """The step the run's newest checkpoint covers: what a relaunch would resume from."""
    steps = [0]
    ckpt = run_dir / "ckpt"
    if ckpt.is_dir():
        steps += [int(p.name[5:]) for p in ckpt.glob("step-*") if (p / "COMMITTED").exists()]
    user = run_dir / "user-checkpoint.pt"
    if user.exists():
        import torch

        steps.append(int(torch.load(user, weights_only=True)["step"]))
    return max(steps)


def attempts_seen(run_dir: Path) -> list[list[int]]:
    """Every attempt whose rank 0 entered the training function: [relaunch, restart]."""
    seen = set()
    for name in ("entered.log", "steps.log"):
        if (run_dir / name).exists():
            lines = (run_dir / name).read_text().splitlines()
            seen |= {tuple(map(int, line.split()[:2])) for line in lines}
    return [list(a) for a in sorted(seen)]


# --- local mode: sparkdist and pyspark in one driver (a child with a local[2] session) --------


def run_sparkdist_local(
    config: dict[str, Any], faults: Faults, cap_s: float, errors: list[str]
) -> bool:
    """``run_all`` until it returns; a run that raises is launched again, as a user would
    (``relaunch``); True once it finished."""
    from sparkdist import Distributor, RunTimeoutError

    while True:
        remaining = cap_s - (time.time() - faults.launched)
        if remaining <= 0:
            return False
        distributor = Distributor(
            NUM_PROCESSES,
            use_gpu=False,
            max_restarts=MAX_RESTARTS,
            checkpoint_dir=str(Path(config["run_dir"]) / "ckpt"),
            timeout_s=remaining,
        )
        try:
            distributor.run_all(train, config)
            return True
        except RunTimeoutError:
            return False
        except Exception as error:  # noqa: BLE001 - the user's loop: launch again
            errors.append(first_line(error))
            progress(f"  sparkdist raised, launching again: {errors[-1]}")
            config["relaunch"] += 1


def run_pyspark(config: dict[str, Any], faults: Faults, errors: list[str]) -> bool:
    """What a ``TorchDistributor`` user writes: catch the error, launch again (the training
    function resumes from its own checkpoint); True once it finished."""
    from pyspark.ml.torch.distributor import TorchDistributor

    while not faults.capped:
        try:
            TorchDistributor(num_processes=NUM_PROCESSES, local_mode=True, use_gpu=False).run(
                train, config
            )
            return True
        except Exception as error:  # noqa: BLE001 - the user's loop: launch again
            if faults.capped:
                break
            errors.append(first_line(error))
            progress(f"  pyspark raised, launching again: {errors[-1]}")
            config["relaunch"] += 1
    return False


def kill_torchrun() -> None:
    """At the cap: kill pyspark's torchrun (a child of this driver) and its workers."""
    import psutil

    for child in psutil.Process().children():
        with contextlib.suppress(psutil.Error):
            if "torch_run_process_wrapper" in " ".join(child.cmdline()):
                for proc in [*child.children(recursive=True), child]:
                    with contextlib.suppress(psutil.Error):
                        proc.kill()


def local_run(variant: str, schedule: str, args: argparse.Namespace, root: Path) -> dict[str, Any]:
    run_dir = Path(tempfile.mkdtemp(prefix="run-", dir=root))
    config = {
        "variant": variant,
        "run_dir": str(run_dir),
        "relaunch": 0,
        "steps": args.steps,
        "step_s": args.step_s,
        "checkpoint_every": args.checkpoint_every,
        "state_mb": args.state_mb,
    }
    progress(f"{variant} under {schedule}")
    started, errors = time.time(), []
    with Faults(
        run_dir,
        SIGNALS.get(schedule),
        args.interval_s,
        args.cap_s,
        kill_torchrun if variant == "pyspark" else lambda: None,
    ) as faults:
        if variant == "pyspark":
            finished = run_pyspark(config, faults, errors)
        else:
            finished = run_sparkdist_local(config, faults, args.cap_s, errors)
    wall_s = time.time() - started
    record = {
        "figure": "goodput",
        "where": "local",
        "schedule": schedule,
        "variant": variant,
        **figures_of(
            run_dir, args.steps, started, wall_s, faults.strikes, finished, attempts_seen(run_dir)
        ),
        "errors": errors,
        "load_1m": round(os.getloadavg()[0], 2),
    }
    progress(f"  {json.dumps(record)}")
    return record


def run_local_child(args: argparse.Namespace) -> None:
    from sparkdist import Distributor

    session = classic_session("local[2]", "sparkdist-benchmark-goodput", Path.cwd())
    root = Path(tempfile.mkdtemp(prefix="goodput-runs-", dir=Path.cwd()))
    try:
        # Warm-up: sparkdist's pool, pyspark's torchrun and the page cache.
        Distributor(NUM_PROCESSES, use_gpu=False).run(abs, -1)
        if "pyspark" in args.variants:
            from pyspark.ml.torch.distributor import TorchDistributor

            TorchDistributor(num_processes=NUM_PROCESSES, local_mode=True, use_gpu=False).run(
                abs, -1
            )
        for index in range(args.runs):
            for schedule in args.schedules:
                for variant in (v for v in LOCAL_VARIANTS if v in args.variants):
                    record = {"round": index, **local_run(variant, schedule, args, root)}
                    append_records(args.results, [record])
    finally:
        session.stop()


# --- the lab: hosts lost while sparkdist trains across them ----------------------------------

LAB_DRIVER_CODE = """
import json, os, threading, time
import sparkdist

def start_run(config, max_restarts):
    def go():
        ended = {"errors": []}
        stop = os.path.join(config["run_dir"], "stop")
        while not os.path.exists(stop):
            try:
                result = sparkdist.Distributor(2, local_mode=False, use_gpu=False,
                    min_processes=1, max_restarts=max_restarts,
                    checkpoint_dir=os.path.join(config["run_dir"], "ckpt")).run_all(train, config)
                ended["attempts"] = [a.summary() for a in result.attempts]
                break
            except Exception as error:  # the user's loop: launch again
                ended["errors"].append(f"{type(error).__name__}: {error}"[:2000])
                config["relaunch"] += 1
        ended["at"] = time.time()
        path = os.path.join(config["run_dir"], "ended.json")
        with open(path + ".tmp", "w") as out:
            json.dump(ended, out)
        os.replace(path + ".tmp", path)
    threading.Thread(target=go, daemon=True).start()
"""


class LabFaults(Faults):
    """The lab's faults: rank 1's host killed and brought back, or SIGTERM to its executor."""

    def __init__(self, cluster: Any, app: str, schedule: str, *args: Any) -> None:
        super().__init__(*args)
        self.cluster, self.app, self.schedule = cluster, app, schedule
        self.by_name = {h.hostname: h.name for h in cluster.lab.hosts.values()}

    def target(self) -> dict[str, Any] | None:
        found = self.note()
        if found is None:
            return None
        host = self.by_name.get(found["host"])
        if host is None:
            return None
        processes = self.cluster.lab.processes(host)
        if not any(  # a rank (as ``Lab.rank_processes`` tells them)
            p["name"].startswith("sparkdist-r") or "SPARKDIST_RUN_ID" in p["env_names"]
            for p in processes
        ):
            return None
        jvms = [
            p["pid"]
            for p in processes
            if any("CoarseGrainedExecutorBackend" in a for a in p["argv"]) and self.app in p["argv"]
        ]
        if not jvms:
            return None
        return {**found, "lab_host": host, "jvm": jvms[0]}

    def strike(self, target: dict[str, Any]) -> float:
        lab, host = self.cluster.lab, target["lab_host"]
        if self.schedule == "host-kill":
            lab.kill_host(host)
            struck = time.time()
            # Capacity comes back (a new machine, same name and address). The cluster has no
            # ``driver`` of its own, so this does not move executors about (its spreading could
            # SIGKILL a live executor while Spark still lists the killed one beside it).
            self.cluster.restart_host(host)
            return struck
        lab.signal(target["jvm"], signal.SIGTERM)
        return time.time()  # its Worker starts a new executor there on its own


def start_lab_driver(cluster: Any, drains: bool) -> Any:
    """A driver application of its own for one run (a new kernel and SparkSession): a run may
    leave its application with fewer executors than it started with (sparkdist gives up the
    executors of a host that failed twice), which must not carry over to the next run.

    ``drains``: Spark kills the other nodes' tasks ``spark.python.task.killTimeout`` after it
    lost an executor (2 s by default), too soon for a drain's checkpoint: raised to 30 s, as
    docs/restarts.md says to. Host kills run under Spark's defaults."""
    from sparkdist._lab.spark import MASTER_URL, DriverKernel, session_code

    lab = cluster.lab
    log = lab.directory / "logs" / f"driver-{time.monotonic_ns()}.log"
    env = lab.env("driver", SPARKDIST_MLFLOW="0")
    reply = lab.spawn(
        "driver", [sys.executable, "-m", "sparkdist._lab.kernel"], log, env=env, pipes=True
    )
    driver = DriverKernel(lab, reply["proc"], reply["pid"], log)
    conf = {"spark.cores.max": str(len(cluster.workers))}
    if drains:
        conf["spark.python.task.killTimeout"] = "30s"
    driver.check(session_code(MASTER_URL, conf))
    driver.check(
        f"""
        import time
        deadline = time.monotonic() + 90
        status = spark.sparkContext._jsc.sc().getExecutorMemoryStatus
        while status().size() - 1 < {len(cluster.workers)}:
            assert time.monotonic() < deadline, "the driver got too few executors"
            time.sleep(0.2)
        """
    )
    driver.check(inspect.getsource(train) + LAB_DRIVER_CODE)
    driver.check("sparkdist.Distributor(2, local_mode=False, use_gpu=False).run(abs, -1)")
    return driver


def lab_run(cluster: Any, schedule: str, args: argparse.Namespace) -> dict[str, Any]:
    variant = LAB_VARIANTS[schedule]
    run_dir = cluster.lab.shared / f"run-{time.monotonic_ns()}"
    run_dir.mkdir()
    config = {
        "variant": variant,
        "run_dir": str(run_dir),
        "relaunch": 0,
        "steps": args.lab_steps,
        "step_s": args.step_s,
        "checkpoint_every": args.checkpoint_every,
        "state_mb": args.state_mb,
    }
    progress(f"lab: {variant} under {schedule}")
    driver = start_lab_driver(cluster, drains=schedule == "host-sigterm")
    try:
        app = str(driver.check("result = spark.sparkContext.applicationId"))
        ended_path = run_dir / "ended.json"
        started = time.time()
        faults = LabFaults(
            cluster,
            app,
            schedule,
            run_dir,
            signal.SIGTERM,
            args.lab_interval_s,
            args.lab_cap_s,
            lambda: None,
        )
        with faults:
            driver.check(f"start_run({config!r}, {MAX_RESTARTS})")
            while not ended_path.exists() and not faults.capped:
                time.sleep(0.1)  # the driver's thread writes it when run_all returns or raises
        (run_dir / "stop").touch()  # past the cap: the driver's loop launches no more
        ended = json.loads(ended_path.read_text()) if ended_path.exists() else {}
        wall_s = (ended["at"] if ended else time.time()) - started
        executors = driver.check(
            "result = spark.sparkContext._jsc.sc().getExecutorMemoryStatus().size() - 1"
        )
        driver.check("spark.stop()")
    finally:
        cluster.lab.signal(driver.pid, signal.SIGKILL)
    left = cluster.lab.wait_until_no_ranks(30)
    record = {
        "figure": "goodput",
        "where": "lab",
        "schedule": schedule,
        "variant": variant,
        **figures_of(
            run_dir,
            args.lab_steps,
            started,
            wall_s,
            faults.strikes,
            "attempts" in ended,
            attempts_seen(run_dir),
        ),
        "attempt_summaries": ended.get("attempts", []),
        "errors": ended.get("errors", []),
        "executors_after": executors,
        "ranks_left": len(left),
        "load_1m": round(os.getloadavg()[0], 2),
    }
    for proc in left:
        cluster.lab.signal(proc["pid"], signal.SIGKILL)
    progress(f"  {json.dumps(record)}")
    return record


def run_lab_child(args: argparse.Namespace) -> None:
    from sparkdist._lab.spark import start_lab_cluster
    from sparkdist._lab.support import probe

    support = probe()
    if not support.ok:
        raise SystemExit(f"the lab cannot run here: {support.reason}")
    os.environ.pop("GLOO_SOCKET_IFNAME", None)  # loopback only outside the lab
    with tempfile.TemporaryDirectory(prefix="bench-goodput-lab-") as tmp:
        # One core per host: a lost executor comes back only on its own host.
        cluster = start_lab_cluster(Path(tmp), 3, cores=1)
        try:
            for index in range(args.runs):
                for schedule in args.lab_schedules:
                    record = {"round": index, **lab_run(cluster, schedule, args)}
                    append_records(args.results, [record])
        finally:
            cluster.lab.close()


# --- the parent --------------------------------------------------------------------------------


def progress(message: str) -> None:
    print(f"[{SCRIPT}] {message}", file=sys.stderr, flush=True)


def first_line(error: BaseException, limit: int = 160) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[0] if lines else ''}"[:limit]


def table(records: list[dict[str, Any]]) -> str:
    rows = []
    for r in records:
        notes = [] if r["finished"] else [f"unfinished at the cap ({r['wall_s']} s)"]
        if len(r["worlds"]) > 1 or r["where"] == "lab":
            notes.append(f"world sizes {r['worlds']}")
        if r.get("errors"):
            notes.append(f"relaunched after: {r['errors'][0][:70]}")
        rows.append(
            (
                r["where"],
                r["schedule"],
                r["variant"],
                f"{r['goodput']:.3f}" if r["goodput"] is not None else "-",
                str(r["faults"]),
                f"{r['executed_steps']}/{r['counted_steps']}",
                "-" if r["lost_per_fault"] is None else f"{r['lost_per_fault']:.1f}",
                f"{r['restarts']} / {r['relaunches']}",
                "-" if r["recovery_s"] is None else f"{r['recovery_s']:.2f} s",
                f"{r['wall_s']:.1f} s",
                f"{r['load_1m']:.1f}",
                "; ".join(notes),
            )
        )
    return format_table(
        (
            "where",
            "schedule",
            "variant",
            "goodput",
            "faults",
            "executed/counted",
            "lost/fault",
            "restarts / relaunches",
            "fault->next step",
            "wall",
            "load",
            "notes",
        ),
        rows,
    )


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--steps", type=int, help="steps per run (default 120; 60 with --quick)")
    parser.add_argument("--step-s", type=float, default=0.25, help="seconds per step (0.25)")
    parser.add_argument(
        "--checkpoint-every", type=int, help="steps between checkpoints (default 15; 10 quick)"
    )
    parser.add_argument("--state-mb", type=int, default=16, help="checkpoint size, MB (16)")
    parser.add_argument(
        "--interval-s", type=float, help="seconds between faults (default 15; 12 quick)"
    )
    parser.add_argument(
        "--cap-s", type=float, help="stop a run after this long (default 240; 60 quick)"
    )
    parser.add_argument(
        "--schedules",
        nargs="+",
        choices=("none", *SIGNALS),
        help="local fault schedules (default: all; none and crash with --quick)",
    )
    parser.add_argument(
        "--variants", nargs="+", choices=LOCAL_VARIANTS, default=list(LOCAL_VARIANTS)
    )
    parser.add_argument("--lab", action="store_true", help="also run in the multi-host lab")
    parser.add_argument("--no-local", dest="local", action="store_false")
    parser.add_argument(
        "--lab-schedules", nargs="+", choices=tuple(LAB_VARIANTS), default=list(LAB_VARIANTS)
    )
    parser.add_argument("--lab-steps", type=int, help="steps per lab run (default 240; 80 quick)")
    parser.add_argument(
        "--lab-interval-s", type=float, help="seconds between host faults (default 20; 10 quick)"
    )
    parser.add_argument("--lab-cap-s", type=float, default=300.0)
    parser.add_argument("--runs", type=int, default=1, help="rounds of every cell (1)")
    parser.add_argument("--out", type=Path, help="write every record here as a JSON list")
    parser.add_argument("--quick", action="store_true", help="a smoke test (~3 min)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--results", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    quick = args.quick
    defaults = {
        "steps": 60 if quick else 120,
        "checkpoint_every": 10 if quick else 15,
        "interval_s": 12.0 if quick else 15.0,
        "cap_s": 60.0 if quick else 240.0,
        "schedules": ["none", "crash"] if quick else ["none", *SIGNALS],
        "lab_steps": 80 if quick else 240,
        "lab_interval_s": 10.0 if quick else 20.0,
    }
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.runs < 1 or args.steps < 1 or args.checkpoint_every < 1:
        parser.error("--runs, --steps and --checkpoint-every must be at least 1")
    return args


def child_argv(args: argparse.Namespace) -> list[str]:
    argv = [
        "--runs",
        str(args.runs),
        "--steps",
        str(args.steps),
        "--step-s",
        str(args.step_s),
        "--checkpoint-every",
        str(args.checkpoint_every),
        "--state-mb",
        str(args.state_mb),
        "--interval-s",
        str(args.interval_s),
        "--cap-s",
        str(args.cap_s),
        "--schedules",
        *args.schedules,
        "--variants",
        *args.variants,
        "--lab-schedules",
        *args.lab_schedules,
        "--lab-steps",
        str(args.lab_steps),
        "--lab-interval-s",
        str(args.lab_interval_s),
        "--lab-cap-s",
        str(args.lab_cap_s),
    ]
    return argv


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    if args.child == "local":
        run_local_child(args)
        return
    if args.child == "lab":
        run_lab_child(args)
        return
    records: list[dict[str, Any]] = []
    with Bench(SCRIPT) as bench:
        runs = args.runs * len(args.schedules) * len(args.variants)
        if args.local:
            records += bench.child("local", child_argv(args), budget_s=120 + runs * args.cap_s)
        if args.lab:
            budget = 240 + args.runs * len(args.lab_schedules) * (args.lab_cap_s + 90)
            records += bench.child("lab", child_argv(args), budget_s=budget)
    settings = {
        k: getattr(args, k)
        for k in ("runs", "steps", "step_s", "checkpoint_every", "state_mb", "interval_s", "cap_s")
    }
    if args.lab:
        settings.update(lab_steps=args.lab_steps, lab_interval_s=args.lab_interval_s)
    machine = bench.machine(**settings)
    if args.out:
        args.out.write_text(json.dumps([*records, machine], indent=1) + "\n")
    emit([*records, machine], table(records))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main(sys.argv[1:])
