"""sparkdist: launch PyTorch distributed training on Apache Spark (or on this machine).

Importing sparkdist imports none of torch, pyspark, deepspeed or mlflow; they load when used.
The public names load on first use too (``sparkdist.Distributor``, ``from sparkdist import
distributed``), so ``import sparkdist`` itself costs about a millisecond: a rank, a CLI call
or a notebook pays only for what it touches.
"""

from __future__ import annotations

import importlib

TYPE_CHECKING = False
if TYPE_CHECKING:  # what each lazy name is, for type checkers and IDEs
    from typing import Any

    from sparkdist import runtime as runtime
    from sparkdist._core.errors import Attempt as Attempt
    from sparkdist._core.errors import ClusterError as ClusterError
    from sparkdist._core.errors import ConfigError as ConfigError
    from sparkdist._core.errors import ConfigTypeError as ConfigTypeError
    from sparkdist._core.errors import RankFailure as RankFailure
    from sparkdist._core.errors import RendezvousError as RendezvousError
    from sparkdist._core.errors import RunTimeoutError as RunTimeoutError
    from sparkdist._core.errors import SparkdistError as SparkdistError
    from sparkdist._core.errors import WorkerFailedError as WorkerFailedError
    from sparkdist._core.launch.config import Mode as Mode
    from sparkdist._core.launch.gpu_type import GPUType as GPUType
    from sparkdist._core.run.result import RunResult as RunResult
    from sparkdist._engine.handle import DistributedRun as DistributedRun
    from sparkdist._pyspark_compat import DeepspeedTorchDistributor as DeepspeedTorchDistributor
    from sparkdist._pyspark_compat import TorchDistributor as TorchDistributor
    from sparkdist.decorator import distributed as distributed
    from sparkdist.distributor import Distributor as Distributor

    #: The installed distribution's version: pyproject.toml is its one definition.
    __version__: str

#: Each public name -> the module that defines it, imported on first use.
_HOMES = {
    "ClusterError": "sparkdist._core.errors",
    "ConfigError": "sparkdist._core.errors",
    "ConfigTypeError": "sparkdist._core.errors",
    "DeepspeedTorchDistributor": "sparkdist._pyspark_compat",
    "DistributedRun": "sparkdist._engine.handle",
    "Distributor": "sparkdist.distributor",
    "GPUType": "sparkdist._core.launch.gpu_type",
    "Mode": "sparkdist._core.launch.config",
    "Attempt": "sparkdist._core.errors",
    "RankFailure": "sparkdist._core.errors",
    "RendezvousError": "sparkdist._core.errors",
    "RunResult": "sparkdist._core.run.result",
    "RunTimeoutError": "sparkdist._core.errors",
    "SparkdistError": "sparkdist._core.errors",
    "TorchDistributor": "sparkdist._pyspark_compat",
    "WorkerFailedError": "sparkdist._core.errors",
    "distributed": "sparkdist.decorator",
}

__all__ = [
    "ClusterError",
    "ConfigError",
    "ConfigTypeError",
    "DeepspeedTorchDistributor",
    "DistributedRun",
    "Distributor",
    "GPUType",
    "Mode",
    "Attempt",
    "RankFailure",
    "RendezvousError",
    "RunResult",
    "RunTimeoutError",
    "SparkdistError",
    "TorchDistributor",
    "WorkerFailedError",
    "__version__",
    "distributed",
    "runtime",
]


def __getattr__(name: str) -> Any:
    """Load a public name on first use; later uses find it in the module (no call here)."""
    if name == "__version__":
        from importlib import metadata

        value: Any = metadata.version("sparkdist")
    elif name == "runtime":
        value = importlib.import_module("sparkdist.runtime")
    elif name in _HOMES:
        value = getattr(importlib.import_module(_HOMES[name]), name)
    else:
        raise AttributeError(f"module 'sparkdist' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    """The public names (loaded or not) and the module's own dunders; no helper imports."""
    return sorted({*__all__, *(name for name in globals() if name.startswith("__"))})
