"""Goodput under faults: how much of the wall time a training run spends in steps that count,
when a rank (local) or a host (lab) is lost every ``--interval-s`` seconds.

One training function (``_goodput_jobs.train``: what it does and what it writes) runs under
every launcher: ``--steps`` steps of a small DDP model, each padded to ``--step-s``, and a
``--state-mb`` checkpoint every ``--checkpoint-every`` steps. Variants:

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

``host-kill-groups`` kills rank 1's host the same way under torchft's replica groups
(``_goodput_jobs.train_groups``: 3 groups of one rank, one per host, no checkpoints): the lost
group is relaunched when its host is back and heals from a live peer; the other two groups go
on meanwhile.

``host-kill-grow`` and ``host-kill-no-grow`` kill rank 1's host the same way, with 3 ranks on the
3 hosts (``min_processes=2``): the run shrinks to 2 at each loss; with grow-back
(``grow_after_s=--grow-after-s``) it drains and goes back to 3 once the host has been back that
long, without (``grow_after_s=None``) it stays at 2 until a later fault's restart finds 3 slots.
The step's sleep is ``--step-s * requested / world`` (the same global work on fewer ranks), so
a shrunk run is slower. ``--plot out.png`` (matplotlib) draws each lab run's world size and
steps per second over time with the faults marked (docs/restarts.md shows one).

Figures per run: ``goodput`` (sum of the durations of the steps that count, i.e. the last
execution of each step index, each at most the run's median step, over the wall time from the
first launch to the result: a step's wait for a quorum or a checkpoint is not useful),
``goodput_from_first_step`` (the same over the wall time from the first step: the faults' cost
without the start-up), ``first_step_s`` (from the launch to the first step),
``lost_per_fault`` ((steps executed - steps) / faults), ``restarts`` (sparkdist's),
``relaunches`` (by user code), ``recovery_s`` (median, from a fault to the first step of the
next attempt), ``stall_s`` (median, from a fault to the next step that got further than any step
begun before it: what the healthy ranks waited), ``heal_s`` (replica groups: from a fault to
the relaunched group's first committed step), ``rates`` (steps per second between one fault
and the next, and the worlds that ran then). A run still going at ``--cap-s`` is stopped and
reported ``unfinished``; then only steps its last checkpoint covers count.

Usage (see benchmarks/README.md)::

    python benchmarks/goodput.py --quick             # smoke test (~3 min)
    python benchmarks/goodput.py --out goodput.json  # local mode, every variant and schedule
    python benchmarks/goodput.py --lab               # plus the lab (needs root or user namespaces)
    python benchmarks/goodput.py --no-local --lab --lab-schedules host-kill-grow \
        host-kill-no-grow --plot goodput.png          # grow-back against none, drawn

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
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import _goodput_jobs
from _goodput_faults import Faults, LabFaults
from _goodput_jobs import LAB_DRIVER_CODE, figures_of, run_config, train, train_groups
from _harness import Bench, Options, append_records, classic_session, progress
from _measure import first_line, kill_tree, pickled_by_value
from _report import emit, seconds, table

SCRIPT = "goodput"
NUM_PROCESSES = 2
#: sparkdist's restarts: as many as a run needs (a user would pick a number).
MAX_RESTARTS = 1000
SIGNALS = {"crash": signal.SIGKILL, "preempt": signal.SIGTERM}
LOCAL_VARIANTS = ("sparkdist periodic", "sparkdist async+drain", "pyspark")
LAB_VARIANTS = {
    "host-kill": "sparkdist periodic",
    "host-sigterm": "sparkdist async+drain",
    "host-kill-grow": "sparkdist async+drain",
    "host-kill-no-grow": "sparkdist async+drain",
    "host-kill-groups": "sparkdist replica groups",
}
#: The lab's worlds: 2 ranks of at least 1 on 3 hosts (a lost host's rank moves to the third),
#: or 3 ranks of at least 2 on the 3 hosts (a lost host shrinks the run until it grows back).
LAB_WORLD = {"num_processes": 2, "min_processes": 1, "grow_after_s": None}
CYCLE_WORLD = {"num_processes": 3, "min_processes": 2}
#: torchft's replica groups: 3 groups of one rank, one per host (a lost host's group is
#: relaunched when the host is back; the other two go on meanwhile).
GROUPS_WORLD = {
    "num_processes": 3,
    "min_processes": None,
    "grow_after_s": None,
    "replica_groups": 3,
}

OPTIONS = Options(__doc__, quick_help="a smoke test (~3 min)")
OPTIONS.add("--steps", type=int, quick=(120, 60), help="steps per run")
OPTIONS.add("--step-s", type=float, default=0.25, help="seconds per step (0.25)")
OPTIONS.add("--checkpoint-every", type=int, quick=(15, 10), help="steps between checkpoints")
OPTIONS.add("--state-mb", type=int, default=16, help="checkpoint size, MB (16)")
OPTIONS.add("--interval-s", type=float, quick=(15.0, 12.0), help="seconds between faults")
OPTIONS.add("--cap-s", type=float, quick=(240.0, 60.0), help="stop a run after this long")
OPTIONS.add(
    "--schedules",
    nargs="+",
    choices=("none", *SIGNALS),
    quick=(["none", *SIGNALS], ["none", "crash"]),
    help="local fault schedules",
)
OPTIONS.add("--variants", nargs="+", choices=LOCAL_VARIANTS, default=list(LOCAL_VARIANTS))
OPTIONS.add("--lab", action="store_true", help="also run in the multi-host lab")
OPTIONS.add("--no-local", dest="local", action="store_false")
OPTIONS.add("--lab-schedules", nargs="+", choices=tuple(LAB_VARIANTS), default=list(LAB_VARIANTS))
OPTIONS.add("--lab-steps", type=int, quick=(240, 80), help="steps per lab run")
OPTIONS.add("--lab-interval-s", type=float, quick=(20.0, 10.0), help="seconds between host faults")
OPTIONS.add("--lab-cap-s", type=float, default=300.0)
OPTIONS.add("--grow-after-s", type=float, default=5.0, help="host-kill-grow's grow_after_s (5)")
OPTIONS.add("--plot", type=Path, help="draw the lab runs' world and steps/s over time (PNG)")
OPTIONS.add("--runs", type=int, default=1, help="rounds of every cell (1)")
OPTIONS.add("--out", type=Path, help="write every record here as a JSON list")


def record_of(
    where: str, schedule: str, variant: str, figures: dict[str, Any], **extra: Any
) -> dict[str, Any]:
    """A run's JSON record: where and what, its ``figures_of``, ``extra``, the load now."""
    record = {"figure": "goodput", "where": where, "schedule": schedule, "variant": variant}
    record.update(figures, **extra, load_1m=round(os.getloadavg()[0], 2))
    progress(SCRIPT, f"  {json.dumps({k: v for k, v in record.items() if k != 'timeline'})}")
    return record


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
            errors.append(first_line(error, 160))
            progress(SCRIPT, f"  sparkdist raised, launching again: {errors[-1]}")
            config["relaunch"] += 1


