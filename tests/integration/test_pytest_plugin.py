"""The pytest plugin, as a user meets it: a user's test suite run by a fresh pytest process.

Each test writes a small suite with ``pytester`` and runs it in a subprocess (an in-process run
would share this process's SparkContext), with the plugin loaded through its entry point only.
Every process the inner run starts inherits a tag, so the test proves that none outlives it.
Spark mode starts a JVM, once, in ``test_spark_mode_option_switches_the_launcher``.
"""

from __future__ import annotations

import os
import time
import uuid
import xml.etree.ElementTree as ET

import psutil
import pytest

pytest_plugins = ["pytester"]

TAG_VAR = "SPARKDIST_PLUGIN_TEST_TAG"
HANG_TIMEOUT_S = 3

# A user's tests; written as test_user.py and run in both modes.
USER_TESTS = f"""
import os
import subprocess
import sys
import time

import pytest

from sparkdist import WorkerFailedError, runtime


def train(scale):
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    total = torch.tensor([rank + 1.0])
    dist.all_reduce(total)
    dist.destroy_process_group()
    return rank * scale, total.item()


def test_every_rank_returns_its_value(distributed, request):
    run = distributed(n=2)
    assert run(train, 10) == [(0, 3.0), (10, 3.0)]
    spark_mode = request.config.getoption("sparkdist_mode") == "spark"
    assert run.local_mode is not spark_mode
    assert run.last_result.local_mode is not spark_mode
    assert run.last_result.num_tasks == (2 if spark_mode else 1)
    print("ran in", "Spark" if spark_mode else "local", "mode")


def hang_on_rank_1():
    if runtime.get_global_rank() == 1:
        time.sleep(3600)
    return "done"


def test_a_hung_rank_fails_the_test(distributed):
    distributed(n=2, timeout_s={HANG_TIMEOUT_S})(hang_on_rank_1)


def fail_on_rank_0():
    if runtime.get_global_rank() == 0:
        raise ValueError("bad batch")
    return "ok"


def test_a_failing_rank_can_be_expected(distributed):
    with pytest.raises(WorkerFailedError, match="rank 0 .*ValueError: bad batch"):
        distributed(n=2)(fail_on_rank_0)


def leave_a_process_behind():
    if runtime.get_global_rank() == 0:
        # Its own session, no pipes of the rank, and an environment the agent's reaping does
        # not take for this rank's (no TORCHELASTIC_RESTART_COUNT): only the plugin's leak
        # check, which looks for any process of the run, catches it.
        env = {{k: v for k, v in os.environ.items() if k != "TORCHELASTIC_RESTART_COUNT"}}
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"],
                         start_new_session=True, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL, env=env)
    return "ok"


def test_a_process_left_behind_is_reported_and_killed(distributed):
    assert distributed(n=2)(leave_a_process_behind) == ["ok", "ok"]
"""


@pytest.fixture
def tagged(monkeypatch: pytest.MonkeyPatch) -> str:
    """A tag every process of the inner run inherits (pytester's subprocess takes our env)."""
    tag = uuid.uuid4().hex
    monkeypatch.setenv(TAG_VAR, tag)
    # Whatever GPUs this machine has, the inner run sees none: its gpu tests must skip.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    return tag


def tagged_processes(tag: str, wait_s: float) -> list[psutil.Process]:
    """Processes carrying ``tag`` still alive after waiting up to ``wait_s`` for them to end."""
    deadline = time.monotonic() + wait_s
    while True:
        found = []
        for proc in psutil.process_iter(["pid"]):
            try:
                if proc.status() != psutil.STATUS_ZOMBIE and proc.environ().get(TAG_VAR) == tag:
                    found.append(proc)
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
        if not found or time.monotonic() >= deadline:
            return found
        time.sleep(0.1)  # a JVM and its Python workers end after their parent; nothing to await


