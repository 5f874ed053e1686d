"""Preemption across hosts: SIGTERM to one host's executor JVM (what YARN or Kubernetes sends
before it kills a container) while 2 ranks on 2 lab hosts train and call
``runtime.should_stop()`` each step.

What it shows (printed): what reached that host's agent (the PySpark worker gets SIGHUP from
its daemon when the executor shuts its Python workers down), how long the agent's process and
its ranks lived after the signal, at which step each rank saved, and how the run ended. And
Spark's own bound: once it lost the executor it kills the other nodes' tasks after
``spark.python.task.killTimeout`` (2 s by default), so a save that takes longer needs that
conf raised (docs/restarts.md, preemption).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sparkdist._lab.spark import DriverKernel, LabCluster

pytestmark = [pytest.mark.multihost, pytest.mark.spark, pytest.mark.timeout(400)]

RUN = """
import threading, time
import sparkdist

def train(shared, steps, save_after_s):
    import json, os, socket, time
    import torch
    import torch.distributed as dist
    from sparkdist import runtime

    def note(name, **fields):
        with open(os.path.join(shared, name + ".tmp"), "w") as f:
            json.dump(fields, f)
        os.replace(os.path.join(shared, name + ".tmp"), os.path.join(shared, name))

    dist.init_process_group("gloo")
    rank, attempt = dist.get_rank(), runtime.restart_count()
    latest = runtime.load_checkpoint()
    start = 0 if latest is None else latest.step
    agent = os.getppid()
    with open(f"/proc/{agent}/cmdline", "rb") as f:
        if b"zygote" in f.read():  # a warm rank: its zygote's parent is the agent
            with open(f"/proc/{agent}/stat") as stat:
                agent = int(stat.read().rsplit(")", 1)[1].split()[1])
    note(f"joined-{attempt}-{rank}", host=socket.gethostname(), pid=os.getpid(), agent=agent,
         start=start, time=time.time())
    runtime.on_preemption(lambda why: note(f"notice-{attempt}-{rank}", why=why, time=time.time()))
    total = torch.ones(1)
    for step in range(start, steps):
        dist.all_reduce(total)
        if runtime.should_stop():
            time.sleep(save_after_s)  # as a large checkpoint's gathering would take
            path = runtime.save_checkpoint({"total": total}, step + 1)
            note(f"saved-{attempt}-{rank}", step=step + 1, time=time.time(), path=path)
            return ("stopped", step + 1)
        time.sleep(0.05 if attempt == 0 else 0.0)
    return ("done", start, attempt)

handle = sparkdist.Distributor(2, local_mode=False, use_gpu=False, checkpoint_dir=__CKPT__,
    storage_options=__OPTIONS__, timeout_s=300).run_async(
    train, __SHARED__, __STEPS__, __SAVE_AFTER_S__)
ended = {}

def wait_for_it():
    try:
        result = handle.run_result(timeout=600)
        ended.update(values=result.values, attempts=[a.summary() for a in result.attempts])
    except BaseException as error:
        ended["error"] = f"{type(error).__name__}: {error}"
    ended["at"] = time.time()

