"""What the ranks of ``goodput.py`` run and what they leave behind.

``train(config)`` is the one training function every launcher runs: ``config["steps"]`` steps
of a small DDP model over gloo, each step padded with a sleep to ``step_s`` (the step's compute,
simulated so the figures do not depend on who else uses the cores), and a ``state_mb``
checkpoint (the model and a ballast tensor) every ``checkpoint_every`` steps, by sparkdist's
``runtime.save_checkpoint`` (``async_`` and a drain on notice for ``sparkdist async+drain``) or,
under pyspark, by rank 0 ``torch.save`` as a user would. It writes to the run's directory,
which is how the rest of the benchmark sees it:

- ``rank-N``: each rank's note at entry (relaunch, restart, pid, start time, host): how the
  faults find a rank to strike (``read_note``);
- ``entered.log``: rank 0's time of entry per attempt; ``steps.log``: a line per step rank 0
  finished (relaunch, restart, step, start, end, world size): the figures (``figures_of``);
  under replica groups also ``steps-group-G.log``, the steps group G committed (a step group 0
  missed still counts);
- checkpoints: sparkdist's ``ckpt/step-*/COMMITTED``, or the user's ``user-checkpoint.pt``.

``LAB_DRIVER_CODE`` is the lab driver program's counterpart of the user's retry loop
(``start_run``): it runs ``train`` (whose source the lab driver gets: it is self-contained) on
a thread and writes ``ended.json`` when it is done.

Non-goals: the faults (``_goodput_faults``), the launchers' loops and the table (``goodput.py``).
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any

from _report import rounded

LAB_DRIVER_CODE = """
import json, os, threading, time
import sparkdist

def start_run(config, max_restarts):
    def go():
        ended = {"errors": []}
        stop = os.path.join(config["run_dir"], "stop")
        groups = config.get("replica_groups", 1)
        function = train_groups if groups > 1 else train
        while not os.path.exists(stop):
            try:
                result = sparkdist.Distributor(config["num_processes"], local_mode=False,
                    use_gpu=False, min_processes=config["min_processes"],
                    grow_after_s=config["grow_after_s"], max_restarts=max_restarts,
                    replica_groups=groups,
                    checkpoint_dir=os.path.join(config["run_dir"], "ckpt")).run_all(
                        function, config)
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


def run_config(
    variant: str, run_dir: Path, steps: int, args: argparse.Namespace, **world: Any
) -> dict[str, Any]:
    """``train``'s config for one run: the variant, its directory, ``steps`` and the options;
    ``world``: the lab's ``num_processes``, ``min_processes``, ``grow_after_s`` and
    ``replica_groups``."""
    return {
        "num_processes": 2,
        "min_processes": 1,
        "grow_after_s": None,
        **world,
        "variant": variant,
        "run_dir": str(run_dir),
        "relaunch": 0,
        "steps": steps,
        "step_s": args.step_s,
        "checkpoint_every": args.checkpoint_every,
        "state_mb": args.state_mb,
    }


