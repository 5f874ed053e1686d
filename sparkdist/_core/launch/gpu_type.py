"""GPU models a run can ask for by name, as in Databricks' serverless GPU API (``gpu_type=``).

The names are the model tokens nvidia-smi prints ("NVIDIA H100 80GB HBM3" is an H100), so a
member's value is what ``_gpus.gpu_type_matches`` looks for in a device name.

Non-goals: finding the GPUs of a host (``_gpus``) or checking them (the launcher and the agent).
"""

from __future__ import annotations

import enum

from sparkdist._core.errors import ConfigError


class GPUType(str, enum.Enum):
    """A GPU model, for ``@distributed(gpu_type=...)``.

    Accepted as a member or as its name in any case (``"h100"``). The check is by model, not by
    memory size or form factor: ``H100`` matches "NVIDIA H100 80GB HBM3" and "NVIDIA H100 NVL";
    ``A10`` matches "NVIDIA A10" and AWS's "NVIDIA A10G" but never an A100.

    Example:
        >>> from sparkdist import GPUType
        >>> GPUType.parse("h100") is GPUType.H100
        True
    """

    T4 = "T4"
    V100 = "V100"
    A10 = "A10"
    A10G = "A10G"
    A100 = "A100"
    L4 = "L4"
    L40S = "L40S"
    H100 = "H100"
    H200 = "H200"
    B200 = "B200"
    GB200 = "GB200"

    @classmethod
    def parse(cls, value: GPUType | str) -> GPUType:
        """Accept a member or its name in any case; refuse anything else, listing the choices.

        Raises:
            ConfigError: ``value`` names no known GPU model.
        """
        if isinstance(value, GPUType):
            return value
        if isinstance(value, str):
            try:
                return cls(value.strip().upper())
            except ValueError:
                pass
        choices = ", ".join(member.value for member in cls)
        raise ConfigError(
            f"gpu_type={value!r} is not a GPU model sparkdist knows; use one of {choices} "
            "(any case, or a sparkdist.GPUType member), or gpu_type=None to skip the check"
        )