def run_pyspark(config: dict[str, Any], faults: Faults, errors: list[str]) -> bool:
    """What a ``TorchDistributor`` user writes: catch the error, launch again (the training
    function resumes from its own checkpoint); True once it finished."""
    from pyspark.ml.torch.distributor import TorchDistributor

    while not faults.capped:
        try:
            distributor = TorchDistributor(
                num_processes=NUM_PROCESSES, local_mode=True, use_gpu=False
            )
            with pickled_by_value(_goodput_jobs):
                distributor.run(train, config)
            return True
        except Exception as error:  # noqa: BLE001 - the user's loop: launch again
            if faults.capped:
                break
            errors.append(first_line(error, 160))
            progress(SCRIPT, f"  pyspark raised, launching again: {errors[-1]}")
            config["relaunch"] += 1
    return False


def kill_torchrun() -> None:
    """At the cap: kill pyspark's torchrun (a child of this driver) and its workers."""
    import psutil

    for child in psutil.Process().children():
        with contextlib.suppress(psutil.Error):
            if "torch_run_process_wrapper" in " ".join(child.cmdline()):
                kill_tree(child.pid)


def local_run(variant: str, schedule: str, args: argparse.Namespace, root: Path) -> dict[str, Any]:
    run_dir = Path(tempfile.mkdtemp(prefix="run-", dir=root))
    config = run_config(variant, run_dir, args.steps, args)
    progress(SCRIPT, f"{variant} under {schedule}")
    started, errors = time.time(), []
    on_cap = kill_torchrun if variant == "pyspark" else lambda: None
    with Faults(run_dir, SIGNALS.get(schedule), args.interval_s, args.cap_s, on_cap) as faults:
        if variant == "pyspark":
            finished = run_pyspark(config, faults, errors)
        else:
            finished = run_sparkdist_local(config, faults, args.cap_s, errors)
    wall_s = time.time() - started
    figures = figures_of(run_dir, args.steps, started, wall_s, faults.strikes, finished)
    return record_of("local", schedule, variant, figures, errors=errors)


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


