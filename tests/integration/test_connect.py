"""The core Spark-mode behaviour over both session kinds: classic and Spark Connect.

(Named to run after the other local[2] files and before local-cluster: one JVM switch each.)
Connect has no SparkContext and no RDD API: the barrier stage is a ``mapInArrow``, conf is
read key by key, and cancellation uses tags.
"""

from __future__ import annotations

import os
import textwrap

import pytest

from sparkdist import Distributor, RunTimeoutError, WorkerFailedError
from tests.conftest import run_processes

pytestmark = pytest.mark.spark


@pytest.fixture(params=["classic", "connect"], scope="module")
def session_kind(request):
    return request.param


@pytest.fixture
def spark(session_kind, request):
    fixture = "spark_local" if session_kind == "classic" else "spark_connect"
    return request.getfixturevalue(fixture)


def all_reduce_rank():
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    total = torch.ones(1)
    dist.all_reduce(total)
    print(f"rank {dist.get_rank()} reduced {total.item()}")
    return dist.get_rank(), total.item()


def test_results_by_rank_and_live_output(spark, capfd):
    result = Distributor(2, local_mode=False, use_gpu=False, spark=spark).run_all(all_reduce_rank)
    assert result.values == [(0, 2.0), (1, 2.0)]
    out, _ = capfd.readouterr()
    assert "[rank 0] rank 0 reduced 2.0" in out and "[rank 1] rank 1 reduced 2.0" in out


def test_script_target(spark, tmp_path, capfd):
    script = tmp_path / "connect_script.py"
    script.write_text(
        textwrap.dedent("""
        import os, sys
        print("script", sys.argv[1:], os.environ["RANK"])
    """)
    )
    Distributor(2, local_mode=False, use_gpu=False, spark=spark).run(str(script), "--x", 1)
    out, _ = capfd.readouterr()
    assert "[rank 1] script ['--x', '1'] 1" in out


def fail_on_rank_one():
    import time

    if os.environ["RANK"] == "1":
        raise ValueError("bad shard")
    time.sleep(120)


def test_failing_rank_is_named_and_nothing_survives(spark):
    with pytest.raises(WorkerFailedError, match="ValueError: bad shard") as info:
        Distributor(2, local_mode=False, use_gpu=False, spark=spark, timeout_s=100).run(
            fail_on_rank_one
        )
    assert info.value.root_cause.rank == 1
    assert not run_processes()


def rows_seen():
    from sparkdist import data

    return data.partition_table().num_rows, data.rows_per_rank()


def test_dataframe_input(spark):
    values = (
        Distributor(2, local_mode=False, use_gpu=False, spark=spark)
        .run_all(rows_seen, spark_dataframe=spark.range(1000))
        .values
    )
    assert sum(v[0] for v in values) == 1000
    assert values[0][1] == values[1][1] == [v[0] for v in values]


def test_timeout_cancels_the_stage(spark):
    def sleepy():
        import time

        time.sleep(120)

    with pytest.raises(RunTimeoutError):
        Distributor(2, local_mode=False, use_gpu=False, spark=spark, timeout_s=3).run(sleepy)
    assert Distributor(2, local_mode=False, use_gpu=False, spark=spark).run(lambda: 7) == 7


def test_without_a_reachable_channel_ranks_rendezvous_through_spark(spark, monkeypatch, capfd):
    """Executors that cannot reach this process: allGather rendezvous, output at the end,
    failures still named with their traceback."""
    monkeypatch.setenv("SPARKDIST_CONTROL_CHANNEL", "off")
    result = Distributor(2, local_mode=False, use_gpu=False, spark=spark).run_all(all_reduce_rank)
    assert result.values == [(0, 2.0), (1, 2.0)]
    out, _ = capfd.readouterr()
    assert out.index("[rank 0] rank 0 reduced") < out.index("[rank 1] rank 1 reduced")
    with pytest.raises(WorkerFailedError, match="ValueError: bad shard") as info:
        Distributor(2, local_mode=False, use_gpu=False, spark=spark, timeout_s=100).run(
            fail_on_rank_one
        )
    assert info.value.root_cause.rank == 1
    assert 'raise ValueError("bad shard")' in info.value.root_cause.traceback
