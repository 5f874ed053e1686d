"""Jobs and errors cross process boundaries: round trips through a fresh interpreter, and
unpicklable jobs named precisely."""

from __future__ import annotations

import pickle
import shutil
import subprocess
import sys
import threading

import cloudpickle
import pytest

import sparkdist
from sparkdist import ConfigError, RankFailure, WorkerFailedError
from sparkdist._core.errors import ClusterError, RendezvousError, RunTimeoutError
from sparkdist._wire.payload import (
    Job,
    Outcome,
    TargetKind,
    ValueFile,
    dumps_job,
    loads,
    release_values,
)


def _round_trip_in_fresh_interpreter(data: bytes) -> str:
    code = (
        "import sys, cloudpickle; obj = cloudpickle.loads(sys.stdin.buffer.read()); "
        "print(repr(obj))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], input=data, capture_output=True, check=True, timeout=60
    )
    return done.stdout.decode().strip()


def scale(x, factor=2):
    return x * factor


def test_job_round_trips_through_a_fresh_interpreter():
    job = Job(kind=TargetKind.FUNCTION, fn=scale, args=(3,), kwargs={"factor": 5})
    data = dumps_job(job)
    code = (
        "import sys, cloudpickle; job = cloudpickle.loads(sys.stdin.buffer.read()); "
        "print(job.fn(*job.args, **job.kwargs))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], input=data, capture_output=True, check=True, timeout=60
    ).stdout
    assert out.strip() == b"15"


def test_outcome_and_failure_round_trip():
    failure = RankFailure(1, "h", 3, "ValueError", "boom", "tb", ("a", "b"), None)
    outcome = Outcome(1, "h", 3, 0.5, failure=failure, ended_at=2.0)
    assert repr(outcome) == _round_trip_in_fresh_interpreter(cloudpickle.dumps(outcome))


def _value_file(tmp_path, value):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    path = run_dir / "rank-0.value"
    path.write_bytes(cloudpickle.dumps(value))
    return run_dir, ValueFile(str(path))


def test_a_value_is_unpickled_from_its_file_even_once_the_run_directory_is_gone(tmp_path):
    run_dir, value_file = _value_file(tmp_path, {"loss": 0.5, "blob": b"x" * 100_000})
    shutil.rmtree(run_dir)  # what the agent does when it ends, before the driver unpickles
    assert loads(value_file) == {"loss": 0.5, "blob": b"x" * 100_000}
    with pytest.raises(ValueError, match="already read and closed"):
        loads(value_file)  # read once: the file is let go as soon as the value exists


def test_a_failed_runs_unread_values_let_go_of_their_files(tmp_path):
    _, value_file = _value_file(tmp_path, "done before the others failed")
    outcomes = [Outcome(0, "h", 0, 0.5, value_bytes=value_file), Outcome(1, "h", 1, 0.5)]
    release_values(outcomes)
    with pytest.raises(ValueError, match="already read and closed"):
        loads(value_file)


def test_an_outcome_holding_a_value_file_crosses_processes_as_bytes(tmp_path):
    # A Spark task's outcome: pickled on the executor, plain bytes on the driver.
    run_dir, value_file = _value_file(tmp_path, [1, 2, 3])
    outcome = Outcome(0, "h", 0, 0.5, value_bytes=value_file, ended_at=2.0)
    shutil.rmtree(run_dir)
    code = (
        "import sys, cloudpickle; o = cloudpickle.loads(sys.stdin.buffer.read()); "
        "print(type(o.value_bytes).__name__, cloudpickle.loads(o.value_bytes))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        input=cloudpickle.dumps(outcome),
        capture_output=True,
        check=True,
        timeout=60,
    ).stdout
    assert out.decode().strip() == "bytes [1, 2, 3]"
    value_file.close()


@pytest.mark.parametrize(
    "error",
    [
        ConfigError("bad"),
        ClusterError("small"),
        RendezvousError("late"),
        RunTimeoutError("slow"),
        WorkerFailedError({1: RankFailure(1, "h", 1, "E", "m")}, RankFailure(1, "h", 1, "E", "m")),
    ],
)
def test_errors_pickle(error):
    again = pickle.loads(pickle.dumps(error))
    assert type(again) is type(error) and str(again) == str(error)
    assert isinstance(again, sparkdist.SparkdistError)


def test_worker_failed_error_message_has_root_cause_traceback_and_last_lines():
    root = RankFailure(
        1,
        "hostA",
        1,
        "ValueError",
        "boom",
        "Traceback ...\nValueError: boom\n",
        ("step 1", "step 2"),
    )
    other = RankFailure(0, "hostB", 1, "RuntimeError", "peer died")
    error = WorkerFailedError({0: other, 1: root}, root)
    text = str(error)
    assert text.startswith("rank 1 failed: ValueError: boom\n")
    assert "where: rank 1 on hostA, exit code 1" in text
    assert (
        "rank 0 failed too (often in consequence, e.g. a peer lost in a collective): "
        "RuntimeError: peer died"
    ) in text
    assert "Traceback ...\nValueError: boom" in text
    assert "  step 2" in text
    assert error.root_cause is root and set(error.failures) == {0, 1}
    assert isinstance(error, RuntimeError)  # as pyspark's TorchDistributor raises


def test_unpicklable_closure_names_the_captured_object():
    lock = threading.Lock()

    def train():
        with lock:
            return 1

    with pytest.raises(ConfigError) as info:
        dumps_job(Job(kind=TargetKind.FUNCTION, fn=train))
    message = str(info.value)
    assert "variable 'lock' captured by" in message and "_thread.lock" in message
    assert "Create it inside the function" in message


class Holder:
    def __init__(self):
        self.lock = threading.RLock()


def test_unpicklable_argument_inside_a_user_object_is_named():
    with pytest.raises(ConfigError, match=r"argument 0\.lock is a _thread\.RLock"):
        dumps_job(Job(kind=TargetKind.FUNCTION, fn=scale, args=(Holder(),)))


def test_unpicklable_keyword_argument_in_a_dict_is_named():
    with pytest.raises(ConfigError, match=r"keyword argument 'cfg'\['lock'\]"):
        dumps_job(
            Job(kind=TargetKind.FUNCTION, fn=scale, kwargs={"cfg": {"lock": threading.Lock()}})
        )


def test_a_function_reading_an_attribute_named_classes_still_pickles():
    """cloudpickle ships torch.classes (an unpicklable pseudo-module) as a 'submodule' of
    torch when a by-value function reads any `.classes`; it must travel by name instead."""
    torch = pytest.importorskip("torch")
    code = "def count(config):\n    return torch.zeros(config.classes).shape[0]\n"
    namespace = {"torch": torch, "__name__": "__main__"}
    exec(code, namespace)
    data = dumps_job(Job(kind=TargetKind.FUNCTION, fn=namespace["count"]))
    job = cloudpickle.loads(data)

    class Config:
        classes = 3

    assert job.fn(Config()) == 3
