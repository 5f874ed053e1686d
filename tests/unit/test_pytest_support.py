"""The pytest plugin's pure parts: master choice, option parsing, leak detection, CUDA checks."""

from __future__ import annotations

import os
from typing import Any

import pytest

from sparkdist._frontdoors import pytest_support as support
from sparkdist._frontdoors.pytest_spark_conf import session_conf
from sparkdist._frontdoors.pytest_support import SESSION_MARKER_VAR as MARKER
from sparkdist._frontdoors.pytest_support import _Process
from sparkdist._node.host.gpus import Gpu


@pytest.mark.parametrize(
    ("requested", "wants_cluster", "master"),
    [
        (None, False, "local[2]"),
        (None, True, "local-cluster[2,1,1024]"),
        ("local[4]", True, "local[4]"),  # an explicit master wins; cluster tests then skip
        ("cluster", False, "local-cluster[2,1,1024]"),
        ("local", True, "local[2]"),
        (" spark://host:7077 ", False, "spark://host:7077"),
    ],
)
def test_one_master_serves_the_session(
    requested: str | None, wants_cluster: bool, master: str
) -> None:
    assert support.resolve_master(requested, wants_cluster) == master


@pytest.mark.parametrize(
    ("master", "cluster"),
    [
        ("local", False),
        ("local[2]", False),
        ("local[*]", False),
        ("local[4, 2]", False),
        ("local-cluster[2,1,1024]", True),
        ("spark://host:7077", True),
        ("yarn", True),
    ],
)
def test_cluster_masters_are_those_with_executor_processes(master: str, cluster: bool) -> None:
    assert support.is_cluster_master(master) is cluster


def test_spark_conf_lines_are_key_value_pairs() -> None:
    lines = ["spark.sql.shuffle.partitions = 4", "", "# a comment", "spark.a=b=c"]
    assert support.parse_spark_conf(lines) == {
        "spark.sql.shuffle.partitions": "4",
        "spark.a": "b=c",
    }


LOG_CONF = "/tmp/sparkdist_pytest-log4j2-x/log4j2.properties"
QUIET_FLAG = f"-Dlog4j2.configurationFile=file:{LOG_CONF}"


def test_the_spark_fixtures_session_is_quiet_loopback_and_small() -> None:
    conf = session_conf("local[2]", LOG_CONF, {})

    assert conf["spark.driver.extraJavaOptions"] == QUIET_FLAG
    assert conf["spark.driver.host"] == conf["spark.driver.bindAddress"] == "127.0.0.1"
    assert conf["spark.ui.enabled"] == "false"
    assert "spark.executor.memory" not in conf
    # An executor of local-cluster[n,cores,MB] must fit in its worker's MB.
    assert session_conf("local-cluster[2,1,1024]", LOG_CONF, {})["spark.executor.memory"] == "768m"


def test_users_jvm_flags_follow_the_quiet_log_flag_and_their_other_keys_win() -> None:
    user = {
        "spark.driver.extraJavaOptions": " -Dmy.flag=1 -Xss4m ",
        "spark.sql.shuffle.partitions": "8",
        "spark.executor.extraJavaOptions": "-Dtheirs=1",  # not one of ours: taken as given
    }

    conf = session_conf("local[2]", LOG_CONF, user)

    # Both kept, theirs last: a -D of theirs for the same property wins (the JVM takes the last).
    assert conf["spark.driver.extraJavaOptions"] == f"{QUIET_FLAG} -Dmy.flag=1 -Xss4m"
    assert conf["spark.sql.shuffle.partitions"] == "8"
    assert conf["spark.executor.extraJavaOptions"] == "-Dtheirs=1"
    # An empty value (``spark.driver.extraJavaOptions=``) adds nothing and removes nothing.
    blank = session_conf("local[2]", LOG_CONF, {"spark.driver.extraJavaOptions": " "})
    assert blank["spark.driver.extraJavaOptions"] == QUIET_FLAG


@pytest.mark.parametrize("line", ["spark.ui.enabled", "=true"])
def test_a_spark_conf_line_without_key_or_value_is_refused(line: str) -> None:
    with pytest.raises(ValueError, match="is not a key=value line"):
        support.parse_spark_conf([line])


@pytest.mark.parametrize(("args", "kwargs", "count"), [((2,), {}, 2), ((), {"n": 4}, 4)])
def test_multi_gpu_takes_a_count(args: tuple[Any, ...], kwargs: dict[str, Any], count: int) -> None:
    assert support.gpu_marker_count(args, kwargs) == count