def durations(junit_xml: str) -> dict[str, float]:
    return {
        case.get("name", ""): float(case.get("time", "nan"))
        for case in ET.parse(junit_xml).getroot().iter("testcase")
    }


def test_local_mode_runs_ranks_fails_hung_ones_and_leaves_nothing(
    pytester: pytest.Pytester, tagged: str
) -> None:
    pytester.makepyfile(test_user=USER_TESTS)

    result = pytester.runpytest_subprocess(
        "-rA", "--junitxml=out.xml", "-p", "no:cacheprovider", timeout=120
    )

    result.assert_outcomes(passed=3, failed=1, errors=1)
    result.stdout.fnmatch_lines(
        [
            "*test_a_hung_rank_fails_the_test*",
            f"*RunTimeoutError: the run exceeded timeout_s={HANG_TIMEOUT_S}; "
            "every rank was stopped*",
        ]
    )
    result.stdout.fnmatch_lines(
        [
            "*ERROR at teardown of test_a_process_left_behind_is_reported_and_killed*",
            "*1 process(es) of a distributed run outlived the test (now killed):*",
            "*time.sleep(3600)*",
        ]
    )
    result.stdout.fnmatch_lines(["*ran in local mode*"])
    took = durations(str(pytester.path / "out.xml"))
    # The hung test ends at its timeout (plus the time to stop its ranks), not at the hang's.
    assert HANG_TIMEOUT_S <= took["test_a_hung_rank_fails_the_test"] < HANG_TIMEOUT_S + 10
    assert tagged_processes(tagged, wait_s=10) == []


def test_gpu_markers_skip_with_their_reason_where_there_is_no_cuda(
    pytester: pytest.Pytester, tagged: str
) -> None:
    pytester.makepyfile(
        test_gpu="""
        import pytest

        @pytest.mark.gpu
        def test_needs_a_gpu(distributed):
            raise AssertionError("must not run")

        @pytest.mark.multi_gpu(2)
        def test_needs_two_gpus():
            raise AssertionError("must not run")

        def test_runs_anyway():
            pass
    """
    )

    result = pytester.runpytest_subprocess("-rs", "-p", "no:cacheprovider", timeout=60)

    result.assert_outcomes(passed=1, skipped=2)
    result.stdout.fnmatch_lines_random(
        [
            "SKIPPED [[]1[]] test_gpu.py:3: needs a CUDA GPU: *",
            "SKIPPED [[]1[]] test_gpu.py:7: needs 2 CUDA GPUs: *",
        ]
    )
    assert "nvidia-smi not found" in result.stdout.str() or (
        "CUDA_VISIBLE_DEVICES=''" in result.stdout.str()
    )


@pytest.mark.parametrize(
    ("args", "source", "message"),
    [
        (
            ["--sparkdist-mode=cluster"],
            "def test_x(): pass",
            "*argument --sparkdist-mode: invalid choice: 'cluster'*",
        ),
        (
            ["--sparkdist-timeout=0"],
            "def test_x(): pass",
            "*sparkdist_timeout must be a positive number of seconds*",
        ),
        (
            ["-o", "sparkdist_spark_conf=spark.ui.enabled"],
            "def test_x(): pass",
            "*'spark.ui.enabled' is not a key=value line*",
        ),
        (
            [],
            "import pytest\n@pytest.mark.multi_gpu\ndef test_x(): pass",
            "*test_misuse.py::test_x: @pytest.mark.multi_gpu needs the number of GPUs*",
        ),
    ],
    ids=["unknown-mode", "zero-timeout", "conf-line-without-value", "multi_gpu-without-n"],
)
def test_misuse_is_refused_with_a_clear_message(
    pytester: pytest.Pytester, args: list[str], source: str, message: str
) -> None:
    pytester.makepyfile(test_misuse=source)

    # In process: nothing here starts Spark or a rank, and a subprocess costs seconds.
    result = pytester.runpytest_inprocess(*args)

    assert result.ret == pytest.ExitCode.USAGE_ERROR
    pytest.LineMatcher(result.stderr.lines + result.stdout.lines).fnmatch_lines([message])


