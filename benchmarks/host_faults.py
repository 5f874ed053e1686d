"""Host faults in the multi-host lab, timed: a host killed, a host cut off, and a restart onto
the hosts left, for sparkdist and (where it can run the same scenario) pyspark's
``TorchDistributor``, in the same lab and the same run.

One lab (``sparkdist._lab``): the driver's host and three worker hosts whose names resolve
well (so pyspark's class can run at all), one slot per host for the driver's application.
Each scenario runs 2 ranks on 2 hosts that meet in ``all_reduce`` and then wait; the fault
strikes rank 1's host; the time is from the fault (the benchmark's clock) to ``run()``
raising (the lab driver's clock: one machine, one clock):

- ``kill``: every process of the host SIGKILLed;
- ``cut``: the host's switch port down (packets dropped, nothing closes); pyspark's class is
  given ``--pyspark-cut-cap-s`` at most (it waits for Spark's own timeouts);
- ``restart`` (sparkdist only: pyspark's class has no restarts): 3 hosts, ``max_restarts=1``,
  a checkpoint per step on the shared directory; the time from the kill to the restarted
  attempt's training function starting, and to its first step.

Usage::

    python benchmarks/host_faults.py             # 3 runs of each, pyspark once each
    python benchmarks/host_faults.py --quick     # 1 run of each, no pyspark cut
    python benchmarks/host_faults.py --restart-only --runs 5   # the restart alone
    python benchmarks/host_faults.py --restart-only --kill-at-step 40   # a fault ~8 s in

Needs root (or user namespaces): the lab's rule, see docs/testing.md. Every byte stays inside
the lab's namespaces.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from _report import markdown_table

from sparkdist._lab.spark import DriverKernel, LabCluster, start_lab_cluster
from sparkdist._lab.support import probe

DRIVER_CODE = """
import json, os, socket, threading, time
import sparkdist
from pyspark.ml.torch.distributor import TorchDistributor

def waits(shared):
    import json, os, socket, time
    import torch
    import torch.distributed as dist
    dist.init_process_group("gloo")
    total = torch.ones(1)
    dist.all_reduce(total)
    path = os.path.join(shared, f"joined-{dist.get_rank()}")
    with open(path + ".tmp", "w") as f:
        json.dump({"host": socket.gethostname()}, f)
    os.replace(path + ".tmp", path)
    time.sleep(300)

def train(shared, steps):
    import os, time
    import torch
    import torch.distributed as dist
    from sparkdist import runtime
    entered = time.time()
    dist.init_process_group("gloo")
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
    found = runtime.load_checkpoint()
    start = 0 if found is None else found.step + 1
    for step in range(start, steps):
        model(torch.ones(2, 4)).sum().backward()
        if step == start:
            name = f"first-step-{runtime.restart_count()}-{dist.get_rank()}"
            with open(os.path.join(shared, name + ".tmp"), "w") as f:
                json.dump({"entered": entered, "stepped": time.time()}, f)
            os.replace(os.path.join(shared, name + ".tmp"), os.path.join(shared, name))
        runtime.save_checkpoint({"w": model.module.weight.detach()}, step)
        time.sleep(0.2)
    dist.destroy_process_group()

ended = {}

def start(kind, shared, steps=60):
    ended.clear()
    def go():
        try:
            if kind == "pyspark":
                TorchDistributor(num_processes=2, local_mode=False, use_gpu=False).run(
                    waits, shared)
            elif kind == "restart":
                sparkdist.Distributor(2, local_mode=False, use_gpu=False, max_restarts=1,
                                      checkpoint_dir=os.path.join(shared, "ckpt")).run(
                    train, shared, steps)
            else:
                sparkdist.Distributor(2, local_mode=False, use_gpu=False).run(waits, shared)
            ended["error"] = None
        except BaseException as error:
            text = f"{type(error).__name__}: {error}"
            ended["error"], ended["error_chars"] = text[:300], len(text)
        ended["at"] = time.time()
    threading.Thread(target=go, daemon=True).start()