def train(config: dict[str, Any]) -> dict[str, Any]:
    """``config["steps"]`` steps; checkpoints as ``config["variant"]`` says (the module doc).

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


def train_groups(config: dict[str, Any]) -> dict[str, Any]:
    """``train``'s counterpart for replica groups (torchft): ``config["steps"]`` committed steps
    of the same model, each group one replica, gradients averaged over the quorum with
    ``runtime.average_gradients``; no checkpoints (a lost group heals from a live peer).

    It writes what ``train`` writes, under the run's global rank (group * group size + rank):
    ``rank-N`` notes (the faults strike rank 1's host: group 1's), and group 0's rank 0 logs
    every step it executed to ``steps.log`` (the world column: the groups in the step's quorum);
    a step that did not commit is executed again and counts once. Each other group's first
    rank logs the steps it committed to ``steps-group-G.log``, so a step the run took while
    group 0 was not in the quorum counts too. ``healed.log``: each
    relaunched group's first committed step (restart, time), when it had healed.
    Self-contained, as ``train``.
    """
    import os
    import socket
    import time

    import torch
    import torchft

    from sparkdist import runtime

    run_dir, relaunch = config["run_dir"], config["relaunch"]
    rank = runtime.replica_group() * runtime.get_world_size() + runtime.get_global_rank()
    restart = runtime.restart_count()
    with open("/proc/self/stat") as stat:
        started = stat.read().rsplit(")", 1)[1].split()[19]
    note = os.path.join(run_dir, f"rank-{rank}")
    with open(note + ".tmp", "w") as out:
        out.write(f"{relaunch} {restart} {os.getpid()} {started} {socket.gethostname()}\n")
    os.replace(note + ".tmp", note)
    if rank == 0:
        with open(os.path.join(run_dir, "entered.log"), "a") as out:
            out.write(f"{relaunch} {restart} {time.time():.6f}\n")

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    pg = torchft.ProcessGroupGloo()
    manager = torchft.Manager(
        pg=pg,
        min_replica_size=1,
        load_state_dict=model.load_state_dict,
        state_dict=model.state_dict,
        **runtime.torchft_manager_kwargs(pg),
    )
    ft_optimizer = torchft.Optimizer(manager, optimizer)
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(rank))
    log, committed_log = -1, -1
    if rank == 0:
        log = os.open(os.path.join(run_dir, "steps.log"), os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    elif runtime.get_global_rank() == 0:  # the other groups' committed steps (``figures_of``)
        committed_log = os.open(
            os.path.join(run_dir, f"steps-group-{runtime.replica_group()}.log"),
            os.O_WRONLY | os.O_APPEND | os.O_CREAT,
        )
    healed = restart == 0
    try:
        while manager.current_step() < config["steps"]:
            step, began = manager.current_step(), time.time()
            ft_optimizer.zero_grad()
            model(x).pow(2).mean().backward()
            runtime.average_gradients(manager, model)
            ft_optimizer.step()
            time.sleep(config["step_s"])
            participants = manager.num_participants()
            line = f"{relaunch} {restart} {step} {began:.6f} {time.time():.6f} {participants}\n"
            if log >= 0:
                os.write(log, line.encode())
            if committed_log >= 0 and manager.current_step() > step:
                os.write(committed_log, line.encode())
            if not healed and manager.current_step() > step:
                healed = True
                with open(os.path.join(run_dir, "healed.log"), "a") as out:
                    out.write(f"{restart} {time.time():.6f}\n")
    finally:
        manager.shutdown(wait=False)
    return {"step": manager.current_step()}


def read_note(run_dir: Path, rank: int) -> dict[str, Any] | None:
    """Rank ``rank``'s latest note: its attempt, pid, start time and host (None: no note)."""
    try:
        fields = (run_dir / f"rank-{rank}").read_text().split()
    except FileNotFoundError:
        return None
    attempt = [int(fields[0]), int(fields[1])]
    return {"attempt": attempt, "pid": int(fields[2]), "started": fields[3], "host": fields[4]}


def figures_of(
    run_dir: Path,
    steps: int,
    started: float,
    wall_s: float,
    strikes: list[dict[str, Any]],
    finished: bool,
) -> dict[str, Any]:
    """Goodput, steps lost per fault, recovery, from rank 0's ``steps.log``."""
    attempts = attempts_seen(run_dir)
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
    # Replica groups: a step the run committed while group 0 was not in the quorum (it started
    # late, or healed past it) was the run's progress all the same: it counts as another group
    # took it (the first group's log that has it).
    for other in sorted(run_dir.glob("steps-group-*.log")):
        for line in other.read_text().splitlines():
            _, _, step_text, began_text, ended_text, _ = line.split()
            last.setdefault(int(step_text), (float(began_text), float(ended_text)))
    counted = steps if finished else checkpointed_step(run_dir)
    # A step counts for at most the run's median step: what a step spent waiting (on a quorum
    # that drops a lost group, on a checkpoint save) is not useful time.
    typical = statistics.median(e - b for b, e in last.values()) if last else 0.0
    useful = sum(min(e - b, typical) for s, (b, e) in last.items() if s < counted)
    first_step = min((b for b, _ in last.values()), default=started) - started
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
    stalls = []  # from each fault to the next step that got further than any begun before it
    for strike in strikes:
        before = [r[1] for r in rows if r[2] < strike["at"]]
        further = [r[3] for r in rows if r[2] >= strike["at"] and r[1] > max(before, default=-1)]
        if further:
            stalls.append(min(further) - strike["at"])
    heals = []  # replica groups: from each fault to the relaunched group's first committed step
    if (run_dir / "healed.log").exists():
        healed_at = [
            float(line.split()[1])
            for line in (run_dir / "healed.log").read_text().split("\n")
            if line
        ]
        for strike in strikes:
            after = [at for at in healed_at if at >= strike["at"]]
            if after:
                heals.append(min(after) - strike["at"])
    step_times = sorted(e - b for b, e in last.values())
    timeline = [  # every step executed, for the plot: [start, end] after the launch, world
        [rounded(b - started, 2), rounded(e - started, 2), w] for _, _, b, e, w in rows
    ]
    return {
        "finished": finished,
        "wall_s": rounded(wall_s, 2),
        "goodput": rounded(useful / wall_s if wall_s else None, 3),
        # The same from the run's first step: the faults' cost alone, without the start-up.
        "goodput_from_first_step": rounded(
            useful / (wall_s - first_step) if wall_s > first_step else None, 3
        ),
        "first_step_s": rounded(first_step, 2),
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
        "stall_s": rounded(statistics.median(stalls) if stalls else None, 2),
        "stalls_s": [rounded(s, 2) for s in stalls],
        "heal_s": rounded(statistics.median(heals) if heals else None, 2),
        "lost_by_attempt": lost_by_attempt,
        "step_s_median": rounded(step_times[len(step_times) // 2] if step_times else None, 3),
        "worlds": sorted({r[4] for r in rows}),
        "strikes_s": [rounded(s["at"] - started, 1) for s in strikes],  # after the launch
        "rates": rates_around(timeline, [s["at"] - started for s in strikes]),
        "timeline": timeline,
    }


def rates_around(timeline: list[list[Any]], strikes_s: list[float]) -> list[dict[str, Any]]:
    """Steps per second between one fault and the next (the first span from the launch), and
    the world sizes that ran in it: how fast the run went before and after each fault."""
    bounds = [0.0, *strikes_s, max((e for _, e, _ in timeline), default=0.0)]
    spans = []
    for begin, end in zip(bounds, bounds[1:], strict=False):
        inside = [(e, w) for _, e, w in timeline if begin <= e < end]
        spans.append(
            {
                "from_s": rounded(begin, 1),
                "to_s": rounded(end, 1),
                "steps_per_s": rounded(len(inside) / (end - begin), 2) if end > begin else None,
                "worlds": sorted({w for _, w in inside}),
            }
        )
    return spans


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
