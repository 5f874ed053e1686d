"""Issue 12 without Spark: finding and packing local code, version rules and the refusal table,
naming large captures. (The whole path on local-cluster is in
integration/test_shipping_cluster.py.)"""

from __future__ import annotations

import io
import json
import logging
import os
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path

import cloudpickle
import numpy as np
import pytest

from sparkdist import ClusterError, ConfigError
from sparkdist._core.launch.config import LaunchConfig
from sparkdist._core.run.run_state import Deadlines
from sparkdist._core.versions import (
    Refusal,
    Requirement,
    check_local,
    expected_requirements,
    parse_requirements,
    refusal_error,
    refusal_message,
    refusals_in,
    unmet_requirements,
    versions_match,
)
from sparkdist._engine.supervisor import RunMonitor
from sparkdist._shipping import code as _shipping
from sparkdist._shipping.code import (
    ModuleRecorder,
    code_imports,
    pack_local_code,
    put_code_first,
    shipped_names,
    unpack_code,
)
from sparkdist._wire import protocol
from sparkdist._wire.captures import check_job_size, largest_captures
from sparkdist._wire.payload import Job, TargetKind, dumps_job

# -- local code ------------------------------------------------------------------------------

_NAMES = ("sdu_helper", "sdu_dep", "sdu_late", "sdu_nested", "sdu_pkg", "sdu_pkg.core")