@pytest.mark.parametrize(("args", "kwargs"), [((), {}), ((0,), {}), (("2",), {}), ((True,), {})])
def test_multi_gpu_without_a_positive_count_is_refused(
    args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    with pytest.raises(ValueError, match=r"multi_gpu\(2\)"):
        support.gpu_marker_count(args, kwargs)


def _proc(pid: int, ppid: int, env: dict[str, str], name: str = "python") -> _Process:
    return _Process(pid, ppid, name, env, f"cmd {pid}")


def test_leftovers_are_this_sessions_ranks_and_what_they_started(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ours, theirs = {MARKER: "ours"}, {MARKER: "theirs"}
    table = [
        _proc(10, 1, {**ours, "SPARKDIST_RUN_ID": "r1"}),  # cold rank
        _proc(11, 10, {**ours, "SPARKDIST_RUN_ID": "r1"}),  # its child
        _proc(20, 1, {**ours, "SPARKDIST_ZYGOTE": "1"}),  # our pool: not a leftover
        _proc(21, 20, {**ours, "SPARKDIST_ZYGOTE": "1"}, name="sparkdist-r0"),  # forked rank
        _proc(22, 21, {**ours, "SPARKDIST_ZYGOTE": "1"}),  # ... and its child
        _proc(23, 20, {**ours, "SPARKDIST_ZYGOTE": "1"}, name="sparkdist-spare"),  # parked
        _proc(24, 20, {**ours, "SPARKDIST_ZYGOTE": "1"}),  # a spare not named yet
        _proc(30, 1, {**theirs, "SPARKDIST_RUN_ID": "r2"}),  # another session's rank
        _proc(40, 1, {**theirs, "SPARKDIST_ZYGOTE": "1"}),  # another session's pool
        _proc(41, 40, {**theirs, "SPARKDIST_ZYGOTE": "1"}),  # ... and its rank
        _proc(50, 1, {}),  # anything else
        _proc(60, 1, {**ours, "SPARKDIST_ZYGOTE": "1"}, name="sparkdist-r1"),  # orphaned
    ]
    monkeypatch.setattr(support, "_process_table", lambda: table)

    found = support.rank_processes("ours")

    assert [p.pid for p in found] == [10, 11, 21, 22, 60]
    assert str(found[0]) == "pid 10: cmd 10"
    assert str(found[-1]) == "pid 60: sparkdist-r1, forked by the warm worker pool (cmd 60)"


def test_leftovers_of_an_unknown_session_are_none_on_this_machine() -> None:
    assert support.rank_processes("no-session-has-this-marker") == []
    assert support.reap_rank_processes("no-session-has-this-marker", grace_s=0.1) == []


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs /proc")
def test_the_proc_reader_sees_what_psutil_sees() -> None:
    import psutil

    by_proc = {p.pid: p for p in support._process_table_from_proc()}
    by_psutil = {p.pid: p for p in support._process_table()}
    me = os.getpid()
    assert by_proc[me] == by_psutil[me]
    assert by_proc[me].ppid == os.getppid()
    assert by_proc[me].env == psutil.Process(me).environ()


@pytest.mark.parametrize(
    ("which", "gpus", "mask", "torch_problem", "expected"),
    [
        (None, [], None, None, support.CudaDevices(0, "no NVIDIA GPU here (nvidia-smi not found)")),
        (
            "/usr/bin/nvidia-smi",
            [],
            "",
            None,
            support.CudaDevices(0, "no GPU visible (CUDA_VISIBLE_DEVICES='')"),
        ),
        ("/usr/bin/nvidia-smi", [], None, None, support.CudaDevices(0, "nvidia-smi lists no GPU")),
        (
            "/usr/bin/nvidia-smi",
            [Gpu("0", "H100")],
            None,
            "this torch (x+cpu) is a CPU-only build",
            support.CudaDevices(0, "this torch (x+cpu) is a CPU-only build"),
        ),
        (
            "/usr/bin/nvidia-smi",
            [Gpu("0", "H100"), Gpu("1", "H100")],
            None,
            None,
            support.CudaDevices(2),
        ),
    ],
)
def test_cuda_devices_say_why_there_are_none(
    monkeypatch: pytest.MonkeyPatch,
    which: str | None,
    gpus: list[Gpu],
    mask: str | None,
    torch_problem: str | None,
    expected: support.CudaDevices,
) -> None:
    monkeypatch.setattr(support.shutil, "which", lambda name: which)
    monkeypatch.setattr(support, "visible_gpus", lambda: gpus)
    monkeypatch.setattr(support, "_torch_cuda_problem", lambda: torch_problem)
    if mask is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", mask)

    assert support.cuda_devices() == expected


def test_a_cpu_only_torch_is_recognised_without_importing_it() -> None:
    import importlib.util
    import sys

    spec = importlib.util.find_spec("torch")
    assert spec is not None and spec.submodule_search_locations
    with open(os.path.join(spec.submodule_search_locations[0], "version.py")) as f:
        text = f.read()
    cpu_only = "\ncuda: Optional[str] = None" in text or "\ncuda = None" in text
    imported_before = "torch" in sys.modules

    problem = support._torch_cuda_problem()

    assert ("CPU-only build" in (problem or "")) is cpu_only
    assert ("torch" in sys.modules) is imported_before


class _FakeContext:
    def __init__(self, master: str) -> None:
        self.master = master
        self.stopped = False


def test_an_active_session_for_the_same_master_is_reused_and_never_stopped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pyspark = pytest.importorskip("pyspark")
    from pyspark.sql import SparkSession

    theirs = object()
    monkeypatch.setattr(pyspark.SparkContext, "_active_spark_context", _FakeContext("local[2]"))
    monkeypatch.setattr(SparkSession, "getActiveSession", classmethod(lambda cls: theirs))
    sessions = support.SparkSessions("local[2]")

    assert sessions.get() is theirs
    assert not sessions.owns_session
    sessions.stop()  # would raise on the plain object if it tried to stop it


def test_an_active_session_for_another_master_is_refused_with_the_fix(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pyspark = pytest.importorskip("pyspark")
    monkeypatch.setattr(pyspark.SparkContext, "_active_spark_context", _FakeContext("local[4]"))

    with pytest.raises(support.SparkSessionConflict) as info:
        support.SparkSessions("local[2]").get()

    message = str(info.value)
    assert "'local[4]'" in message and "'local[2]'" in message
    assert "--sparkdist-spark-master='local[4]'" in message
