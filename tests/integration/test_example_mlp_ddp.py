"""examples/mlp_ddp.py runs, and both sparkdist launchers train the same function identically.

pyspark's launcher is left out here: the example stops the SparkSession it used, which would be
the test session's shared one (tests/integration/test_spark_mode.py compares against pyspark).
"""

from __future__ import annotations

import importlib.util
import sys

from tests.conftest import REPO


def test_mlp_example_gives_the_same_loss_through_both_sparkdist_launchers(monkeypatch, capfd):
    spec = importlib.util.spec_from_file_location("mlp_ddp", REPO / "examples" / "mlp_ddp.py")
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "mlp_ddp", example)
    spec.loader.exec_module(example)

    timings = example.main(["--skip-pyspark", "--epochs", "1", "--samples", "256"])

    assert [name for name, _, _ in timings] == [
        "sparkdist Distributor(...).run",
        "sparkdist @distributed + .distributed",
    ]
    (_, by_distributor, _), (_, by_decorator, _) = timings
    assert by_distributor == by_decorator
    assert by_distributor["world_size"] == 2 and by_distributor["rank"] == 0
    for _, _, timing in timings:  # each launcher: a first call, then a warm one
        assert 0 < timing.first_s and 0 < timing.warm_s
    out, _ = capfd.readouterr()
    assert "[rank 0] epoch 0: loss" in out
    assert "2 rank(s) on this machine, gloo + CPU" in out
    assert "first call  warm call" in out
    assert out.count("[rank 0] epoch 0: loss") == 4  # two launchers, two calls each