@pytest.fixture
def local_code(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    files = {
        "sdu_helper.py": "import json\nimport numpy\nimport sdu_dep\n\ndef f(x):\n    return x\n",
        "sdu_dep.py": "VALUE = 1\n",
        "sdu_late.py": "X = 2\n",
        "sdu_nested.py": "Y = 3\n",
        "sdu_pkg/__init__.py": "from .core import g\n",
        "sdu_pkg/core.py": "def g():\n    return 4\n",
        "sdu_pkg/__pycache__/core.cpython-311.pyc": "not source",
        "sdu_pkg/data.json": "{}",
        "sdu_unused.py": "Z = 5\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name in _NAMES:
        sys.modules.pop(name, None)


def _zip_names(data: bytes | None) -> list[str]:
    assert data is not None
    return sorted(zipfile.ZipFile(io.BytesIO(data)).namelist())


def test_code_imports_reads_absolute_relative_and_nested_imports():
    def fn():
        import sdu_late  # noqa: F401

        from .. import cousin  # noqa: F401
        from . import sibling  # noqa: F401

        def inner():
            import sdu_nested.deep  # noqa: F401

        return inner

    assert sorted(code_imports(fn.__code__)) == [
        ("", 1),
        ("", 2),
        ("sdu_late", 0),
        ("sdu_nested.deep", 0),
    ]


def test_referenced_imported_and_transitive_local_modules_ship_and_nothing_else(local_code):
    from sdu_helper import f
    from sdu_pkg import g

    def train():
        import sdu_late

        def inner():
            import sdu_nested

            return sdu_nested.Y

        return f(1) + g() + sdu_late.X + inner() + np.zeros(1).sum()

    recorder = ModuleRecorder()
    dumps_job(Job(kind=TargetKind.FUNCTION, fn=train), on_object=recorder)
    data = pack_local_code(recorder.names)
    assert shipped_names(data) == ["sdu_dep", "sdu_helper", "sdu_late", "sdu_nested", "sdu_pkg"]
    # Sources only: no bytecode, no data files; numpy (installed), json (stdlib), sparkdist
    # and the unused module stay behind.
    assert _zip_names(data) == [
        "sdu_dep.py",
        "sdu_helper.py",
        "sdu_late.py",
        "sdu_nested.py",
        "sdu_pkg/__init__.py",
        "sdu_pkg/core.py",
    ]


def test_modules_the_ranks_already_see_are_not_shipped(local_code):
    assert pack_local_code(["sdu_helper"], visible_dirs=[str(local_code)]) is None
    assert (
        pack_local_code(["numpy", "json", "sparkdist._wire.payload", "__main__", "nope_xyz"])
        is None
    )


def test_too_much_local_source_is_refused_naming_the_largest(local_code, monkeypatch):
    monkeypatch.setattr(_shipping, "CODE_LIMIT_BYTES", 40)
    with pytest.raises(ConfigError, match=r"add up to .* sdu_pkg \(.*KB\).*never shipped"):
        pack_local_code(["sdu_pkg", "sdu_dep"])


def test_shipped_code_is_imported_first_in_a_fresh_interpreter(local_code, tmp_path_factory):
    data = pack_local_code(["sdu_pkg"])
    assert data is not None
    run_dir = str(tmp_path_factory.mktemp("run"))
    code_dir = unpack_code(run_dir, data)
    env = {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": "/elsewhere"}
    put_code_first(env, code_dir)
    assert env["PYTHONPATH"] == f"{code_dir}{os.pathsep}/elsewhere"
    out = subprocess.run(
        [sys.executable, "-c", "import sdu_pkg; print(sdu_pkg.g(), sdu_pkg.__file__)"],
        env=env,
        cwd=run_dir,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout.split()
    assert out[0] == "4" and out[1] == os.path.join(code_dir, "sdu_pkg", "__init__.py")


def test_a_failing_hook_never_fails_the_pickling():
    class Weird:
        @property
        def __module__(self):  # type: ignore[override]
            raise RuntimeError("no")

    recorder = ModuleRecorder()
    recorder(Weird)  # logged and ignored
    assert dumps_job(Job(kind=TargetKind.FUNCTION, fn=len), on_object=recorder)


# -- versions --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("found", "wanted", "major_minor", "match"),
    [
        ("2.13.0+cpu", "2.13.0", False, True),  # a local label counts only when pinned
        ("2.13.0+cpu", "2.13.0+cu121", False, False),
        ("2.2.0", "2.2", False, True),  # trailing zeros do not count
        ("2.2.1", "2.2", False, False),
        ("2.2.1", "2.2.*", False, True),
        ("2.3.0", "2.2.*", False, False),
        ("2.0.0rc1", "2.0.0", False, False),
        ("3.11.9", "3.11.7", True, True),  # Python: same bytecode within major.minor
        ("3.12.1", "3.11.7", True, False),
    ],
)
def test_versions_match(found, wanted, major_minor, match):
    assert versions_match(found, wanted, major_minor) is match


def test_requirements_are_parsed_and_normalised():
    assert parse_requirements(["numpy", " pandas==2.2.0 ", "Scikit_Learn==1.5"]) == (
        "numpy",
        "pandas==2.2.0",
        "Scikit_Learn==1.5",
    )
    assert parse_requirements(["numpy==1", "NumPy==2"]) == ("NumPy==2",)  # the last one wins
    assert parse_requirements(None) == ()


@pytest.mark.parametrize(
    ("entries", "message"),
    [
        ("numpy", "a list of package names"),
        (["numpy>=1.2"], "other specifiers"),
        (["numpy==="], "other specifiers"),
        (["numpy=="], "not understood"),
        (["num py"], "not understood"),
        ([""], "must be package names"),
        ([3], "must be package names"),
    ],
)
def test_bad_requirements_are_refused(entries, message):
    with pytest.raises(ConfigError, match=message):
        LaunchConfig(requirements=entries)


def test_expected_requirements_per_mode():
    wanted = {r.name: r for r in expected_requirements("ddp", ("numpy", "pandas==2.2.0"))}
    assert {"python", "torch", "cloudpickle", "sparkdist", "numpy", "pandas"} <= set(wanted)
    assert "deepspeed" not in wanted
    assert wanted["numpy"] == Requirement("numpy", np.__version__)
    assert wanted["pandas"] == Requirement("pandas", "2.2.0", pinned=True)
    assert wanted["python"].major_minor_only
    assert "deepspeed" in {r.name for r in expected_requirements("deepspeed", ())}
    only = expected_requirements("ddp", ("numpy", "pandas==2.2.0"), pinned_only=True)
    assert only == (Requirement("pandas", "2.2.0", pinned=True),)
    with pytest.raises(ConfigError, match="'sd-absent'.*pin one"):
        expected_requirements("ddp", ("sd-absent",))


def test_unmet_requirements_name_host_wanted_and_found():
    rows = unmet_requirements(
        [
            Requirement("numpy", np.__version__),
            Requirement("numpy", "1.0", pinned=True),
            Requirement("sd-absent", None),
            Requirement("python", "2.7.18", major_minor_only=True),
        ],
        "hostA",
    )
    assert rows == [
        ("hostA", "numpy", "==1.0 (pinned)", np.__version__),
        ("hostA", "sd-absent", "any (not on the driver)", "missing"),
        ("hostA", "python", "2.7.* (driver 2.7.18)", rows[2][3]),
    ]
    with pytest.raises(ClusterError, match="no rank process was started"):
        check_local([Requirement("numpy", "1.0", pinned=True)])


def test_every_nodes_refusal_makes_one_table():
    monitor = RunMonitor(3, 3, Deadlines(start_timeout_s=60.0))
    for node, host in ((0, "hostA"), (1, "hostB")):
        monitor.on_message(
            None,
            protocol.Refused(  # type: ignore[arg-type]
                node, host, None, ((host, "torch", "2.4.0 (driver)", "2.3.1"),)
            ),
        )
    monitor.on_message(None, protocol.Refused(2, "hostC", "host C has no H100"))  # type: ignore[arg-type]
    assert (
        monitor.state.stop_reason == "host hostA lacks the package versions the run needs (torch)"
    )
    text = refusal_message(monitor.refusals, monitor.state.num_nodes)
    assert text.startswith("the hosts that would run the ranks do not have the packages")
    assert "no rank process was started" in text
    table = [line for line in text.splitlines() if "torch" in line]
    assert [line.split()[0] for line in table] == ["hostA", "hostB"]
    assert text.endswith("host C has no H100")
    partial = refusal_message(monitor.refusals[:1], 2)
    assert "these hosts started no rank (any rank started on another host was stopped)" in partial
    # Without version rows the message is the reasons, as before.
    assert refusal_message([Refusal(0, "h", "no GPU", ())], 1) == "no GPU"


def test_a_detached_refusal_travels_in_the_task_error():
    message = {
        "t": "refused",
        "node": 1,
        "host": "hostB",
        "reason": None,
        "rows": [("hostB", "numpy", "==1.0 (pinned)", "2.0")],
    }
    error = refusal_error(message)
    assert isinstance(error, ClusterError) and "numpy" in str(error)
    wrapped = RuntimeError(f"Job aborted: PythonException: {error}\n\tat org.apache...")
    assert refusals_in(wrapped) == [Refusal.of(message)]
    assert refusals_in(None) == [] and refusals_in(RuntimeError("other")) == []


def test_requirements_round_trip_through_a_fresh_interpreter():
    data = cloudpickle.dumps((Requirement("torch", "2.4.0", pinned=True),))
    code = "import sys, cloudpickle; print(repr(cloudpickle.loads(sys.stdin.buffer.read())))"
    out = (
        subprocess.run(
            [sys.executable, "-c", code], input=data, capture_output=True, check=True, timeout=60
        )
        .stdout.decode()
        .strip()
    )
    assert out == repr((Requirement("torch", "2.4.0", pinned=True),))
    json.dumps(unmet_requirements([Requirement("sd-absent", None)], "h"))  # a channel frame


# -- large captures --------------------------------------------------------------------------

BIG_GLOBAL = np.ones(2**20 // 8 * 2)  # 2 MB


class Holder:
    def __init__(self) -> None:
        self.small = 1
        self.table = np.ones(2**20 // 8 * 3)  # 3 MB


def _use_global():
    return BIG_GLOBAL.sum()


def test_largest_captures_are_named_where_they_were_captured():
    closure = np.ones(2**20 // 8 * 4)  # 4 MB

    def train(holder, scale=1):
        return closure.sum() + _use_global() + holder.table.sum() * scale

    job = Job(kind=TargetKind.FUNCTION, fn=train, args=(Holder(),), kwargs={"scale": 2})
    named = [(where, size // 2**20) for where, _, size in largest_captures(job)]
    assert named[:3] == [
        ("variable 'closure' captured by " + train.__qualname__, 4),
        ("argument 0.table", 3),
        ("global 'BIG_GLOBAL' used by _use_global", 2),  # through the global function
    ]


def test_what_a_partial_binds_is_named():
    import functools

    def train(table, scale=1):
        return table.sum() * scale

    job = Job(
        kind=TargetKind.FUNCTION, fn=functools.partial(train, np.ones(2**20 // 8 * 2), scale=3)
    )
    [(where, _, size), *_] = largest_captures(job)
    assert where == "argument 0 bound by functools.partial" and size >= 2**21


def test_job_size_thresholds(caplog):
    caplog.set_level(logging.WARNING, logger="sparkdist")
    job = Job(kind=TargetKind.FUNCTION, fn=_use_global)
    size = len(dumps_job(job))
    assert not check_job_size(job, size, warn_mb=5, limit_mb=10) and not caplog.records
    assert check_job_size(job, 3 * 2**20, warn_mb=1, limit_mb=10, local_mode=True)
    [record] = caplog.records
    assert "global 'BIG_GLOBAL' used by _use_global (numpy.ndarray, 2.0 MB)" in record.message
    assert "every rank unpickles its own copy" in record.message
    with pytest.raises(ConfigError, match=r"3\.0 MB, more than job_size_limit_mb=2\b.*BIG_GLOBAL"):
        check_job_size(job, 3 * 2**20, warn_mb=1, limit_mb=2)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"job_size_warn_mb": 0}, "job_size_warn_mb must be a positive number of megabytes"),
        ({"job_size_limit_mb": "big"}, "job_size_limit_mb must be a positive"),
        ({"job_size_warn_mb": 10, "job_size_limit_mb": 5}, "the warning must come before"),
    ],
)
def test_bad_job_size_options_are_refused(options, message):
    with pytest.raises(ConfigError, match=message):
        LaunchConfig(**options)


def test_the_shipped_source_is_the_drivers_file(local_code):
    archive = zipfile.ZipFile(io.BytesIO(pack_local_code(["sdu_helper"]) or b""))
    assert archive.read("sdu_helper.py").decode() == (local_code / "sdu_helper.py").read_text()
