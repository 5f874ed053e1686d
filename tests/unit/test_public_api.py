"""The public surface: __all__ matches, and importing sparkdist stays light."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

import sparkdist


def test_all_lists_exactly_the_public_names():
    # Read in a fresh interpreter: under pytest, sparkdist is imported through pytest's
    # assertion rewriter (the package holds a pytest plugin), which adds names of its own, and
    # other tests import submodules (sparkdist.cli, sparkdist.pytest_plugin...) as a side effect.
    # The names load on first use, so dir() lists them; every one of them must resolve.
    code = (
        "import json, sparkdist; "
        "names = [name for name in dir(sparkdist) if not name.startswith('_')]; "
        "print(json.dumps([names, [type(getattr(sparkdist, n)).__name__ for n in "
        "sparkdist.__all__]]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    public, kinds = json.loads(out)
    assert set(sparkdist.__all__) - {"__version__"} == set(public)
    assert len(kinds) == len(sparkdist.__all__)
    with pytest.raises(AttributeError, match="module 'sparkdist' has no attribute 'Nope'"):
        sparkdist.Nope  # noqa: B018


def test_import_loads_no_submodule_until_a_name_is_used():
    code = (
        "import sys, sparkdist; "
        "before = sorted(m for m in sys.modules if m.startswith('sparkdist')); "
        "from sparkdist import Distributor, runtime; "
        "print(before, 'sparkdist.distributor' in sys.modules, runtime.__name__)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    assert out.strip() == "['sparkdist'] True sparkdist.runtime"


def test_import_loads_no_heavy_dependency():
    code = (
        "import sys, sparkdist; "
        "print(sorted(m for m in ('torch', 'pyspark', 'deepspeed', 'mlflow') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    assert out.strip() == "[]"


def test_runtime_outside_a_rank_describes_a_world_of_one(monkeypatch):
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "GROUP_RANK"):
        monkeypatch.delenv(name, raising=False)
    rt = sparkdist.runtime
    assert (
        rt.get_global_rank(),
        rt.get_local_rank(),
        rt.get_world_size(),
        rt.get_local_world_size(),
        rt.get_node_rank(),
        rt.is_main_process(),
    ) == (0, 0, 1, 1, 0, True)


def test_version_comes_from_the_package_metadata_only():
    from importlib import metadata

    assert sparkdist.__version__ == metadata.version("sparkdist")
    source = (Path(sparkdist.__file__).parent).rglob("*.py")
    literal = re.compile(r"""__version__\s*=\s*['"]""")
    assert not [str(p) for p in source if literal.search(p.read_text())]


#: The public helpers of ``sparkdist.runtime`` and their signatures, as they were when the
#: module's machinery moved out of it (``_core.world``, ``_node.rank.mesh`` and
#: ``.preemption``, ``_checkpoint.public``): a change here is a change of the public surface.
RUNTIME_SIGNATURES = {
    "average_gradients": "(manager: 'Any', module: 'torch.nn.Module') -> 'None'",
    "num_replica_groups": "() -> 'int'",
    "replica_group": "() -> 'int'",
    "torchft_manager_kwargs": "(pg: 'ProcessGroup | None' = None) -> 'dict[str, Any]'",
    "backend": "() -> 'str'",
    "checkpoint_dir": "() -> 'str | None'",
    "deepspeed_config": "() -> 'dict[str, Any] | None'",
    "deepspeed_config_path": "() -> 'str | None'",
    "device": "() -> 'torch.device'",
    "device_mesh": "(replicas: 'int' = 1) -> 'DeviceMesh'",
    "get_global_rank": "(group: 'ProcessGroup | None' = None) -> 'int'",
    "get_local_rank": "() -> 'int'",
    "get_local_world_size": "() -> 'int'",
    "get_node_rank": "() -> 'int'",
    "get_replica_rank": "() -> 'int'",
    "get_world_size": "() -> 'int'",
    "heartbeat": "() -> 'None'",
    "is_main_process": "() -> 'bool'",
    "load_checkpoint": "(into: 'Any' = None, *, map_location: 'Any' = 'cpu', "
    "weights_only: 'bool' = True) -> 'Checkpoint | None'",
    "mode": "() -> 'str'",
    "on_preemption": "(callback: 'Callable[[str], object]') -> 'None'",
    "report": "(step: 'int | None' = None, total: 'int | None' = None, **metrics: 'float') "
    "-> 'None'",
    "requested_world_size": "() -> 'int'",
    "restart_count": "() -> 'int'",
    "save_checkpoint": "(state: 'Any', step: 'int', *, async_: 'bool' = False, "
    "keep_last: 'int | None' = None) -> 'str'",
    "should_stop": "() -> 'bool'",
}


def test_runtimes_public_helpers_keep_their_names_signatures_and_home():
    import inspect

    from sparkdist import runtime

    assert sorted(runtime.__all__) == sorted([*RUNTIME_SIGNATURES, "Checkpoint"])
    for name, signature in RUNTIME_SIGNATURES.items():
        helper = getattr(runtime, name)
        assert str(inspect.signature(helper)) == signature, name
        # Shown as runtime's wherever it is defined (help(), the docs, tracebacks' readers).
        assert helper.__module__ == "sparkdist.runtime", name
        assert helper.__doc__, name
