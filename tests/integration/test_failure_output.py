"""How a real failure reads: the first line names the failed ranks, then the user's frames;
none of sparkdist's own frames, neither the ranks' nor the driver's."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import traceback

import pytest

from sparkdist import Distributor, WorkerFailedError, runtime
from sparkdist._core.tracebacks import FULL_TRACEBACK_VAR
from tests.conftest import run_processes


def save_without_a_checkpoint_dir():
    import torch.distributed as dist

    # Both ranks reach the failing call together: a rank still starting when the other's
    # failure ends the run would be stopped, not failed, and the message would name one rank.
    dist.init_process_group("gloo")
    dist.barrier()
    runtime.save_checkpoint({"step": 1}, 1)  # sparkdist raises, two frames down


def test_identical_failures_are_one_line_and_sparkdists_frames_are_hidden(monkeypatch):
    monkeypatch.delenv(FULL_TRACEBACK_VAR, raising=False)
    with pytest.raises(WorkerFailedError) as info:
        Distributor(2, use_gpu=False, timeout_s=100).run(save_without_a_checkpoint_dir)
    error = info.value
    message = str(error).splitlines()
    assert message[0].startswith("ranks 0, 1 failed: RuntimeError: no checkpoint directory")
    assert message[1].startswith('  File "') and __file__ in message[1]
    assert "runtime.save_checkpoint" in message[2]
    assert "frame(s) of sparkdist hidden" in str(error)
    # The whole report, as Python prints it: the driver's frames of sparkdist are gone too.
    printed = "".join(traceback.format_exception(error))
    assert "sparkdist/_" not in printed and "sparkdist/runtime.py" not in printed, printed
    assert "sparkdist.WorkerFailedError: ranks 0, 1 failed" in printed
    # Kept, for who asks: runtime's checkpoint functions live with the checkpoints.
    assert "sparkdist/_checkpoint/public.py" in error.root_cause.traceback
    assert not run_processes()


def test_a_full_traceback_on_request(monkeypatch):
    monkeypatch.setenv(FULL_TRACEBACK_VAR, "1")
    with pytest.raises(WorkerFailedError) as info:
        Distributor(2, use_gpu=False, timeout_s=100).run(save_without_a_checkpoint_dir)
    printed = "".join(traceback.format_exception(info.value))
    assert "sparkdist/_checkpoint/public.py" in printed and "sparkdist/_engine/" in printed
    assert not run_processes()


def test_an_uncaught_failure_prints_the_rank_line_and_the_users_frames(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent("""
        from sparkdist import Distributor, runtime

        def train():
            if runtime.get_global_rank() == 1:
                raise ValueError("boom")
            return "ok"

        Distributor(2, use_gpu=False, timeout_s=100).run(train)
    """)
    )
    env = {k: v for k, v in os.environ.items() if k != FULL_TRACEBACK_VAR}
    done = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert done.returncode == 1
    lines = done.stderr.splitlines()
    [headline] = [i for i, line in enumerate(lines) if "WorkerFailedError" in line]
    assert lines[headline] == "sparkdist.WorkerFailedError: rank 1 failed: ValueError: boom"
    assert lines[headline + 1] == f'  File "{script}", line 6, in train'
    assert "sparkdist/_" not in done.stderr, done.stderr
    assert not run_processes()
