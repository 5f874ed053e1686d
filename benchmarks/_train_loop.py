"""The DDP training loop that ``steady_state.py`` times, under sparkdist and under torchrun.

A small MLP (in 64, two hidden layers, out 1) trained with DDP over gloo on pre-generated
random batches, so a step is forward, backward (with DDP's gradient all_reduce) and an SGD
update, and nothing else. Each rank times every step with ``time.perf_counter``; the first
``warmup`` steps (DDP builds its buckets, allocators warm up) are not kept.

Under torchrun: ``python _train_loop.py OUT.json STEPS WARMUP HIDDEN [report]``; rank 0 writes
its result to ``OUT.json``.

Non-goals: learning anything (the data is noise), the launch (``launch.py``).
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

INPUT_DIM = 64
BATCH_SIZE = 128
#: Distinct batches, cycled: generating data is not part of a step.
NUM_BATCHES = 16


def ddp_mlp_steps(steps: int, warmup: int, hidden: int, report: bool = False) -> dict[str, Any]:
    """Train for ``warmup + steps`` steps; return this rank's kept step times and settings.

    With ``report``, every step also calls ``sparkdist.runtime.report(step, total, loss)``
    (progress and heartbeat to the driver; a no-op outside sparkdist).
    """
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)  # the same initial weights on every rank
    model = DistributedDataParallel(_mlp(hidden))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    batches = _batches(1 + rank)
    report_step = _reporter() if report else None
    total = warmup + steps
    step_s: list[float] = []
    for step in range(total):
        x, y = batches[step % NUM_BATCHES]
        started = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        if report_step is not None:
            report_step(step=step, total=total, loss=loss.item())
        elapsed = time.perf_counter() - started
        if step >= warmup:
            step_s.append(elapsed)
    dist.destroy_process_group()
    return {
        "rank": rank,
        "step_s": step_s,
        "torch_threads": torch.get_num_threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "parameters": sum(p.numel() for p in model.parameters()),
    }


def torchft_mlp_steps(steps: int, warmup: int, hidden: int) -> dict[str, Any]:
    """``ddp_mlp_steps``'s model and batches across torchft replica groups of one rank each
    (``Distributor(2, replica_groups=2)``): per step, a quorum (torchft's ``Optimizer`` wrapper),
    the gradients averaged with ``runtime.average_gradients`` and a commit vote. A step is
    timed like DDP's: zero_grad (the quorum) through the optimizer step (the commit)."""
    import torch
    import torchft
    from torch import nn

    from sparkdist import runtime

    group = runtime.replica_group()
    torch.manual_seed(0)
    model = _mlp(hidden)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    pg = torchft.ProcessGroupGloo()
    manager = torchft.Manager(
        pg=pg,
        min_replica_size=2,  # every step with both groups: the same work as DDP's
        load_state_dict=model.load_state_dict,
        state_dict=model.state_dict,
        **runtime.torchft_manager_kwargs(pg),
    )
    ft_optimizer = torchft.Optimizer(manager, optimizer)
    batches = _batches(1 + group)
    step_s: list[float] = []
    try:
        for step in range(warmup + steps):
            x, y = batches[step % NUM_BATCHES]
            started = time.perf_counter()
            ft_optimizer.zero_grad(set_to_none=True)
            nn.functional.mse_loss(model(x), y).backward()
            runtime.average_gradients(manager, model)
            ft_optimizer.step()
            elapsed = time.perf_counter() - started
            if step >= warmup:
                step_s.append(elapsed)
    finally:
        manager.shutdown(wait=False)
    return {
        "rank": group,
        "step_s": step_s,
        "torch_threads": torch.get_num_threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "parameters": sum(p.numel() for p in model.parameters()),
    }


def _mlp(hidden: int) -> Any:
    """The timed model: in INPUT_DIM, two hidden layers of ``hidden``, out 1."""
    from torch import nn

    return nn.Sequential(
        nn.Linear(INPUT_DIM, hidden),
        nn.ReLU(),
        nn.Linear(hidden, hidden),
        nn.ReLU(),
        nn.Linear(hidden, 1),
    )


def _batches(seed: int) -> list[Any]:
    """``NUM_BATCHES`` pre-generated (input, target) batches: making data is not a step."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randn(BATCH_SIZE, INPUT_DIM, generator=generator),
            torch.randn(BATCH_SIZE, 1, generator=generator),
        )
        for _ in range(NUM_BATCHES)
    ]


def _reporter() -> Any:
    from sparkdist import runtime

    return runtime.report


def main(argv: list[str]) -> None:
    out, steps, warmup, hidden, *rest = argv
    result = ddp_mlp_steps(int(steps), int(warmup), int(hidden), report=rest == ["report"])
    if result["rank"] == 0:
        with open(out, "w", encoding="utf-8") as sink:
            json.dump(result, sink)


if __name__ == "__main__":
    main(sys.argv[1:])
