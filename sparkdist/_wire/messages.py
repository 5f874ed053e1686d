"""Every message of the control channel (and of a rank's pipes), as a frozen dataclass, with
the limits the wire holds them to.

A message's kind (``kind``: ``"hello"``, ``"log"``...) names it on the wire; which way it may
travel is its ``Route``. The records carry no checks of their own beyond cutting over-long
reasons: ``protocol`` checks every field on the way out and on the way in.

Non-goals: encoding and decoding (``protocol``), sockets and framing (``channel``, ``frames``).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import ClassVar, TypeAlias

#: The handshake's protocol version: a driver and an agent of different versions never pair.
#: 3: link beats (``Alive``) both ways; 4: preemption notices (``Preempted``, ``Drain``);
#: 5: a node's GPUs in its hello, every task's in the rendezvous (ranks numbered by host).
PROTOCOL_VERSION = 5
#: Largest frame payload (a batch of messages) after the handshake.
MAX_FRAME_BYTES = 1 << 20
#: Largest single message: one always fits in a frame on its own.
MAX_MESSAGE_BYTES = MAX_FRAME_BYTES - 16
#: Largest frame during the handshake.
MAX_HANDSHAKE_BYTES = 1024
#: Longest output line in one ``Log``; a longer one travels as several (``log_chunks``).
MAX_LOG_CHARS = 64 * 1024
#: Longest reason (abort, refusal): longer ones are cut on construction, not refused.
MAX_REASON_CHARS = 16 * 1024
#: Longest host name, metric name, package row cell.
MAX_NAME_CHARS = 1024
MAX_METRIC_NAME_CHARS = 250  # MLflow's limit for a metric key
#: Most metrics in one ``runtime.report()``.
MAX_METRICS = 1000
#: Most rows in a refusal (one per unmet requirement) or row counts in one ``Rows``.
MAX_ROWS = 4096
#: Longest value of a rendezvous variable (the row counts of a very large world fit).
MAX_ENV_VALUE_CHARS = 256 * 1024
#: Nonces and MACs are 32 bytes, sent as 64 hex digits.
NONCE_BYTES = 32


class Route(enum.Enum):
    """Where a kind of message may travel."""

    TO_DRIVER = "agent to driver"
    TO_AGENT = "driver to agent"
    HANDSHAKE = "handshake"
    WORKER = "worker to agent (its pipe)"


class Stream(str, enum.Enum):
    STDOUT = "stdout"
    STDERR = "stderr"


def _clip(text: str, limit: int = MAX_REASON_CHARS) -> str:
    """Reasons are for people: an over-long one is cut (its start says what happened)."""
    if len(text) <= limit:
        return text
    marker = " ... (cut)"
    return text[: limit - len(marker)] + marker


# -- the messages ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Hello:
    """Agent to driver: this node passed its checks and spawned its ranks; ``gpus`` are its
    task's GPUs (a comma list, empty on CPU), which the rendezvous shares with its host-mates."""

    node: int
    host: str
    gpus: str = ""
    kind: ClassVar[str] = "hello"


@dataclass(frozen=True)
class Store:
    """Agent to driver (and worker to agent): rank 0's store listens on ``port``."""

    port: int
    kind: ClassVar[str] = "store"


@dataclass(frozen=True)
class Ready:
    """Agent to driver: ``rank`` received the rendezvous and runs the user's code."""

    rank: int
    kind: ClassVar[str] = "ready"


@dataclass(frozen=True)
class Failed:
    """Agent to driver: ``rank`` failed on its own (exited non-zero, died, or hung).

    Attributes:
        rank: the global rank.
        exit_code: its exit status (negative: a signal), None when it did not exit (a hang).
        time: wall-clock time the agent saw it (seconds since the epoch).
        hung: it stopped sending heartbeats.
        last_beat: for a hang, the wall-clock time of its last heartbeat.
    """

    rank: int
    exit_code: int | None
    time: float
    hung: bool = False
    last_beat: float | None = None
    kind: ClassVar[str] = "failed"


@dataclass(frozen=True)
class Rows:
    """Agent to driver: DataFrame rows each of this node's ranks got, by global rank."""

    counts: Mapping[int, int]
    kind: ClassVar[str] = "rows"


@dataclass(frozen=True)
class Refused:
    """Agent to driver: this node will not start its ranks.

    Attributes:
        node: the node.
        host: its host.
        reason: why, in words (a wrong GPU type), or None.
        rows: unmet package requirements, as (host, package, wanted, found).
    """

    node: int
    host: str
    reason: str | None
    rows: tuple[tuple[str, str, str, str], ...] = ()
    kind: ClassVar[str] = "refused"

    def __post_init__(self) -> None:
        if self.reason is not None:
            object.__setattr__(self, "reason", _clip(self.reason))


@dataclass(frozen=True)
class Bye:
    """Agent to driver, last: every rank of ``node`` ended and all its output was sent,
    except ``dropped`` lines (and reports, samples) that the driver could not take in time."""

    node: int
    dropped: int = 0
    kind: ClassVar[str] = "bye"


@dataclass(frozen=True)
class Log:
    """Agent to driver: one line a rank printed (without its newline)."""

    rank: int
    stream: Stream
    line: str
    kind: ClassVar[str] = "log"


