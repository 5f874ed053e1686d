"""A user's tests of the MLP training function in examples/mlp_ddp.py, on a laptop or in CI.

No conftest: installing sparkdist registers its pytest plugin, which provides ``distributed``
(and ``spark``), the ``gpu`` / ``multi_gpu(n)`` markers and the mode option::

    pytest examples/tests                          # ranks are processes of this machine
    pytest examples/tests --sparkdist-mode=spark   # the same tests, as Spark barrier stages

Without a GPU the GPU tests are skipped (``-rs`` shows why), and the rest train on CPU with
gloo; on a GPU machine they all run.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

from sparkdist import WorkerFailedError

# examples/ is a folder of scripts, not a package; a real project imports its own package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mlp_ddp import train

SMALL = {"samples": 256, "batch_size": 32, "lr": 1e-2, "hidden": 16}


def test_every_rank_ends_with_the_loss_they_reduced_together(distributed):
    run = distributed(n=2)

    results = run(train, epochs=1, **SMALL)

    assert [r["rank"] for r in results] == [0, 1]
    assert {r["world_size"] for r in results} == {2}
    assert {r["device"] for r in results} == {"cpu"}
    assert math.isfinite(results[0]["loss"])
    assert results[0]["loss"] == results[1]["loss"]  # all-reduced: one loss for the world


def test_more_epochs_give_a_lower_loss(distributed):
    run = distributed(n=2)

    one_epoch = run(train, epochs=1, **SMALL)[0]["loss"]
    four_epochs = run(train, epochs=4, **SMALL)[0]["loss"]

    assert four_epochs < one_epoch


def test_a_bad_argument_fails_the_run_with_the_ranks_traceback(distributed):
    with pytest.raises(WorkerFailedError, match="batch_size"):
        distributed(n=2)(train, epochs=1, **{**SMALL, "batch_size": 0})


@pytest.mark.gpu
def test_trains_on_a_gpu(distributed):
    (result,) = distributed(n=1)(train, epochs=1, **SMALL)

    assert result["device"] == "cuda"


@pytest.mark.multi_gpu(2)
def test_ddp_over_two_gpus_agrees_on_the_loss(distributed):
    results = distributed()(train, epochs=1, **SMALL)  # n comes from multi_gpu(2)

    assert {r["device"] for r in results} == {"cuda"}
    assert results[0]["loss"] == results[1]["loss"]
