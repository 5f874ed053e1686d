"""Checkpoints on an object store (issue 33): a real S3 server (SeaweedFS on loopback, the
session's ``s3_server``), real ranks (local mode and ``local[2]``, gloo), s3fs. Written by one
world size and read by another, asynchronous saves that outlive ``destroy_process_group``,
``keep_last`` on the store, an uncommitted step passed over and cleared, and a store this host
cannot use named before the first step. Every test checks that no process of the run survives
(conftest's leak check).
"""

from __future__ import annotations

import glob
import json
import os
import socket
import tempfile
import time

import pytest
import torch

from sparkdist import ClusterError, Distributor, runtime
from tests._helpers.s3_server import start_s3_server
from tests.integration.test_checkpoints_dcp import (
    assert_equal,
    ddp_load_both_ways,
    ddp_save,
    saves_then_ends_as_torch_examples_do,
)

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.timeout(300)]


#: botocore gives up on a store that does not answer at once (its default retries a lost
#: connection for seconds: the same outcome, later).
QUICK_GIVE_UP = {"config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 2}}


def launch(world_size: int, url: str, server, fn, *args, settings=None, **options):
    return Distributor(
        world_size,
        use_gpu=False,
        checkpoint_dir=url,
        # The endpoint (the keys are in the environment), and any other settings.
        storage_options={**server.storage_options(), **(settings or {})},
        allow_oversubscribe=True,  # 4 CPU ranks on a 2-core box
        timeout_s=240,
        **options,
    ).run_all(fn, *args)


def store(server):
    import s3fs

    fs = s3fs.S3FileSystem(**server.storage_options())
    fs.invalidate_cache()
    return fs


def objects(server, url: str) -> list[str]:
    """Every object under ``url``, relative to it (a recursive listing: objects, exactly)."""
    root = url.removeprefix("s3://").rstrip("/") + "/"
    return sorted(str(f)[len(root) :] for f in store(server).find(url))


def marker(server, url: str, step: int) -> dict:
    return json.loads(store(server).cat_file(f"{url}/step-{step:09d}/COMMITTED"))


def test_ddp_state_written_by_4_ranks_to_the_store_is_read_by_2_and_back(s3_env, s3_url):
    written = launch(4, s3_url, s3_env, ddp_save, 1, 11).values
    assert written[0]["path"] == f"{s3_url}/step-000000001"  # a URL, never a local path
    files = objects(s3_env, s3_url)
    assert {"step-000000001/.metadata", "step-000000001/COMMITTED"} <= set(files)
    shards = [f for f in files if f.endswith(".distcp")]
    assert shards == [f"step-000000001/__{r}_0.distcp" for r in range(4)]  # each rank its own
    assert marker(s3_env, s3_url, 1)["world_size"] == 4
    saved = {**written[0]["state"]}
    for rank in range(1, 4):
        saved[f"rank{rank}"] = written[rank]["state"][f"rank{rank}"]

    read = launch(2, s3_url, s3_env, ddp_load_both_ways, 1, 11, 2, 22).values
    for value in read:
        step, state, path = value["whole"]
        assert (step, path) == (1, f"{s3_url}/step-000000001")
        assert_equal(state, saved, "whole")
        step, is_into, into = value["into"]
        assert step == 1 and is_into and value["in_place"]
        assert_equal(into["model"], saved["model"], "into.model")
        assert_equal(into["optimizer"], saved["optimizer"], "into.optimizer")
    assert marker(s3_env, s3_url, 2)["world_size"] == 2

    saved_by_2 = {**read[0]["saved"], "rank1": read[1]["saved"]["rank1"]}
    back = launch(4, s3_url, s3_env, ddp_load_both_ways, 2, 33, None, 0).values
    for value in back:
        assert value["whole"][0] == 2
        assert_equal(value["whole"][1], saved_by_2, "whole")


@pytest.mark.parametrize("async_", [True, False], ids=["async", "sync"])
def test_the_last_save_before_destroy_process_group_is_committed_on_the_store(
    s3_env, s3_url, monkeypatch, async_
):
    values = launch(2, s3_url, s3_env, saves_then_ends_as_torch_examples_do, async_).values
    assert values == [False, False]
    assert marker(s3_env, s3_url, 3)["step"] == 3
    # Read back here, as a world of one: the driver's own process, the same store settings.
    monkeypatch.setenv("SPARKDIST_CHECKPOINT_DIR", s3_url)
    monkeypatch.setenv("SPARKDIST_STORAGE_OPTIONS", json.dumps(s3_env.storage_options()))
    latest = runtime.load_checkpoint()
    assert latest is not None and latest.step == 3 and latest.path.startswith("s3://")
    assert bool((latest.state["model"]["weight"] == 3.0).all())


def async_saves_keeping_two(steps: int):
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    for step in range(1, steps + 1):
        state = {f"rank{rank}": torch.full((256 * 1024,), float(step)), "step": step}
        runtime.save_checkpoint(state, step, async_=True, keep_last=2)
    latest = runtime.load_checkpoint()  # waits for the last upload, then reads it back
    return latest.step, bool((latest.state[f"rank{rank}"] == float(steps)).all())


def test_async_saves_with_keep_last_leave_the_two_newest_steps_on_the_store(s3_env, s3_url):
    assert launch(2, s3_url, s3_env, async_saves_keeping_two, 4).values == [(4, True)] * 2
    steps = {f.split("/", 1)[0] for f in objects(s3_env, s3_url)}
    assert steps == {"step-000000003", "step-000000004"}  # older steps' objects are deleted
    assert "step-000000004/COMMITTED" in objects(s3_env, s3_url)


def load_newest():
    found = runtime.load_checkpoint()
    return None if found is None else (found.step, float(found.state["w"][0]))


def save_one(step: int, value: float):
    return runtime.save_checkpoint({"w": torch.full((4,), value)}, step)


def test_an_uncommitted_step_on_the_store_is_passed_over_then_cleared_by_its_resave(s3_env, s3_url):
    launch(1, s3_url, s3_env, save_one, 1, 1.0)
    launch(1, s3_url, s3_env, save_one, 2, 2.0)
    fs = store(s3_env)
    fs.rm_file(f"{s3_url}/step-000000002/COMMITTED")  # as a crash before the commit leaves it
    fs.pipe_file(f"{s3_url}/step-000000002/__7_0.distcp", b"half a shard")
    assert launch(1, s3_url, s3_env, load_newest).values == [(1, 1.0)]

    launch(1, s3_url, s3_env, save_one, 2, 22.0)
    step_two = [f for f in objects(s3_env, s3_url) if f.startswith("step-000000002/")]
    assert "step-000000002/__7_0.distcp" not in step_two  # the crash's leftovers are cleared
    assert "step-000000002/COMMITTED" in step_two
    assert launch(1, s3_url, s3_env, load_newest).values == [(2, 22.0)]


def test_spark_mode_saves_and_loads_on_the_store(s3_env, s3_url, spark_local, monkeypatch):
    # The executors' own keys, as spark.executorEnv.* gives them (the Python workers' env).
    for name, value in s3_env.env().items():
        monkeypatch.setitem(spark_local.sparkContext.environment, name, value)
    launch(2, s3_url, s3_env, ddp_save, 5, 55, local_mode=False, spark=spark_local)
    assert marker(s3_env, s3_url, 5)["world_size"] == 2
    read = launch(
        2, s3_url, s3_env, ddp_load_both_ways, 5, 55, None, 0, local_mode=False, spark=spark_local
    )
    assert [value["whole"][0] for value in read.values] == [5, 5]


def never_runs():
    raise AssertionError("no rank may start when the store cannot be used")


def closed_loopback_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]  # nobody listens there once the probe is closed


