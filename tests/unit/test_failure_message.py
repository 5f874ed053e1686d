"""How a failure reads: the first line names the failed ranks (identical errors grouped), then
the user's frames without sparkdist's own; exception classes present as ``sparkdist.X`` and
still pickle."""

from __future__ import annotations

import pickle
import subprocess
import sys
import textwrap

import cloudpickle
import pytest

import sparkdist
from sparkdist import RankFailure, WorkerFailedError
from sparkdist._core.tracebacks import (
    FULL_TRACEBACK_VAR,
    full_traceback_wanted,
    hide_frames,
    is_sparkdist_file,
    without_header,
)

SITE = "/venv/lib/python3.11/site-packages"

USER_TRACEBACK = textwrap.dedent(f"""\
    Traceback (most recent call last):
      File "/home/me/train.py", line 6, in train
        helper(1)
      File "/home/me/train.py", line 3, in helper
        runtime.save_checkpoint({{}}, 1)
        ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
      File "{SITE}/sparkdist/runtime.py", line 248, in save_checkpoint
        directory = _require_checkpoint_dir()
      File "{SITE}/sparkdist/runtime.py", line 284, in _require_checkpoint_dir
        raise RuntimeError(
    RuntimeError: no checkpoint directory
    """)


def failure(rank, exc_type="ValueError", message="boom", traceback="", host="h", code=1):
    return RankFailure(rank, host, code, exc_type, message, traceback)


@pytest.mark.parametrize(
    ("failures", "root", "first_line"),
    [
        ([failure(1)], 1, "rank 1 failed: ValueError: boom"),
        ([failure(0), failure(2)], 2, "ranks 0, 2 failed: ValueError: boom"),
        # The root cause's group comes first, whatever the rank order.
        (
            [failure(0, "RuntimeError", "peer reset"), failure(3)],
            3,
            "rank 3 failed: ValueError: boom",
        ),
        ([failure(0, "", "exited with code 3", code=3)], 0, "rank 0 failed: exited with code 3"),
        ([failure(1, "", "killed by SIGKILL", code=-9)], 1, "rank 1 failed: killed by SIGKILL"),
        # A long or multi-line message: its first line, cut.
        ([failure(0, "E", "line one\nline two")], 0, "rank 0 failed: E: line one"),
        ([failure(0, "E", "x" * 500)], 0, "rank 0 failed: E: " + "x" * 297 + "..."),
        ([failure(0, "KeyboardInterrupt", "")], 0, "rank 0 failed: KeyboardInterrupt"),
    ],
)
def test_first_line_names_the_failed_ranks(failures, root, first_line):
    by_rank = {f.rank: f for f in failures}
    assert str(WorkerFailedError(by_rank, by_rank[root])).splitlines()[0] == first_line


@pytest.mark.parametrize(
    ("failures", "line"),
    [
        (
            [failure(1), failure(0, "RuntimeError", "peer reset")],
            "rank 0 failed too (often in consequence, e.g. a peer lost in a collective): "
            "RuntimeError: peer reset",
        ),
        (
            [failure(1), failure(0, "E", "x"), failure(2, "E", "x")],
            "ranks 0, 2 failed too (often in consequence, e.g. a peer lost in a collective): E: x",
        ),
    ],
)
def test_other_errors_follow_grouped(failures, line):
    by_rank = {f.rank: f for f in failures}
    assert line in str(WorkerFailedError(by_rank, failures[0])).splitlines()


@pytest.mark.parametrize(
    ("failures", "where"),
    [
        ([failure(1, host="hostA", code=1)], "where: rank 1 on hostA, exit code 1"),
        ([failure(1, host="", code=None)], "where: rank 1"),
        (
            [failure(2, host="hostA"), failure(0, host="hostB")],
            "where: rank 2 on hostA, the first to fail, exit code 1",
        ),
    ],
)
def test_where_line(failures, where):
    by_rank = {f.rank: f for f in failures}
    assert where in str(WorkerFailedError(by_rank, failures[0])).splitlines()


