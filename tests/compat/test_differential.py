"""Each case runs against pyspark's distributor and sparkdist's, in this session, and both must
show the same thing: where an exception leaves the user's call and an ``except`` of pyspark's
type catching ours, the value ``run`` returns, the warnings on the class's logger, the
attributes.

Cheap cases (construction, conf checks) are many; real runs are few, since pyspark's cost
seconds each. What differs on purpose is not here but in docs/launching.md.
"""

from __future__ import annotations

import json
import os
import sys
from contextlib import contextmanager

import pytest

from tests.compat.side_by_side import assert_refused_where_pyspark_3_hangs, assert_same, both

pytest.importorskip("pyspark")
pytestmark = pytest.mark.spark

GPU = "spark.task.resource.gpu.amount"
SSL = "spark.ssl.enabled"
TORCH_OPT_OUT = "pytorch.spark.distributor.ignoreSsl"
DEEPSPEED_OPT_OUT = "deepspeed.spark.distributor.ignoreSsl"


@contextmanager
def runtime_conf(spark, **settings):
    """Set Spark conf at runtime (``spark.conf.set``), as users do, and unset it after."""
    for key, value in settings.items():
        spark.conf.set(key.replace("__", "."), value)
    try:
        yield
    finally:
        for key in settings:
            spark.conf.unset(key.replace("__", "."))


def conf(**pairs):
    """Spark conf keys as keyword names: dots spelled as double underscores."""
    return {key.replace(".", "__"): value for key, value in pairs.items()}


@pytest.fixture
def by_value():
    """pyspark pickles this module's functions by reference, and its ranks cannot import it:
    ship it by value for pyspark (sparkdist does that on its own)."""
    from pyspark import cloudpickle

    module = sys.modules[__name__]
    cloudpickle.register_pickle_by_value(module)
    yield
    cloudpickle.unregister_pickle_by_value(module)


# -- construction: the GPU conf, checked when the distributor is made -------------------------


@pytest.mark.parametrize(
    ("settings", "kwargs"),
    [
        ({}, {"num_processes": 2, "local_mode": False, "use_gpu": True}),  # amount unset
        ({GPU: "0"}, {"num_processes": 2, "local_mode": False, "use_gpu": True}),
        ({GPU: "2"}, {"num_processes": 3, "local_mode": False, "use_gpu": True}),  # 3 % 2
        ({GPU: "2"}, {"num_processes": 4, "local_mode": False, "use_gpu": True}),  # 2 tasks
        ({GPU: "1"}, {"num_processes": 2, "local_mode": False, "use_gpu": True}),
        ({GPU: "1.5"}, {"num_processes": 2, "local_mode": False, "use_gpu": True}),
        ({GPU: "2"}, {"num_processes": 3, "local_mode": False, "use_gpu": False}),
        ({}, {"num_processes": 2, "local_mode": True, "use_gpu": True}),  # no driver GPU
        ({}, {"num_processes": 0, "local_mode": True, "use_gpu": True}),  # GPU check first
        ({}, {"num_processes": 0, "local_mode": False, "use_gpu": False}),
        ({}, {"num_processes": -2, "local_mode": True, "use_gpu": False}),
        ({}, {"num_processes": None, "local_mode": True, "use_gpu": False}),
        ({}, {"num_processes": "2", "local_mode": False, "use_gpu": False}),
        ({}, {}),  # pyspark's defaults: local, GPU (none here)
    ],
)
def test_torch_distributor_construction(spark_local, settings, kwargs):
    with runtime_conf(spark_local, **conf(**settings)):
        theirs, ours = both("TorchDistributor", kwargs)
    remote_gpus = kwargs.get("use_gpu") and kwargs.get("local_mode") is False
    if remote_gpus and _indivisible(settings, kwargs["num_processes"]):
        assert_refused_where_pyspark_3_hangs(theirs, ours)
    else:
        assert_same(theirs, ours)


def _indivisible(settings: dict[str, str], processes: int) -> bool:
    amount = settings.get(GPU, "")
    return amount.isdigit() and int(amount) > 1 and processes % int(amount) != 0