threading.Thread(target=wait_for_it, daemon=True).start()
"""


def _read(path: Path) -> dict:
    return json.loads(path.read_text())


@pytest.fixture(scope="module")
def patient_driver(lab_cluster: LabCluster) -> Iterator[DriverKernel]:
    """A second application whose barrier stages outlive a lost executor for 30 s
    (``spark.python.task.killTimeout``) and whose executors can be decommissioned."""
    # The lab's first application holds one core per host: this one gets the other.
    driver = lab_cluster.start_application(
        {
            "spark.cores.max": "3",
            "spark.decommission.enabled": "true",
            "spark.python.task.killTimeout": "30s",
        },
        executors=3,
        SPARKDIST_MLFLOW="0",
    )
    yield driver
    lab_cluster.stop_application(driver)


def _with_executors(driver: DriverKernel, count: int = 3, timeout_s: float = 90.0) -> None:
    """Wait until the application has its executors back (a test restarted a host)."""
    deadline = time.monotonic() + timeout_s
    while (
        driver.check("result = spark.sparkContext._jsc.sc().getExecutorMemoryStatus().size() - 1")
        < count
    ):
        assert time.monotonic() < deadline, "the application got its executors not back"
        time.sleep(0.5)


@pytest.mark.parametrize(
    ("save_after_s", "kill_timeout", "on_store"),
    # save-5s shows Spark's own bound, save-5s-killTimeout-30s the docs' advice; on-the-store:
    # the checkpoints on the lab's S3 server, no directory every host sees holding them (a
    # drain that commits on the store and resumes from it is also test_elastic's grow). -m slow
    # runs these three: the suite's time is bounded (25 min on 2 cores).
    [
        (0.0, None, False),
        pytest.param(5.0, None, False, marks=pytest.mark.slow),
        pytest.param(5.0, "30s", False, marks=pytest.mark.slow),
        pytest.param(0.0, None, True, marks=pytest.mark.slow),
    ],
    ids=["save-at-once", "save-5s", "save-5s-killTimeout-30s", "save-at-once-on-the-store"],
)
def test_sigterm_to_one_hosts_executor_jvm(
    request: pytest.FixtureRequest,
    lab_cluster: LabCluster,
    lab_driver: DriverKernel,
    shared: Path,
    save_after_s: float,
    kill_timeout: str | None,
    on_store: bool,
) -> None:
    lab = lab_cluster.lab
    if kill_timeout is not None:
        lab_driver = request.getfixturevalue("patient_driver")
        _with_executors(lab_driver)
    checkpoints, options = str(shared / "ckpt"), None
    if on_store:
        store = request.getfixturevalue("lab_store")
        request.getfixturevalue("keys_on_every_host")
        checkpoints = f"s3://{store.bucket}/preempted-{time.monotonic_ns()}"
        options = store.storage_options()
    code = RUN.replace("__SHARED__", repr(str(shared))).replace("__STEPS__", "2000")
    code = code.replace("__SAVE_AFTER_S__", repr(save_after_s))
    code = code.replace("__OPTIONS__", repr(options))
    lab_driver.check(code.replace("__CKPT__", repr(checkpoints)))
    deadline = time.monotonic() + 120
    while not all((shared / f"joined-0-{r}").exists() for r in (0, 1)):
        assert time.monotonic() < deadline, "the ranks never met"
        time.sleep(0.05)
    by_name = {h.hostname: h.name for h in lab.hosts.values()}
    joined = {r: _read(shared / f"joined-0-{r}") for r in (0, 1)}
    victim = by_name[joined[1]["host"]]
    app = str(lab_driver.check("result = spark.sparkContext.applicationId"))
    jvm = next(
        p
        for p in lab.processes(victim)
        if any("CoarseGrainedExecutorBackend" in a for a in p["argv"]) and app in p["argv"]
    )
    try:
        time.sleep(1.0)  # some steps in
        struck = time.time()
        lab.signal(jvm["pid"], 15)
        seen: dict[str, float] = {}
        watched = {
            "executor JVM": jvm["pid"],
            "agent": joined[1]["agent"],
            "rank": joined[1]["pid"],
        }
        healthy = by_name[joined[0]["host"]]
        other = {"healthy agent": joined[0]["agent"], "healthy rank": joined[0]["pid"]}
        # Until the victim's processes are gone and the run ended; the healthy node's are noted
        # if they go by then (a task that ended cleanly leaves its Python worker to the next
        # attempt: reused, it never goes).
        while time.time() - struck < 60 and not ({*watched, "at"} <= seen.keys()):
            alive = {p["pid"] for p in lab.processes(victim)}
            for name, pid in watched.items():
                if name not in seen and pid not in alive:
                    seen[name] = time.time() - struck
            alive = {p["pid"] for p in lab.processes(healthy)}
            for name, pid in other.items():
                if name not in seen and pid not in alive:
                    seen[name] = time.time() - struck
            if "at" not in seen:
                ended = lab_driver.check("result = ended if 'at' in ended else None")
                if ended:
                    seen["at"] = ended["at"] - struck
            time.sleep(0.05)
        ended = lab_driver.check("result = ended")
        notices = {p.name: _read(p) for p in shared.glob("notice-0-*")}
        saved = {p.name: _read(p) for p in shared.glob("saved-0-*")}
        print(f"\nSIGTERM to {victim}'s executor JVM (pid {jvm['pid']}), save {save_after_s} s:")
        for name, after in sorted(seen.items(), key=lambda kv: kv[1]):
            print(
                f"  {name} gone {after:.2f} s after"
                if name != "at"
                else f"  run ended {after:.2f} s after"
            )
        for name, fields in sorted(notices.items()):
            print(f"  {name}: {fields['why']} ({fields['time'] - struck:.2f} s after)")
        for name, fields in sorted(saved.items()):
            print(f"  {name}: step {fields['step']} ({fields['time'] - struck:.2f} s after)")
        print(f"  run: {ended}")
        restarted = sorted(p.name for p in shared.glob("joined-1-*"))
        print(f"  restarted ranks: {restarted}")
        # The agent heard SIGHUP from its PySpark daemon, kept its ranks past its JVM's end,
        # and the whole run drained and restarted (without max_restarts).
        assert "values" in ended, ended
        assert ended["attempts"][0].endswith(
            "got SIGHUP (its executor is shutting its Python workers down)"
        ), ended
        assert {n["why"] for n in notices.values()} == {ended["attempts"][0].split(": ", 1)[1]}
        assert seen["agent"] > seen["executor JVM"]
        if save_after_s and kill_timeout is None:
            # Spark kills the healthy node's task (so its agent and ranks) about 2 s
            # (spark.python.task.killTimeout) after it lost the executor: a save that takes
            # longer never happens, and the restart resumes from the last one before.
            assert not saved and ended["values"][0] == ["done", 0, 1], ended
        else:
            steps = {fields["step"] for fields in saved.values()}
            assert len(saved) == 2 and len(steps) == 1, saved
            assert ended["values"] == [["done", *steps, 1]] * 2, ended
    finally:
        lab_cluster.restart_host(victim)


def test_spark_decommissioning_an_executor_drains_the_run_like_a_sigterm(
    lab_cluster: LabCluster, patient_driver: DriverKernel, shared: Path
) -> None:
    # SIGPWR is how a standalone Worker or executor is told to decommission. Spark marks the
    # executor on the driver at once, but its running Python task hears nothing: the driver
    # watches the scheduler and drains the run itself.
    lab = lab_cluster.lab
    driver = patient_driver
    _with_executors(driver)
    try:
        code = RUN.replace("__SHARED__", repr(str(shared))).replace("__STEPS__", "2000")
        driver.check(
            code.replace("__SAVE_AFTER_S__", "0.0")
            .replace("__CKPT__", repr(str(shared / "ckpt")))
            .replace("__OPTIONS__", "None")
        )
        deadline = time.monotonic() + 120
        while not all((shared / f"joined-0-{r}").exists() for r in (0, 1)):
            assert time.monotonic() < deadline, "the ranks never met"
            time.sleep(0.05)
        by_name = {h.hostname: h.name for h in lab.hosts.values()}
        victim = by_name[_read(shared / "joined-0-1")["host"]]
        app = str(driver.check("result = spark.sparkContext.applicationId"))
        jvm = next(
            p
            for p in lab.processes(victim)
            if any("CoarseGrainedExecutorBackend" in a for a in p["argv"]) and app in p["argv"]
        )
        time.sleep(1.0)  # some steps in
        struck = time.time()
        lab.signal(jvm["pid"], 30)  # SIGPWR: decommission
        deadline = time.monotonic() + 120
        while not (ended := driver.check("result = ended if 'at' in ended else None")):
            assert time.monotonic() < deadline, "the decommissioned run never ended"
            time.sleep(0.1)
        saved = {p.name: _read(p) for p in shared.glob("saved-0-*")}
        print(f"\nSIGPWR to {victim}'s executor: saved {saved}, ended {ended['at'] - struck:.2f} s")
        assert "values" in ended, ended
        address = lab.hosts[victim].address
        assert ended["attempts"][0].endswith(
            f"(host {address}): Spark is decommissioning its executor"
        ), ended
        steps = {fields["step"] for fields in saved.values()}
        assert len(saved) == 2 and len(steps) == 1, saved  # both ranks, the same step
        assert max(f["time"] for f in saved.values()) - struck < 5.0, saved  # within a beat
        assert ended["values"] == [["done", *steps, 1]] * 2, ended  # resumed at that step
        assert address not in ended["attempts"][1], ended  # not back on the leaving host
    finally:
        lab_cluster.restart_host(victim)
