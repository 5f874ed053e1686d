"""sparkdist: launch PyTorch distributed training on Apache Spark (or on this machine).

Importing sparkdist imports none of torch, pyspark, deepspeed or mlflow; they load when used.
"""

from importlib import metadata as _metadata

from sparkdist import runtime
from sparkdist._core.config import Mode
from sparkdist._core.errors import (
    ClusterError,
    ConfigError,
    ConfigTypeError,
    RankFailure,
    RendezvousError,
    RunTimeoutError,
    SparkdistError,
    WorkerFailedError,
)
from sparkdist._core.gpu_type import GPUType
from sparkdist._core.result import RunResult
from sparkdist.decorator import distributed
from sparkdist.distributor import DeepspeedTorchDistributor, Distributor, TorchDistributor

#: The installed distribution's version: pyproject.toml is its one definition.
__version__ = _metadata.version("sparkdist")

__all__ = [
    "ClusterError",
    "ConfigError",
    "ConfigTypeError",
    "DeepspeedTorchDistributor",
    "Distributor",
    "GPUType",
    "Mode",
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