@pytest.mark.parametrize(
    ("settings", "kwargs"),
    [
        ({}, {"numGpus": True, "useGpu": False}),  # True counts as 1
        ({}, {"numGpus": 2, "nnodes": 3, "useGpu": False}),
        ({}, {"numGpus": True, "nnodes": True, "localMode": False, "useGpu": False}),
        ({}, {"numGpus": 0, "useGpu": False}),
        ({}, {"numGpus": 1, "nnodes": 0, "localMode": False, "useGpu": False}),
        ({}, {"numGpus": 2}),  # local GPU mode without a driver GPU
        ({}, {"numGpus": 2, "nnodes": 2, "localMode": False}),  # amount unset
        ({GPU: "2"}, {"numGpus": 2, "nnodes": 2, "localMode": False}),
        ({GPU: "2"}, {"numGpus": 3, "nnodes": 1, "localMode": False}),
        ({GPU: "3"}, {"numGpus": 3, "nnodes": 2, "localMode": False}),
        ({}, {"numGpus": 2, "useGpu": False, "deepspeedConfig": {"train_batch_size": 4}}),
    ],
)
def test_deepspeed_distributor_construction(spark_local, settings, kwargs):
    with runtime_conf(spark_local, **conf(**settings)):
        theirs, ours = both("DeepspeedTorchDistributor", kwargs)
    processes = kwargs["numGpus"] * kwargs.get("nnodes", 1)
    remote_gpus = kwargs.get("useGpu", True) and kwargs.get("localMode") is False
    if remote_gpus and _indivisible(settings, processes):
        assert_refused_where_pyspark_3_hangs(theirs, ours)
    else:
        assert_same(theirs, ours)


# -- SSL: refused at run() on a cluster unless the runtime conf opts out ----------------------


def rank_and_world():
    import os

    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


@pytest.mark.parametrize("name", ["TorchDistributor", "DeepspeedTorchDistributor"])
def test_ssl_without_the_opt_out_fails_at_run(spark_local, name):
    kwargs = (
        {"num_processes": 2, "local_mode": False, "use_gpu": False}
        if name == "TorchDistributor"
        else {"numGpus": 2, "localMode": False, "useGpu": False}
    )
    # pytorch's opt-out does not cover the DeepSpeed class: it has its own key.
    with runtime_conf(spark_local, **conf(**{SSL: "true", TORCH_OPT_OUT: "false"})):
        theirs, ours = both(name, kwargs, lambda d: d.run(rank_and_world))
    assert theirs.raised_in == "run"
    assert_same(theirs, ours)


# -- a real Spark-mode run: SSL on with the runtime opt-out, a DataFrame through pyspark's own
#    partition loader (one run covers both: pyspark's Spark-mode runs cost tens of seconds here)


def rows_through_pysparks_loader(num_samples):
    import os

    import torch.distributed as dist
    from pyspark.ml.torch.distributor import _get_spark_partition_data_loader

    dist.init_process_group("gloo")
    ids, kinds = set(), set()
    for batch in _get_spark_partition_data_loader(num_samples, batch_size=8, num_workers=0):
        ids.update(int(i) for i in batch[0])
        kinds.add((type(batch[0]).__name__, tuple(batch[1].shape[1:])))
    own = None
    if "SPARKDIST_PARTITION_FILE" in os.environ:  # under sparkdist: its own reader, same rows
        from sparkdist import data

        own = {
            "rows": sorted(data.partition_table().column("id").to_pylist()),
            "counts": data.rows_per_rank(),
        }
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (sorted(ids), own))
    dist.destroy_process_group()
    return {
        "ids": [seen for seen, _ in everyone],
        "sparkdist": [own for _, own in everyone],
        "kinds": sorted(kinds),
    }


def test_ssl_opt_out_and_dataframe_through_pysparks_loader(spark_local, by_value):
    from pyspark.ml.linalg import Vectors

    rows = [(i, Vectors.dense([float(i), 1.0])) for i in range(40)]
    df = spark_local.createDataFrame(rows, ["id", "features"]).repartition(2)
    kwargs = {"num_processes": 2, "local_mode": False, "use_gpu": False}
    with runtime_conf(spark_local, **conf(**{SSL: "true", TORCH_OPT_OUT: "true"})):
        # 25 samples of ~20 rows per rank: the loader wraps round its own rows.
        theirs, ours = both(
            "TorchDistributor",
            kwargs,
            lambda d: d._train_on_dataframe(rows_through_pysparks_loader, df, 25),
        )
    assert len(theirs.warnings) == 1  # the SSL opt-out, said on the class's logger
    assert_same(theirs, ours, compare_value=False)  # which rows land on which rank differs
    for seen in (theirs.value, ours.value):
        first, second = (set(ids) for ids in seen["ids"])
        assert first and second and first.isdisjoint(second)
        assert first | second == set(range(40))  # each rank its own rows; all rows seen
    assert ours.value["kinds"] == theirs.value["kinds"] == [("Tensor", (2,))]
    # In the same run, sparkdist.data reads exactly the rows pyspark's loader read (one file).
    counts = [len(ids) for ids in ours.value["ids"]]
    for ids, own in zip(ours.value["ids"], ours.value["sparkdist"], strict=True):
        assert own == {"rows": ids, "counts": counts}