@pytest.mark.spark
def test_spark_mode_option_switches_the_launcher(pytester: pytest.Pytester, tagged: str) -> None:
    pytester.makepyfile(
        test_user=USER_TESTS,
        test_spark_fixture="""
        import os
        import sys

        def test_spark_is_a_quiet_loopback_local_session(spark):
            conf = spark.sparkContext.getConf()
            assert spark.sparkContext.master == "local[2]"
            assert conf.get("spark.ui.enabled") == "false"
            assert conf.get("spark.ui.showConsoleProgress") == "false"
            assert conf.get("spark.pyspark.python") == sys.executable
            assert conf.get("spark.driver.host") == "127.0.0.1"
            assert os.environ["SPARK_LOCAL_IP"] == "127.0.0.1"
            assert spark.range(4).count() == 4
            # The user's JVM flags (sparkdist_spark_conf) come after the quiet log file's (Spark
            # puts its own defaults before both).
            flags = conf.get("spark.driver.extraJavaOptions")
            quiet = flags.find(" -Dlog4j2.configurationFile=file:")
            assert 0 <= quiet < flags.find(" -Dsparkdist.user.flag=kept"), flags
            system = spark.sparkContext._jvm.java.lang.System
            assert system.getProperty("sparkdist.user.flag") == "kept"
    """,
    )
    pytester.makeconftest("""
        from pathlib import Path

        def pytest_sessionfinish(session):
            from pyspark import SparkContext
            stopped = SparkContext._active_spark_context is None
            Path("spark_stopped.txt").write_text(str(stopped))
    """)

    result = pytester.runpytest_subprocess(
        "--sparkdist-mode=spark",
        # A user's own driver JVM flag: kept, and Spark stays quiet (asserted below).
        "-o",
        "sparkdist_spark_conf=spark.driver.extraJavaOptions=-Dsparkdist.user.flag=kept",
        "-rA",
        "-p",
        "no:cacheprovider",
        "-s",
        # The left-behind check is the same code in both modes; spare the time here.
        "-k",
        "not left_behind",
        timeout=300,
    )

    result.assert_outcomes(passed=3, failed=1, deselected=1)
    result.stdout.fnmatch_lines(["*ran in Spark mode*"])
    result.stdout.fnmatch_lines(
        [
            f"*RunTimeoutError: the run exceeded timeout_s={HANG_TIMEOUT_S}; "
            "every rank was stopped*",
        ]
    )
    assert "sparkdist: distributed runs in spark mode" in result.stdout.str()
    # Quiet: none of Spark's start-up chatter reached the terminal.
    assert "Setting default log level" not in result.stdout.str() + result.stderr.str()
    assert (pytester.path / "spark_stopped.txt").read_text() == "True"
    assert tagged_processes(tagged, wait_s=30) == []


def test_the_plugin_coexists_with_this_projects_conftest(
    request: pytest.FixtureRequest, no_rank_leftovers: None, no_leftovers: None
) -> None:
    # Loaded by its entry point in this very session, next to tests/conftest.py: both leak
    # checks apply to this test and the markers of both are registered. The conftest's leak
    # check is the plugin's detector, reading the plugin's session marker (one definition).
    # Nothing of Spark is started by the plugin unless a test asks for it.
    assert request.config.pluginmanager.hasplugin("sparkdist")
    markers = "\n".join(request.config.getini("markers"))
    for marker in ("gpu:", "multi_gpu(n):", "spark_cluster:", "slow:", "cluster:"):
        assert marker in markers
    from tests.conftest import SESSION_MARKER

    assert SESSION_MARKER == "SPARKDIST_PYTEST_SESSION"
    assert os.environ[SESSION_MARKER]  # set by the plugin for this session