@pytest.mark.parametrize("problem", ["wrong secret", "endpoint down"])
def test_a_store_this_host_cannot_use_is_named_before_the_first_step(
    s3_env, s3_url, monkeypatch, problem
):
    options = {**s3_env.storage_options(), **QUICK_GIVE_UP}
    if problem == "wrong secret":
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret-" + "x" * 24)
    else:
        options["endpoint_url"] = f"http://127.0.0.1:{closed_loopback_port()}"
    distributor = Distributor(1, use_gpu=False, checkpoint_dir=s3_url, storage_options=options)
    with pytest.raises(ClusterError) as info:
        distributor.run(never_runs)
    message = str(info.value)
    assert f"checkpoint_dir {s3_url} on node 0 (host " in message
    assert "cannot write there" in message and "fix: give this host access" in message
    assert "not-the-secret" not in message and s3_env.secret_key not in message


def test_a_refusal_still_on_its_way_when_the_local_agent_returns_is_waited_for(
    s3_env, s3_url, monkeypatch
):
    # The agent returns as soon as it sent its refusal; the driver's channel thread may handle
    # the message after the agent's end (under load, CI): the run must still name the store.
    from sparkdist._engine import supervisor
    from sparkdist._wire import protocol

    handle = supervisor.RunMonitor._event_of

    def late(self, peer, message):
        if isinstance(message, protocol.Refused):
            time.sleep(1.0)
        return handle(self, peer, message)

    monkeypatch.setattr(supervisor.RunMonitor, "_event_of", late)
    options = {**s3_env.storage_options(), **QUICK_GIVE_UP}
    options["endpoint_url"] = f"http://127.0.0.1:{closed_loopback_port()}"
    distributor = Distributor(1, use_gpu=False, checkpoint_dir=s3_url, storage_options=options)
    with pytest.raises(ClusterError, match="cannot write there"):
        distributor.run(never_runs)