# -- refusals at run(): what pyspark raises before (or instead of) training ---------------------


def fail_on_every_rank():
    raise ValueError("the training function failed")


@pytest.mark.parametrize(
    "case", ["dataframe in local mode", "keywords for a script", "a failing function"]
)
def test_refused_or_failed_at_run(spark_local, tmp_path, by_value, case):
    script = tmp_path / "args_script.py"
    script.write_text(ARGS_SCRIPT)
    kwargs = {"num_processes": 2, "local_mode": True, "use_gpu": False}
    run = {
        "dataframe in local mode": lambda d: d._train_on_dataframe(
            rank_and_world, spark_local.range(4)
        ),
        "keywords for a script": lambda d: d.run(str(script), lr=0.1),
        # pyspark: RuntimeError("...failed during training"); ours: WorkerFailedError, also one.
        "a failing function": lambda d: d.run(fail_on_every_rank),
    }[case]
    theirs, ours = both("TorchDistributor", kwargs, run)
    assert theirs.raised_in == "run"
    assert_same(theirs, ours)


# -- script targets with arguments (local mode) ---------------------------------------------

# The ranks under pyspark's torchrun share one pipe, so each marked line is one write(2) (atomic
# below PIPE_BUF): print() may write a line in pieces, and two ranks' pieces interleave there.
ARGS_SCRIPT = """
import os, sys
words = ["ARGS", os.environ["RANK"], os.environ["WORLD_SIZE"], sys.argv[1:]]
os.write(1, (" ".join(map(str, words)) + "\\n").encode())
"""


def marked_lines(out, mark):
    """The lines a run printed that start with ``mark``, without sparkdist's rank prefix."""
    lines = set()
    for line in out.splitlines():
        line = line.split("] ", 1)[1] if line.startswith("[rank ") else line
        if line.startswith(mark):
            lines.add(line)
    return lines


def run_and_capture(capfd, make_run, mark):
    """(observed pair, [pyspark's marked lines, ours]) for a run that prints ``mark`` lines."""
    captured = []

    def run(distributor):
        capfd.readouterr()
        try:
            return make_run(distributor)
        finally:
            captured.append(marked_lines(capfd.readouterr().out, mark))

    return run, captured


def test_script_with_arguments(spark_local, tmp_path, capfd):
    script = tmp_path / "args_script.py"
    script.write_text(ARGS_SCRIPT)
    kwargs = {"num_processes": 2, "local_mode": True, "use_gpu": False}
    run, captured = run_and_capture(
        capfd, lambda d: d.run(str(script), "--lr", 0.5, "--name", "a b"), "ARGS"
    )
    theirs, ours = both("TorchDistributor", kwargs, run)
    assert_same(theirs, ours)
    assert theirs.value is None
    expected = {f"ARGS {rank} 2 ['--lr', '0.5', '--name', 'a b']" for rank in (0, 1)}
    assert captured[0] == captured[1] == expected


# -- DeepSpeed: a dict config and a file config reach a script as pyspark passes them --------

DS_ARGS_SCRIPT = """
import argparse, json, os
parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int)
parser.add_argument("--deepspeed", action="store_true")
parser.add_argument("--deepspeed_config")
args = parser.parse_args()
with open(args.deepspeed_config) as f:
    config = json.load(f)
words = ["DS", os.environ["RANK"], os.environ["WORLD_SIZE"], args.epochs, args.deepspeed,
         config["zero_optimization"]["stage"]]
os.write(1, (" ".join(map(str, words)) + "\\n").encode())
"""

DS_TRAIN_SCRIPT = """
import argparse, os, sys
import torch
import deepspeed
parser = argparse.ArgumentParser()
parser.add_argument("--deepspeed", action="store_true")
parser.add_argument("--deepspeed_config")
args = parser.parse_args()
deepspeed.init_distributed(dist_backend="gloo")
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                       config=args.deepspeed_config)
x, y = torch.ones(8, 4), torch.zeros(8, 1)
losses = []
for _ in range(3):
    loss = torch.nn.functional.mse_loss(engine(x), y)
    engine.backward(loss)
    engine.step()
    losses.append(loss.item())
words = ["DSTRAIN", os.environ["RANK"], engine.zero_optimization_stage(), losses[-1] < losses[0]]
sys.stdout.flush()
os.write(1, (" ".join(map(str, words)) + "\\n").encode())
"""


