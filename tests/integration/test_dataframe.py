"""Training on a Spark DataFrame: each rank streams its own partition; nothing is collected on
the driver; equal steps per rank."""

from __future__ import annotations

import pytest

from sparkdist import ConfigError, Distributor, WorkerFailedError
from tests.conftest import run_processes

pytestmark = pytest.mark.spark


def my_ids():
    from sparkdist import data

    table = data.partition_table()
    return {"ids": sorted(table.column("id").to_pylist()), "counts": data.rows_per_rank()}


def test_rows_are_disjoint_and_together_equal_the_dataframe(spark_local):
    df = spark_local.range(10_000)
    result = Distributor(2, local_mode=False, use_gpu=False).run_all(my_ids, spark_dataframe=df)
    first, second = (set(v["ids"]) for v in result.values)
    assert first and second and first.isdisjoint(second)
    assert first | second == set(range(10_000))
    counts = result.values[0]["counts"]
    assert counts == result.values[1]["counts"] == [len(first), len(second)]


def equal_steps(policy):
    import torch

    from sparkdist import data

    dataset = data.partition_dataset(["id"], equalize=policy)
    loader = torch.utils.data.DataLoader(dataset, batch_size=1, num_workers=2)
    seen = torch.cat([batch for batch in loader])
    return {
        "steps": len(loader),
        "rows": len(dataset),
        "own": dataset.own_rows,
        "unique": len(set(seen.tolist())),
    }


@pytest.mark.parametrize("policy", ["drop", "wrap", None])
def test_uneven_partitions_still_give_equal_steps(spark_local, policy):
    # 1001 rows cannot split evenly over 2 ranks.
    result = Distributor(2, local_mode=False, use_gpu=False).run_all(
        equal_steps, policy, spark_dataframe=spark_local.range(1001, numPartitions=3)
    )
    owns = sorted(v["own"] for v in result.values)
    assert sum(owns) == 1001 and owns[0] < owns[1]
    steps = {v["steps"] for v in result.values}
    if policy is None:
        assert len(steps) == 2  # unequal: this is what would hang DDP
    else:
        assert steps == {owns[0] if policy == "drop" else owns[1]}
    for value in result.values:  # wrap-around repeats own rows; nothing else repeats
        assert value["unique"] == min(value["own"], value["rows"])


def tensors_of_row_zero():
    from sparkdist import data

    dataset = data.partition_dataset(["dense", "sparse", "floats", "ints", "label"])
    return [(t.dtype, t.tolist()) for t in dataset[0]]


def test_vector_and_array_columns_arrive_as_tensors(spark_local):
    import torch
    from pyspark.ml.linalg import Vectors

    rows = [
        (
            Vectors.dense([1.0, 2.0, 3.0]),
            Vectors.sparse(4, [1, 3], [5.0, 7.0]),
            [0.5, 1.5],
            [1, 2, 3],
            1,
        )
        for _ in range(40)
    ]
    df = spark_local.createDataFrame(rows, ["dense", "sparse", "floats", "ints", "label"])
    values = (
        Distributor(2, local_mode=False, use_gpu=False)
        .run_all(tensors_of_row_zero, spark_dataframe=df)
        .values
    )
    assert values[0] == [
        (torch.float32, [1.0, 2.0, 3.0]),
        (torch.float32, [0.0, 5.0, 0.0, 7.0]),
        (torch.float32, [0.5, 1.5]),
        (torch.int64, [1, 2, 3]),
        (torch.int64, 1),
    ]


def fit_linear(epochs):
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from sparkdist import data

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(3, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = torch.utils.data.DataLoader(
        data.partition_dataset(["features", "target"]), batch_size=64, shuffle=True
    )
    losses = []
    for _ in range(epochs):
        for features, target in loader:
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(features).squeeze(1), target)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    return losses[0], sum(losses[-5:]) / 5


def test_model_learns_from_a_dataframe(spark_local):
    from pyspark.sql import functions as F

    df = (
        spark_local.range(2000)
        .withColumn("a", F.rand(1))
        .withColumn("b", F.rand(2))
        .withColumn("c", F.rand(3))
        .select(
            F.array("a", "b", "c").alias("features"),
            (2 * F.col("a") - F.col("b") + 0.5 * F.col("c") + 1).alias("target"),
        )
    )
    first, last = Distributor(2, local_mode=False, use_gpu=False).run(
        fit_linear, 5, spark_dataframe=df
    )
    assert last < 0.5 * first


def test_empty_dataframe_is_refused_clearly(spark_local):
    with pytest.raises(ConfigError, match="the DataFrame has no rows"):
        Distributor(2, local_mode=False, use_gpu=False).run(
            my_ids, spark_dataframe=spark_local.range(0)
        )
    assert not run_processes()


def test_a_column_that_cannot_become_a_tensor_is_named(spark_local):
    df = spark_local.createDataFrame([(f"n{i}", i) for i in range(20)], ["name", "label"])

    def use_all_columns():
        from sparkdist import data

        data.partition_dataset()

    with pytest.raises(WorkerFailedError, match="column 'name' has type string"):
        Distributor(2, local_mode=False, use_gpu=False).run(use_all_columns, spark_dataframe=df)


def test_a_rank_without_rows_is_refused_before_training(spark_local):
    with pytest.raises(ConfigError, match=r"got no rows of the DataFrame \(rows per rank"):
        Distributor(2, local_mode=False, use_gpu=False).run(
            my_ids, spark_dataframe=spark_local.range(1)
        )


def test_local_mode_with_a_dataframe_explains_what_to_do(spark_local):
    with pytest.raises(ConfigError, match="pass local_mode=False"):
        Distributor(2, local_mode=True, use_gpu=False).run(
            my_ids, spark_dataframe=spark_local.range(10)
        )


def test_pysparks_private_train_on_dataframe_works(spark_local):
    from sparkdist import TorchDistributor

    value = TorchDistributor(2, local_mode=False, use_gpu=False)._train_on_dataframe(
        my_ids, spark_local.range(100)
    )
    assert len(value["ids"]) == value["counts"][0]


def two_epochs_of_ids():
    import torch.distributed as dist

    from sparkdist import data

    dist.init_process_group("gloo")
    loader = data.loader(["id"], batch_size=4)
    epochs: list[list[int]] = [[], []]
    steps = [0, 0]
    while loader.epoch < 2:
        epoch = loader.epoch
        for ids in loader:
            epochs[epoch].extend(ids.tolist())
            steps[epoch] += 1
    dist.destroy_process_group()
    return {"epochs": epochs, "steps": steps}


def test_a_sharded_dataframe_gives_every_row_once_per_epoch_in_lockstep(spark_local):
    from sparkdist import data

    df = spark_local.range(50)
    result = Distributor(2, local_mode=False, use_gpu=False).run_all(
        two_epochs_of_ids, spark_dataframe=data.sharded(df, key="id", shards=6, seed=3)
    )
    first, second = result.values
    assert first["steps"] == second["steps"]  # the same number of batches on every rank
    for epoch in (0, 1):
        assert sorted(first["epochs"][epoch] + second["epochs"][epoch]) == list(range(50))
    # A new order each epoch (the seed and the epoch decide it, not the world).
    assert first["epochs"][0] + second["epochs"][0] != first["epochs"][1] + second["epochs"][1]
    assert not run_processes()
