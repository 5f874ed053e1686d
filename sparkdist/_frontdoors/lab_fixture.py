"""The ``sparkdist_cluster`` fixture's machinery: multi-host labs, started once per shape.

A test asks ``sparkdist_cluster(hosts=3)`` and gets a running ``LabCluster`` (a lab of that many
hosts plus the driver's, a Spark standalone cluster on it, and a driver program). Every test of
the session that asks for the same shape shares it; a test that breaks a host brings it back
(``LabCluster.restart_host``) or asks for ``fresh=True``. Every lab ends with the session.

Where the machine cannot hold a lab (no root and no user namespaces, no ``unshare``, a
container that forbids them), the test is skipped with the reason (``_lab.support``).

Non-goals: the lab itself (``sparkdist._lab``).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from sparkdist._lab.lab import NameResolution
from sparkdist._lab.spark import LabCluster, start_lab_cluster
from sparkdist._lab.support import LabSupport, probe


@dataclass
class ClusterFactory:
    """``sparkdist_cluster(hosts=3, resolution=..., fresh=False)`` -> a running ``LabCluster``."""

    base: Path
    _support: LabSupport | None = None
    _clusters: dict[tuple[int, tuple[str, ...]], LabCluster] = field(default_factory=dict)
    _made: list[LabCluster] = field(default_factory=list)

    def __call__(
        self,
        hosts: int = 3,
        resolution: NameResolution | list[NameResolution] = NameResolution.PEERS,
        *,
        fresh: bool = False,
    ) -> LabCluster:
        if self._support is None:
            self._support = probe()
        if not self._support.ok:
            pytest.skip(self._support.reason)
        each = resolution if isinstance(resolution, list) else [resolution] * hosts
        key = (hosts, tuple(r.value for r in each))
        if not fresh and key in self._clusters:
            return self._clusters[key]
        cluster = start_lab_cluster(self.base / f"lab{len(self._made)}", hosts, resolution=each)
        self._made.append(cluster)
        if not fresh:
            self._clusters[key] = cluster
        return cluster

    def close(self) -> None:
        """End every lab of the session (their processes and namespaces go with them)."""
        for cluster in self._made:
            with contextlib.suppress(Exception):
                cluster.lab.close()
        self._made.clear()
        self._clusters.clear()