def upload_then_lose_the_store(server_pid: int):
    """Step 1 committed; step 2's upload is cut off by the store's death (SIGKILL of the
    server, right after the async save returned); the next call must say so."""
    import os
    import signal

    runtime.save_checkpoint({"w": torch.full((4,), 1.0)}, 1)
    big = {"w": torch.full((4,), 2.0), "bulk": torch.ones(32 * 1024 * 1024)}  # 128 MiB
    runtime.save_checkpoint(big, 2, async_=True)
    os.kill(server_pid, signal.SIGKILL)
    try:
        runtime.save_checkpoint({"w": torch.full((4,), 3.0)}, 3)
    except RuntimeError as exc:
        return str(exc)
    return None


def test_a_store_lost_during_an_async_upload_fails_the_next_call_naming_the_step(
    tmp_path, monkeypatch
):
    server = start_s3_server(tmp_path / "store")
    try:
        for name, value in server.env().items():
            monkeypatch.setenv(name, value)
        url = f"s3://{server.bucket}/run"
        pid = server.process.pid
        raised = launch(1, url, server, upload_then_lose_the_store, pid, settings=QUICK_GIVE_UP)
        raised = raised.values[0]
    finally:
        server.stop()
    assert raised is not None, "the lost upload was not reported"
    assert f"the asynchronous save of checkpoint step 2 ({url}/step-000000002) failed" in raised

    again = start_s3_server(tmp_path / "store")  # the same data, a new endpoint
    try:
        for name, value in again.env().items():
            monkeypatch.setenv(name, value)
        files = objects(again, url)
        assert "step-000000001/COMMITTED" in files
        assert "step-000000002/COMMITTED" not in files  # the failed step was never committed
        assert launch(1, url, again, load_newest).values == [(1, 1.0)]
    finally:
        again.stop()


def test_no_credential_travels_with_the_job(s3_env, s3_url, spark_local):
    """What reaches the executors (the agents' spec, the pickled job) and what is shown (the
    config's repr) carries the store's settings but never the keys of this host's env."""
    import pickle

    import cloudpickle

    from sparkdist._engine.prepare import prepare
    from sparkdist.distributor import make_job

    distributor = Distributor(
        2,
        local_mode=False,
        use_gpu=False,
        checkpoint_dir=s3_url,
        storage_options=s3_env.storage_options(),
        spark=spark_local,
    )
    prepared = prepare(distributor.config, make_job(save_one, (1, 1.0), {}), session=spark_local)
    travels = b"".join(
        [cloudpickle.dumps(prepared.template), prepared.job_bytes, pickle.dumps(distributor.config)]
    )
    assert s3_env.endpoint_url.encode() in travels  # the settings do travel: the grep sees them
    shown = repr(distributor.config) + prepared.plan.describe()
    for secret in (s3_env.secret_key, s3_env.access_key):
        assert secret.encode() not in travels and secret not in shown


# -- DeepSpeed's own checkpoints: staged on each host, uploaded, downloaded to load ------------


@pytest.mark.deepspeed
def test_a_deepspeed_checkpoint_on_the_store_loads_resharded_and_back(s3_env, s3_url):
    pytest.importorskip("deepspeed")
    from tests.integration.test_checkpoints_deepspeed import ds_config, load_and_save, save_at

    def ds_launch(world_size: int, fn, *args):
        return (
            Distributor(
                world_size,
                use_gpu=False,
                mode="deepspeed",
                deepspeed_config=ds_config(2),
                checkpoint_dir=s3_url,
                storage_options=s3_env.storage_options(),
                timeout_s=240,
            )
            .run_all(fn, *args)
            .values
        )

    saved = ds_launch(2, save_at, 5)
    [loaded] = ds_launch(1, load_and_save, 6)  # through DeepSpeed's universal checkpoint
    assert (loaded["step"], loaded["epoch"]) == (5, 3)
    assert_equal(loaded["whole"], saved[0], "whole")
    for value in ds_launch(2, load_and_save, None):  # saved by 1, read by 2
        assert (value["step"], value["epoch"]) == (6, 4)
        assert_equal(value["whole"], loaded["saved"], "whole")

    files = objects(s3_env, s3_url)
    assert marker(s3_env, s3_url, 5)["format"] == "deepspeed"
    assert marker(s3_env, s3_url, 6)["world_size"] == 1
    converted = json.loads(
        store(s3_env).cat_file(f"{s3_url}/step-000000005.universal/CONVERTED_FROM")
    )
    assert converted == marker(s3_env, s3_url, 5)  # the conversion is kept beside its step
    assert {"step-000000005/zero_pp_rank_1_mp_rank_00_optim_states.pt"} <= set(files)
    staging = glob.glob(os.path.join(tempfile.gettempdir(), "sparkdist-deepspeed-*"))
    assert not staging, staging  # every host's staging emptied