def zero_config(stage):
    return {
        "train_micro_batch_size_per_gpu": 8,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
        "optimizer": {"type": "Adam", "params": {"lr": 0.05, "torch_adam": True}},
    }


@pytest.fixture
def deepspeed_on_cpu(monkeypatch):
    """DeepSpeed's CPU accelerator for pyspark's ranks too (sparkdist sets it without GPUs)."""
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")


@pytest.mark.deepspeed
@pytest.mark.parametrize("form", ["dict", "file"])
def test_deepspeed_script_gets_the_config(spark_local, tmp_path, capfd, deepspeed_on_cpu, form):
    script = tmp_path / "ds_args.py"
    script.write_text(DS_ARGS_SCRIPT)
    config = zero_config(2)
    if form == "file":
        path = tmp_path / "zero2.json"
        path.write_text(json.dumps(config))
        config = str(path)
    kwargs = {"numGpus": 2, "useGpu": False, "deepspeedConfig": config}
    run, captured = run_and_capture(capfd, lambda d: d.run(str(script), "--epochs", 3), "DS")
    theirs, ours = both("DeepspeedTorchDistributor", kwargs, run)
    assert_same(theirs, ours)
    assert captured[0] == captured[1] == {f"DS {rank} 2 3 True 2" for rank in (0, 1)}


@pytest.mark.deepspeed
@pytest.mark.slow  # DeepSpeed's import costs each rank seconds: a minute or more for both sides
@pytest.mark.timeout(900)  # measured 280 s on a loaded 2-core box
def test_deepspeed_trains_from_a_config_file(spark_local, tmp_path, capfd, deepspeed_on_cpu):
    script = tmp_path / "ds_train.py"
    script.write_text(DS_TRAIN_SCRIPT)
    config = tmp_path / "zero1.json"
    config.write_text(json.dumps(zero_config(1)))
    kwargs = {"numGpus": 1, "useGpu": False, "deepspeedConfig": str(config)}
    run, captured = run_and_capture(capfd, lambda d: d.run(str(script)), "DSTRAIN")
    theirs, ours = both("DeepspeedTorchDistributor", kwargs, run)
    assert_same(theirs, ours)
    assert captured[0] == captured[1] == {"DSTRAIN 0 1 True"}
    assert os.path.exists(config)  # the user's file is read, never moved or removed


# -- Spark Connect: the same checks through a Connect session (few: each is a round trip) -----


@pytest.mark.parametrize(
    ("settings", "kwargs"),
    [
        ({}, {"num_processes": 2, "local_mode": False, "use_gpu": True}),
        ({GPU: "2"}, {"num_processes": 4, "local_mode": False, "use_gpu": True}),
        ({GPU: "2"}, {"num_processes": 3, "local_mode": False, "use_gpu": True}),
    ],
)
def test_connect_construction(spark_connect, settings, kwargs):
    with runtime_conf(spark_connect, **conf(**settings)):
        theirs, ours = both("TorchDistributor", kwargs)
    assert_same(theirs, ours)


def test_connect_ssl_without_the_opt_out_fails_at_run(spark_connect):
    kwargs = {"num_processes": 2, "local_mode": False, "use_gpu": False}
    with runtime_conf(spark_connect, **conf(**{SSL: "true"})):
        theirs, ours = both("TorchDistributor", kwargs, lambda d: d.run(rank_and_world))
    assert theirs.raised_in == "run" and ours.attributes["is_remote"] is True
    assert_same(theirs, ours)


# -- an intended difference, pinned: docs/launching.md lists it ------------------------------


def test_a_failing_script_is_a_failure_here_and_a_success_in_pyspark(spark_local, tmp_path):
    from sparkdist import WorkerFailedError

    script = tmp_path / "failing_script.py"
    script.write_text("import sys\nsys.exit(3)\n")
    kwargs = {"num_processes": 1, "local_mode": True, "use_gpu": False}
    theirs, ours = both("TorchDistributor", kwargs, lambda d: d.run(str(script)))
    assert theirs.error is None and theirs.value is None  # pyspark: reported as success
    assert isinstance(ours.error, WorkerFailedError) and ours.raised_in == "run"
    assert ours.error.root_cause.exit_code == 3