def test_message_shows_the_users_frames_and_hides_sparkdists(monkeypatch):
    monkeypatch.delenv(FULL_TRACEBACK_VAR, raising=False)
    root = failure(1, "RuntimeError", "no checkpoint directory", USER_TRACEBACK)
    lines = str(WorkerFailedError({1: root}, root)).splitlines()
    assert lines[:6] == [
        "rank 1 failed: RuntimeError: no checkpoint directory",
        '  File "/home/me/train.py", line 6, in train',
        "    helper(1)",
        '  File "/home/me/train.py", line 3, in helper',
        "    runtime.save_checkpoint({}, 1)",
        "    ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^",
    ]
    assert lines[6:8] == [
        "RuntimeError: no checkpoint directory",
        f"(2 frame(s) of sparkdist hidden; set {FULL_TRACEBACK_VAR}=1 to see them)",
    ]
    assert not [line for line in lines if "sparkdist/" in line]


def test_full_traceback_on_request_shows_every_frame(monkeypatch):
    monkeypatch.setenv(FULL_TRACEBACK_VAR, "1")
    root = failure(1, "RuntimeError", "no checkpoint directory", USER_TRACEBACK)
    text = str(WorkerFailedError({1: root}, root))
    assert without_header(USER_TRACEBACK).rstrip("\n") in text and "hidden" not in text


def test_last_lines_and_attempts_follow():
    root = RankFailure(1, "hostA", 1, "ValueError", "boom", "", ("step 1", "step 2"))
    earlier = failure(0, "OSError", "disk")
    text = str(WorkerFailedError({1: root}, root, (earlier,)))
    assert text.splitlines()[-4:] == [
        "attempt 0 failed first at rank 0 on h: OSError: disk",
        "last output lines of rank 1:",
        "  step 1",
        "  step 2",
    ]


HIDE = lambda path: "/sparkdist/" in path  # noqa: E731 - the rule under test is elsewhere


@pytest.mark.parametrize(
    ("text", "kept", "dropped"),
    [
        # No frame of sparkdist: unchanged.
        (
            'Traceback (most recent call last):\n  File "/u/a.py", line 1, in f\n    g()\nE: x\n',
            'Traceback (most recent call last):\n  File "/u/a.py", line 1, in f\n    g()\nE: x\n',
            0,
        ),
        # sparkdist's frames in the middle go, with their source and caret lines.
        (
            '  File "/u/a.py", line 1, in f\n    g()\n  File "/s/sparkdist/x.py", line 2, in g\n'
            '    h()\n    ^^^\n  File "/u/b.py", line 3, in cb\n    raise E\nE: x',
            '  File "/u/a.py", line 1, in f\n    g()\n  File "/u/b.py", line 3, in cb\n'
            "    raise E\nE: x",
            1,
        ),
        # Every frame is sparkdist's: nothing hidden (an empty traceback says less).
        (
            '  File "/s/sparkdist/x.py", line 2, in g\n    h()\nE: x',
            '  File "/s/sparkdist/x.py", line 2, in g\n    h()\nE: x',
            0,
        ),
        # A recursion note belongs to the frame before it.
        (
            '  File "/u/a.py", line 1, in f\n    g()\n  File "/s/sparkdist/x.py", line 2, in g\n'
            "    g()\n  [Previous line repeated 996 more times]\nRecursionError: deep",
            '  File "/u/a.py", line 1, in f\n    g()\nRecursionError: deep',
            1,
        ),
        # Chained exceptions: each part is filtered; the chaining lines stay.
        (
            'Traceback (most recent call last):\n  File "/s/sparkdist/x.py", line 2, in g\n'
            "    h()\nKeyError: k\n\nDuring handling of the above exception, another exception "
            'occurred:\n\nTraceback (most recent call last):\n  File "/u/a.py", line 1, in f\n'
            "    g()\nE: x",
            "Traceback (most recent call last):\nKeyError: k\n\nDuring handling of the above "
            "exception, another exception occurred:\n\nTraceback (most recent call last):\n"
            '  File "/u/a.py", line 1, in f\n    g()\nE: x',
            1,
        ),
        # An exception group's margins count as indentation.
        (
            '  | Traceback (most recent call last):\n  |   File "/s/sparkdist/x.py", line 2, in g\n'
            '  |     h()\n  |   File "/u/a.py", line 1, in f\n  |     raise E\n  | E: x',
            '  | Traceback (most recent call last):\n  |   File "/u/a.py", line 1, in f\n'
            "  |     raise E\n  | E: x",
            1,
        ),
    ],
)
def test_hide_frames(text, kept, dropped):
    assert hide_frames(text, HIDE) == (kept, dropped)


