"""What tracking needs from the driver's view of an attempt, as a protocol, so that tracking
sits below the engine (``_engine.supervisor.RunMonitor`` satisfies it).

Non-goals: anything the engine does with it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from sparkdist._wire.protocol import Report, Sample


class AttemptHooks(Protocol):
    """Hold and release the rendezvous, receive reports and system samples, guard rank
    output."""

    on_report: Callable[[Report | Sample], None] | None
    output_guard: Callable[[], contextlib.AbstractContextManager[Any]]

    @property
    def node_hosts(self) -> Mapping[int, str]: ...

    def hold_rendezvous(self) -> None: ...

    def release_rendezvous(self, env: dict[str, str]) -> None: ...