"""


def _wait_file(path: Path, timeout_s: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path.name} never came")
        time.sleep(0.02)
    return json.loads(path.read_text())  # type: ignore[no-any-return]


def _ended(driver: DriverKernel, timeout_s: float) -> dict[str, Any] | None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ended = driver.check("result = ended if 'at' in ended else None")
        if ended:
            return ended  # type: ignore[no-any-return]
        time.sleep(0.05)
    return None


def fault_run(cluster: LabCluster, kind: str, fault: str, cap_s: float) -> dict[str, Any]:
    """One run of ``kind`` ("sparkdist", "pyspark") under ``fault`` ("kill", "cut")."""
    lab, driver = cluster.lab, cluster.driver
    assert driver is not None
    shared = lab.shared / f"{kind}-{fault}-{time.monotonic_ns()}"
    shared.mkdir()
    driver.check(f"start({kind!r}, {str(shared)!r})")
    by_name = {h.hostname: h.name for h in lab.hosts.values()}
    victim = by_name[_wait_file(shared / "joined-1", 180)["host"]]
    _wait_file(shared / "joined-0", 30)
    time.sleep(1.0)  # the ranks settle into their wait
    struck = time.time()
    if fault == "kill":
        lab.kill_host(victim)
    else:
        lab.cut(victim)
    ended = _ended(driver, cap_s)
    if fault == "kill":
        cluster.restart_host(victim)
    elif kind == "sparkdist":
        cluster.heal_host(victim)  # its Worker and executor lived on behind the cut
    else:
        if ended is None:  # pyspark's job still "runs": cancel it before the host comes back
            driver.check("spark.sparkContext.cancelAllJobs()")
            _ended(driver, 60)
        # Spark's own timeouts may have given up the host's Worker and moved its executor.
        lab.heal(victim)
        cluster.restart_host(victim, timeout_s=150)
    seconds = None if ended is None else ended["at"] - struck
    error = "" if ended is None else str(ended["error"])
    chars = 0 if ended is None else int(ended.get("error_chars", len(error)))
    return {"seconds": seconds, "error_chars": chars, "error": error[:160]}


def restart_run(cluster: LabCluster, kill_at_step: int) -> dict[str, float]:
    lab, driver = cluster.lab, cluster.driver
    assert driver is not None
    shared = lab.shared / f"restart-{time.monotonic_ns()}"
    shared.mkdir()
    driver.check(f"start('restart', {str(shared)!r}, steps={kill_at_step + 55})")
    _wait_file(shared / "first-step-0-0", 180)
    while not (shared / "ckpt" / f"step-{kill_at_step:09d}" / "COMMITTED").exists():
        time.sleep(0.02)
    victim = sorted({p["host"] for p in lab.rank_processes()})[-1]
    struck = time.time()
    lab.kill_host(victim)
    first = _wait_file(shared / "first-step-1-0", 180)
    last_entered = max(first["entered"], _wait_file(shared / "first-step-1-1", 30)["entered"])
    _ended(driver, 180)
    cluster.restart_host(victim)
    return {
        "kill_to_function": first["entered"] - struck,
        "kill_to_first_step": first["stepped"] - struck,
        "function_start_up": first["stepped"] - first["entered"],
        "kill_to_last_rank_function": last_entered - struck,  # the slower host's rank
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--pyspark-cut-cap-s", type=float, default=150.0)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--restart-only", action="store_true", help="only the restart scenario")
    parser.add_argument(
        "--kill-at-step",
        type=int,
        default=5,
        help="the restart scenario kills a host once this step is committed (a step: ~0.2 s)",
    )
    args = parser.parse_args()
    if args.quick:
        args.runs = 1
    support = probe()
    if not support.ok:
        raise SystemExit(f"the lab cannot run here: {support.reason}")
    figures: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="sparkdist-host-faults-") as tmp:
        cluster = start_lab_cluster(Path(tmp), 3)
        try:
            driver = cluster.start_driver(SPARKDIST_MLFLOW="0")
            driver.check(DRIVER_CODE)
            for fault in () if args.restart_only else ("kill", "cut"):
                runs = [fault_run(cluster, "sparkdist", fault, 120) for _ in range(args.runs)]
                figures[f"sparkdist {fault}"] = runs
                if fault == "kill" or not args.quick:
                    cap = 120 if fault == "kill" else args.pyspark_cut_cap_s
                    figures[f"pyspark {fault}"] = [fault_run(cluster, "pyspark", fault, cap)]
            figures["sparkdist restart"] = [
                restart_run(cluster, args.kill_at_step) for _ in range(args.runs)
            ]
        finally:
            cluster.lab.close()
    rows = []
    for name, runs in figures.items():
        if name.endswith("restart"):
            continue
        times = [r["seconds"] for r in runs if r["seconds"] is not None]
        median = f"{statistics.median(times):.2f} s" if times else "no end within the cap"
        rows.append([name, median, len(runs), runs[0]["error_chars"], repr(runs[0]["error"][:80])])
    header = ["scenario", "seconds from the fault (median)", "runs", "error length"]
    print(markdown_table([*header, "error starts"], rows))
    restarts = figures["sparkdist restart"]
    for key in restarts[0]:
        print(f"restart {key}: {statistics.median(r[key] for r in restarts):.2f} s")
    print(json.dumps({"figures": figures, "time": time.strftime("%Y-%m-%d %H:%M:%S")}))


if __name__ == "__main__":
    main()