@pytest.mark.parametrize(
    ("path", "hidden"),
    [
        (sparkdist.runtime.__file__, True),
        (f"{SITE}/sparkdist/_core/errors.py", True),  # an executor's install
        (f"{SITE}/sparkdist/runtime.py", True),
        ("/home/me/sparkdist/examples/mlp.py", False),  # a checkout's examples are the user's
        ("/home/me/sparkdist/train.py", False),  # not a module of the package
        ("/home/me/sparkdist_experiments/runtime.py", False),
        ("/home/me/train.py", False),
    ],
)
def test_is_sparkdist_file(path, hidden):
    assert is_sparkdist_file(path) is hidden


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        ("Traceback (most recent call last):\n  File ...\nE: x\n", "  File ...\nE: x\n"),
        ("E: x\n", "E: x\n"),
        # Chained: the first frames are an earlier exception's, so the header stays.
        (
            "Traceback (most recent call last):\n  File ...\nK: k\n\nThe above exception was the "
            "direct cause of the following exception:\n\nTraceback (most recent call last):\nE: x",
            "Traceback (most recent call last):\n  File ...\nK: k\n\nThe above exception was the "
            "direct cause of the following exception:\n\nTraceback (most recent call last):\nE: x",
        ),
    ],
)
def test_without_header(text, shown):
    assert without_header(text) == shown


@pytest.mark.parametrize(
    ("value", "wanted"), [("1", True), ("true", True), ("ON", True), ("0", False), ("", False)]
)
def test_full_traceback_wanted(value, wanted):
    assert full_traceback_wanted({FULL_TRACEBACK_VAR: value}) is wanted


PUBLIC_ERRORS = [
    sparkdist.SparkdistError("x"),
    sparkdist.ConfigError("bad"),
    sparkdist.ClusterError("small"),
    sparkdist.RendezvousError("late"),
    sparkdist.RunTimeoutError("slow"),
    WorkerFailedError({1: failure(1)}, failure(1), (failure(0),)),
]


@pytest.mark.parametrize("error", PUBLIC_ERRORS, ids=lambda e: type(e).__name__)
def test_public_errors_present_as_sparkdist_and_pickle(error):
    name = type(error).__name__
    assert type(error).__module__ == "sparkdist" and getattr(sparkdist, name) is type(error)
    assert f"sparkdist.{name}:" in "".join(
        __import__("traceback").format_exception_only(type(error), error)
    )
    for dumps, loads in ((pickle.dumps, pickle.loads), (cloudpickle.dumps, cloudpickle.loads)):
        again = loads(dumps(error))
        assert type(again) is type(error) and str(again) == str(error)


def test_errors_round_trip_through_a_fresh_interpreter():
    code = (
        "import pickle, sys; error = pickle.loads(sys.stdin.buffer.read()); "
        "print(type(error).__module__, type(error).__name__, str(error).splitlines()[0])"
    )
    for error in PUBLIC_ERRORS:
        done = subprocess.run(
            [sys.executable, "-c", code],
            input=pickle.dumps(error),
            capture_output=True,
            check=True,
            timeout=60,
        )
        expected = f"sparkdist {type(error).__name__} {str(error).splitlines()[0]}"
        assert done.stdout.decode().strip() == expected