@dataclass(frozen=True)
class Report:
    """Agent to driver (and worker to agent): a rank's ``runtime.report()``."""

    rank: int
    step: int | None = None
    total: int | None = None
    metrics: Mapping[str, float] = field(default_factory=dict)
    kind: ClassVar[str] = "report"


@dataclass(frozen=True)
class Sample:
    """Agent to driver: one node's system metrics (``_node.agent.sampler``).

    Attributes:
        node: the node.
        time: wall-clock time of the sample (seconds since the epoch).
        metrics: values by MLflow's system-metric names without the ``system/`` prefix
            (``cpu_utilization_percentage``, ``gpu_0_power_usage_watts``...).
        gpus: the node's GPU addresses in local-rank order, comma-separated ("" on CPU).
    """

    node: int
    time: float
    metrics: Mapping[str, float] = field(default_factory=dict)
    gpus: str = ""
    kind: ClassVar[str] = "sample"


@dataclass(frozen=True)
class Beat:
    """Worker to agent: this rank is alive (``runtime.heartbeat()``)."""

    rank: int
    kind: ClassVar[str] = "beat"


@dataclass(frozen=True)
class Done:
    """Worker to agent: ``rank`` wrote its outcome (its value or failure file) and now exits
    with ``exit_code``; nothing it does after this changes the run (``watchdog``)."""

    rank: int
    exit_code: int
    kind: ClassVar[str] = "done"


@dataclass(frozen=True)
class Alive:
    """Either way on the control channel: this end is still there (``liveness``); sent when
    nothing else went for a beat's interval."""

    kind: ClassVar[str] = "alive"


@dataclass(frozen=True)
class Rendezvous:
    """Driver to agent: the store's port, the variables every rank gets before it runs user
    code (only those of ``RENDEZVOUS_ENV_VARS``) and every task's GPUs by node (what each
    said in its hello). Agent to rank: the same, with ``visible_devices``, the GPUs of every
    task on its host in local-rank order (``_core.numbering.host_visible_devices``), which
    become its ``CUDA_VISIBLE_DEVICES`` before CUDA starts."""

    master_port: int
    env: Mapping[str, str] = field(default_factory=dict)
    task_gpus: Mapping[int, str] = field(default_factory=dict)
    visible_devices: str = ""
    kind: ClassVar[str] = "rendezvous"


@dataclass(frozen=True)
class Abort:
    """Driver to agent: end every rank now, for ``reason``."""

    reason: str
    kind: ClassVar[str] = "abort"

    def __post_init__(self) -> None:
        object.__setattr__(self, "reason", _clip(self.reason))


@dataclass(frozen=True)
class Preempted:
    """Agent to driver (and worker to agent): a preemption notice reached this node: SIGTERM
    to a rank or to the agent's process, SIGHUP to the agent from an executor shutting down.

    Attributes:
        why: what and where, in words ("rank 1 got SIGTERM" from a rank; "node 1 (host
            10.0.0.3): rank 1 got SIGTERM" from its agent).
    """

    why: str
    kind: ClassVar[str] = "preempted"

    def __post_init__(self) -> None:
        object.__setattr__(self, "why", _clip(self.why))


@dataclass(frozen=True)
class Drain:
    """Driver to agent (and agent to worker): the run is preempted: every rank's
    ``runtime.should_stop()`` answers True from now on, and ranks still running ``grace_s``
    seconds after the notice are stopped.

    Attributes:
        reason: the first notice's ``why`` ("the driver got SIGTERM").
        grace_s: the run's ``preemption_grace_s``.
    """

    reason: str
    grace_s: float
    kind: ClassVar[str] = "drain"

    def __post_init__(self) -> None:
        object.__setattr__(self, "reason", _clip(self.reason))


@dataclass(frozen=True)
class ClientHello:
    """Handshake, agent first: its protocol version and a fresh nonce."""

    version: int
    nonce: str
    kind: ClassVar[str] = "c_hello"


@dataclass(frozen=True)
class ServerProof:
    """Handshake, driver: its fresh nonce and its proof of the secret over both nonces."""

    nonce: str
    mac: str
    kind: ClassVar[str] = "s_proof"


@dataclass(frozen=True)
class ClientProof:
    """Handshake, agent, once the driver's proof checked out: its own proof."""

    mac: str
    kind: ClassVar[str] = "c_proof"


@dataclass(frozen=True)
class Welcome:
    """The driver's first authenticated frame: the agent is in."""

    kind: ClassVar[str] = "welcome"


Message: TypeAlias = (
    Hello
    | Store
    | Ready
    | Failed
    | Rows
    | Refused
    | Bye
    | Log
    | Report
    | Sample
    | Beat
    | Done
    | Alive
    | Rendezvous
    | Abort
    | Preempted
    | Drain
    | ClientHello
    | ServerProof
    | ClientProof
    | Welcome
)


def log_chunks(rank: int, stream: Stream | str, text: str) -> list[Log]:
    """``text`` as ``Log`` messages that each fit the limit (an over-long line is cut up)."""
    kind = Stream(stream)
    if len(text) <= MAX_LOG_CHARS:
        return [Log(rank, kind, text)]
    return [
        Log(rank, kind, text[start : start + MAX_LOG_CHARS])
        for start in range(0, len(text), MAX_LOG_CHARS)
    ]
