"""The Lighthouse of a replica-group run: torchft's own server, on the driver, for one run.

torchft's Lighthouse forms a quorum of the live replica groups at every step. The launcher owns
it: started before any group, bound to the one address the executors reach the driver at
(never a wildcard), and shut down when the run ends. Its address is built from that address:
torchft's ``address()`` names ``socket.gethostname()``, loopback on many hosts.

Timeouts are set for fast quorums: a group that stops answering is left out of the next quorum
after ``JOIN_TIMEOUT_MS`` (torchft's command line waits 60 s), and the quorum is re-checked
every ``QUORUM_TICK_MS``.

Trust: torchft's servers (this one, each group's Manager server and its checkpoint transport)
speak plain gRPC/HTTP with no authentication, like torch.distributed's own store and gloo;
they are the training framework's data plane, not sparkdist's side channels (DESIGN.md rule
4), and live only as long as the run. docs/security.md says so.

Non-goals: the groups themselves (``_engine.replica_groups``).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, MutableMapping
from types import TracebackType
from typing import Any
from urllib.parse import urlsplit

from sparkdist._core.errors import ConfigError

logger = logging.getLogger("sparkdist")

#: How long a quorum waits for a group that was in the last one before going on without it.
JOIN_TIMEOUT_MS = 1000
#: How often the Lighthouse checks whether a quorum can form.
QUORUM_TICK_MS = 100
#: A group silent this long is no longer counted as live (torchft's default is 5 s).
HEARTBEAT_TIMEOUT_MS = 5000

#: torchft's Rust log filter, and what the Lighthouse and the ranks' Manager servers get unless
#: the user set it.
RUST_LOG_VAR = "RUST_LOG"
QUIET_RUST_LOG = "warn"

INSTALL_HINT = "pip install 'sparkdist[torchft]' (torchft 0.2 or newer, on every host)"


def _server_class() -> Any:
    try:
        with quiet_rust_log(os.environ):  # torchft's logger reads RUST_LOG once, at import
            from torchft._torchft import LighthouseServer
    except ImportError as exc:
        raise ConfigError(
            f"replica_groups needs torchft on the driver and every host, but it cannot be "
            f"imported here ({exc}); {INSTALL_HINT}"
        ) from None
    return LighthouseServer


@contextlib.contextmanager
def quiet_rust_log(environ: MutableMapping[str, str]) -> Iterator[None]:
    """``RUST_LOG`` at ``QUIET_RUST_LOG`` while the block runs, unless the user set it: torchft's
    servers otherwise log every quorum (ten lines a second) at info."""
    if RUST_LOG_VAR in environ:
        yield
        return
    environ[RUST_LOG_VAR] = QUIET_RUST_LOG
    try:
        yield
    finally:
        environ.pop(RUST_LOG_VAR, None)


def check_torchft() -> None:
    """Refuse a replica-group run where torchft is missing, before anything starts."""
    _server_class()


class Lighthouse:
    """The run's Lighthouse, listening on ``host`` (an address) at a port the OS picks."""

    def __init__(self, host: str, min_replica_groups: int) -> None:
        server_class = _server_class()
        bracketed = f"[{host}]" if ":" in host else host
        self._server = server_class(
            bind=f"{bracketed}:0",
            min_replicas=min_replica_groups,
            join_timeout_ms=JOIN_TIMEOUT_MS,
            quorum_tick_ms=QUORUM_TICK_MS,
            heartbeat_timeout_ms=HEARTBEAT_TIMEOUT_MS,
        )
        port = urlsplit(self._server.address()).port
        #: What every rank is told (``TORCHFT_LIGHTHOUSE``).
        self.address = f"http://{bracketed}:{port}"
        self._closed = False
        logger.info("sparkdist: torchft Lighthouse at %s", self.address)

    def close(self) -> None:
        """Stop the server (idempotent)."""
        if not self._closed:
            self._closed = True
            self._server.shutdown()

    def __enter__(self) -> Lighthouse:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