def start_lab_driver(cluster: Any, drains: bool) -> Any:
    """A driver application of its own for one run (a new kernel and SparkSession): a run may
    leave its application with fewer executors than it started with (sparkdist gives up the
    executors of a host that failed twice), which must not carry over to the next run.

    ``drains``: Spark kills the other nodes' tasks ``spark.python.task.killTimeout`` after it
    lost an executor (2 s by default), too soon for a drain's checkpoint: raised to 30 s, as
    docs/restarts.md says to. Host kills run under Spark's defaults."""
    conf = {"spark.cores.max": str(len(cluster.workers))}
    if drains:
        conf["spark.python.task.killTimeout"] = "30s"
    driver = cluster.start_application(conf, len(cluster.workers), SPARKDIST_MLFLOW="0")
    driver.check(inspect.getsource(train) + inspect.getsource(train_groups) + LAB_DRIVER_CODE)
    driver.check("sparkdist.Distributor(2, local_mode=False, use_gpu=False).run(abs, -1)")
    return driver


def lab_run(cluster: Any, schedule: str, args: argparse.Namespace) -> dict[str, Any]:
    variant = LAB_VARIANTS[schedule]
    run_dir = cluster.lab.shared / f"run-{time.monotonic_ns()}"
    run_dir.mkdir()
    world = dict(LAB_WORLD)
    if schedule in ("host-kill-grow", "host-kill-no-grow"):
        grow = args.grow_after_s if schedule == "host-kill-grow" else None
        world = {**CYCLE_WORLD, "grow_after_s": grow}
    if schedule == "host-kill-groups":
        world = dict(GROUPS_WORLD)
    config = run_config(variant, run_dir, args.lab_steps, args, **world)
    progress(SCRIPT, f"lab: {variant} under {schedule}")
    driver = start_lab_driver(cluster, drains=schedule == "host-sigterm")
    try:
        app = str(driver.check("result = spark.sparkContext.applicationId"))
        ended_path = run_dir / "ended.json"
        started = time.time()
        timing = (args.lab_interval_s, args.lab_cap_s, lambda: None)
        faults = LabFaults(cluster, app, schedule, run_dir, signal.SIGTERM, *timing)
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
    finished = "attempts" in ended
    figures = figures_of(run_dir, args.lab_steps, started, wall_s, faults.strikes, finished)
    for proc in left:
        cluster.lab.signal(proc["pid"], signal.SIGKILL)
    return record_of(
        "lab",
        schedule,
        variant,
        figures,
        attempt_summaries=ended.get("attempts", []),
        errors=ended.get("errors", []),
        executors_after=executors,
        ranks_left=len(left),
    )


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


def table_of(records: list[dict[str, Any]]) -> str:
    rows = []
    for r in records:
        notes = [] if r["finished"] else [f"unfinished at the cap ({r['wall_s']} s)"]
        if len(r["worlds"]) > 1 or r["where"] == "lab":
            notes.append(f"world sizes {r['worlds']}")
        if r.get("errors"):
            notes.append(f"relaunched after: {r['errors'][0][:70]}")
        rows.append(
            {
                "where": r["where"],
                "schedule": r["schedule"],
                "variant": r["variant"],
                "goodput": f"{r['goodput']:.3f}" if r["goodput"] is not None else "-",
                "from 1st step": ratio(r.get("goodput_from_first_step")),
                "faults": str(r["faults"]),
                "executed/counted": f"{r['executed_steps']}/{r['counted_steps']}",
                "lost/fault": "-" if r["lost_per_fault"] is None else f"{r['lost_per_fault']:.1f}",
                "restarts / relaunches": f"{r['restarts']} / {r['relaunches']}",
                "fault->next step": seconds(r["recovery_s"], 2),
                "stall": seconds(r["stall_s"], 2),
                "wall": f"{r['wall_s']:.1f} s",
                "load": f"{r['load_1m']:.1f}",
                "notes": "; ".join(notes),
            }
        )
    return table(rows)


def ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def main(argv: list[str]) -> None:
    args = OPTIONS.parse(argv, positive=("runs", "steps", "checkpoint_every"))
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
            records += bench.child("local", OPTIONS.forward(args), budget_s=120 + runs * args.cap_s)
        if args.lab:
            budget = 240 + args.runs * len(args.lab_schedules) * (args.lab_cap_s + 90)
            records += bench.child("lab", OPTIONS.forward(args), budget_s=budget)
    settings = {
        k: getattr(args, k)
        for k in ("runs", "steps", "step_s", "checkpoint_every", "state_mb", "interval_s", "cap_s")
    }
    if args.lab:
        settings.update(lab_steps=args.lab_steps, lab_interval_s=args.lab_interval_s)
    machine = bench.machine(**settings)
    if args.out:
        args.out.write_text(json.dumps([*records, machine], indent=1) + "\n")
    if args.plot:
        from _goodput_plot import plot

        plot([r for r in records if r["where"] == "lab"], machine, args.plot)
    emit([*records, machine], table_of(records))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main(sys.argv[1:])
