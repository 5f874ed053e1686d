"""The control channel's one encoder and decoder, for the records of ``messages``.

A message is a frozen dataclass (``messages``; each is re-exported here, as ``protocol.Hello``).
On the wire it is one JSON object whose ``"t"`` names its kind. ``decode`` is the only way in:
it checks the kind, that every field is present (or has a default), that nothing else is, and
each field's type and size, and raises ``ProtocolError`` on anything else, whatever the bytes
(it never unpickles; the JSON parser's depth is bounded and every field's shape is fixed, so no
input reaches a ``RecursionError`` or a ``TypeError``). ``encode`` checks the same rules on the
way out, so a record that would be refused is refused at its sender, naming the field, its size
and the limit.

Which way a kind may travel is part of its definition (``Route``): the driver accepts only
what agents send, an agent only what the driver sends, and a handshake only handshake kinds.
A frame of the channel carries a batch: a JSON array of messages (``encode_batch``).

Non-goals: the records themselves (``messages``), sockets, authentication, framing
(``channel``), what a message means (the agent and the supervisor decide).
"""

from __future__ import annotations

import dataclasses
import enum
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from sparkdist._core.env import RENDEZVOUS_ENV_VARS
from sparkdist._wire.fields import (
    Check,
    ProtocolError,
    boolean,
    hex_digits,
    integer,
    mapping,
    member,
    number,
    one_of,
    optional,
    rank_key,
    rows,
    show,
    text,
)
from sparkdist._wire.messages import (
    MAX_ENV_VALUE_CHARS,
    MAX_FRAME_BYTES,
    MAX_HANDSHAKE_BYTES,
    MAX_LOG_CHARS,
    MAX_MESSAGE_BYTES,
    MAX_METRIC_NAME_CHARS,
    MAX_METRICS,
    MAX_NAME_CHARS,
    MAX_REASON_CHARS,
    MAX_ROWS,
    NONCE_BYTES,
    PROTOCOL_VERSION,
    Abort,
    Alive,
    Beat,
    Bye,
    ClientHello,
    ClientProof,
    Done,
    Drain,
    Failed,
    Hello,
    Log,
    Message,
    Preempted,
    Ready,
    Refused,
    Rendezvous,
    Report,
    Route,
    Rows,
    Sample,
    ServerProof,
    Store,
    Stream,
    Welcome,
    log_chunks,
)

__all__ = [
    "Abort",
    "Alive",
    "Beat",
    "Bye",
    "ClientHello",
    "ClientProof",
    "Done",
    "Drain",
    "Failed",
    "Hello",
    "Log",
    "MAX_ENV_VALUE_CHARS",
    "MAX_FRAME_BYTES",
    "MAX_HANDSHAKE_BYTES",
    "MAX_LOG_CHARS",
    "MAX_MESSAGE_BYTES",
    "MAX_METRICS",
    "MAX_METRIC_NAME_CHARS",
    "MAX_NAME_CHARS",
    "MAX_REASON_CHARS",
    "MAX_ROWS",
    "Message",
    "NONCE_BYTES",
    "PROTOCOL_VERSION",
    "Preempted",
    "ProtocolError",
    "Ready",
    "Refused",
    "Rendezvous",
    "Report",
    "Route",
    "Rows",
    "Sample",
    "ServerProof",
    "Store",
    "Stream",
    "Welcome",
    "decode",
    "decode_batch",
    "encode",
    "encode_batch",
    "from_wire",
    "kind_of",
    "log_chunks",
    "to_wire",
]

_NODE = integer(0, (1 << 31) - 1)
_RANK = integer(0, (1 << 31) - 1)
_PORT = integer(0, 65535)
_HOST = text(MAX_NAME_CHARS)
_REASON = text(MAX_REASON_CHARS)
_HEX = hex_digits(2 * NONCE_BYTES)
_STREAM = one_of({"stdout": Stream.STDOUT, "stderr": Stream.STDERR})
_ENV_KEY = member(RENDEZVOUS_ENV_VARS, "a variable the rendezvous may set")
_METRICS = mapping(text(MAX_METRIC_NAME_CHARS), number, MAX_METRICS)


@dataclass(frozen=True)
class _Kind:
    cls: type[Any]
    routes: tuple[Route, ...]  # a tuple: enum members hash in Python, compare by identity
    fields: tuple[tuple[str, Check, bool, str], ...]  # (name, check, required, label)
    names: tuple[str, ...]
    to_wire: Callable[[Any], dict[str, Any]]


def _plain(message: Any) -> dict[str, Any]:
    wire: dict[str, Any] = {"t": message.kind}
    for name in _BY_CLASS[type(message)].names:
        value = getattr(message, name)
        wire[name] = value.value if isinstance(value, enum.Enum) else value
    return wire


def _kinds() -> dict[str, _Kind]:
    to_driver, to_agent = Route.TO_DRIVER, Route.TO_AGENT
    hs, worker = Route.HANDSHAKE, Route.WORKER
    table: list[tuple[type[Any], frozenset[Route], tuple[tuple[str, Check, bool], ...]]] = [
        (
            Hello,
            frozenset({to_driver}),
            (("node", _NODE, True), ("host", _HOST, True), ("gpus", _HOST, False)),
        ),
        (Store, frozenset({to_driver, worker}), (("port", _PORT, True),)),
        (Ready, frozenset({to_driver, worker}), (("rank", _RANK, True),)),
        (
            Failed,
            frozenset({to_driver}),
            (
                ("rank", _RANK, True),
                ("exit_code", optional(integer()), True),
                ("time", number, True),
                ("hung", boolean, False),
                ("last_beat", optional(number), False),
            ),
        ),
        (
            Rows,
            frozenset({to_driver}),
            (("counts", mapping(rank_key, integer(0), MAX_ROWS), True),),
        ),
        (
            Refused,
            frozenset({to_driver}),
            (
                ("node", _NODE, True),
                ("host", _HOST, True),
                ("reason", optional(_REASON), True),
                ("rows", rows(MAX_ROWS, MAX_NAME_CHARS), False),
            ),
        ),
        (Bye, frozenset({to_driver}), (("node", _NODE, True), ("dropped", integer(0), False))),
        (
            Log,
            frozenset({to_driver}),
            (("rank", _RANK, True), ("stream", _STREAM, True), ("line", text(MAX_LOG_CHARS), True)),
        ),
        (
            Report,
            frozenset({to_driver, worker}),
            (
                ("rank", _RANK, True),
                ("step", optional(integer()), False),
                ("total", optional(integer()), False),
                ("metrics", _METRICS, False),
            ),
        ),
        (
            Sample,
            frozenset({to_driver}),
            (
                ("node", _NODE, True),
                ("time", number, True),
                ("metrics", _METRICS, False),
                ("gpus", _HOST, False),
            ),
        ),
        (Beat, frozenset({worker}), (("rank", _RANK, True),)),
        (Done, frozenset({worker}), (("rank", _RANK, True), ("exit_code", integer(), True))),
        (Alive, frozenset({to_driver, to_agent}), ()),
        (
            Rendezvous,
            frozenset({to_agent, worker}),
            (
                ("master_port", _PORT, True),
                (
                    "env",
                    mapping(_ENV_KEY, text(MAX_ENV_VALUE_CHARS), len(RENDEZVOUS_ENV_VARS)),
                    False,
                ),
                ("task_gpus", mapping(rank_key, _HOST, MAX_ROWS), False),
                ("visible_devices", _HOST, False),
            ),
        ),
        (Abort, frozenset({to_agent}), (("reason", _REASON, True),)),
        (Preempted, frozenset({to_driver, worker}), (("why", _REASON, True),)),
        (
            Drain,
            frozenset({to_agent, worker}),
            (("reason", _REASON, True), ("grace_s", number, True)),
        ),
        (
            ClientHello,
            frozenset({hs}),
            (("version", integer(0, 1 << 16), True), ("nonce", _HEX, True)),
        ),
        (ServerProof, frozenset({hs}), (("nonce", _HEX, True), ("mac", _HEX, True))),
        (ClientProof, frozenset({hs}), (("mac", _HEX, True),)),
        (Welcome, frozenset({to_agent}), ()),
    ]
    wire_forms: dict[type[Any], Callable[[Any], dict[str, Any]]] = {
        Rows: lambda m: {"t": "rows", "counts": {str(r): n for r, n in m.counts.items()}},
        Refused: lambda m: {**_plain(m), "rows": [list(row) for row in m.rows]},
        Report: lambda m: {**_plain(m), "metrics": dict(m.metrics)},
        Sample: lambda m: {**_plain(m), "metrics": dict(m.metrics)},
        Rendezvous: lambda m: {
            **_plain(m),
            "env": dict(m.env),
            "task_gpus": {str(node): gpus for node, gpus in m.task_gpus.items()},
        },
    }
    return {
        cls.kind: _Kind(
            cls,
            tuple(routes),
            tuple(
                (name, check, required, f"{cls.kind}.{name}") for name, check, required in fields
            ),
            tuple(f.name for f in dataclasses.fields(cls)),
            wire_forms.get(cls, _plain),
        )
        for cls, routes, fields in table
    }


_KINDS = _kinds()
_BY_CLASS = {kind.cls: kind for kind in _KINDS.values()}


# -- encoding and decoding ---------------------------------------------------------------------


def to_wire(message: Message) -> dict[str, Any]:
    """The JSON object ``message`` travels as (checked like ``encode``)."""
    kind = _BY_CLASS.get(type(message))
    if kind is None:
        raise ProtocolError(f"{type(message).__name__} is not a message of the control channel")
    wire = kind.to_wire(message)
    _check_fields(kind, wire)  # the sender hears of a bad record, not its receiver
    return wire


def encode(message: Message, route: Route | None = None) -> bytes:
    """The bytes of one message; ``ProtocolError`` for a record ``decode`` would refuse.

    Args:
        message: the record.
        route: when given, ``message`` must be of a kind that may travel this way.

    Example:
        >>> encode(Ready(rank=3))
        b'{"t":"ready","rank":3}'
    """
    kind = _BY_CLASS.get(type(message))
    if kind is None:
        raise ProtocolError(f"{type(message).__name__} is not a message of the control channel")
    if route is not None and route not in kind.routes:
        raise ProtocolError(f"a {message.kind!r} message may not travel {route.value}")
    wire = kind.to_wire(message)
    _check_fields(kind, wire)  # the sender hears of a bad record, not its receiver
    data = _ENCODER.encode(wire).encode()
    if len(data) > MAX_MESSAGE_BYTES:
        raise ProtocolError(
            f"a {message.kind!r} message of {len(data)} bytes exceeds the control channel's "
            f"limit of {MAX_MESSAGE_BYTES} bytes"
        )
    return data


def decode(data: bytes, route: Route | None = None) -> Message:
    """The message in ``data``; ``ProtocolError`` for anything else.

    Args:
        data: one encoded message.
        route: when given, only kinds that may travel this way are accepted.
    """
    return from_wire(_parse(data, MAX_MESSAGE_BYTES), route)


def encode_batch(encoded: Sequence[bytes]) -> bytes:
    """One frame's payload from messages already ``encode``d."""
    return b"[" + b",".join(encoded) + b"]"


def decode_batch(data: bytes, route: Route | None = None) -> list[Message]:
    """The messages of one frame's payload (``encode_batch``); ``ProtocolError`` otherwise."""
    items = _parse(data, MAX_FRAME_BYTES)
    if type(items) is not list:
        raise ProtocolError(f"a frame must hold a list of messages, got {show(items)}")
    return [from_wire(item, route) for item in items]


def from_wire(wire: Any, route: Route | None = None) -> Message:
    """The message a parsed JSON object stands for; ``ProtocolError`` for anything else."""
    if type(wire) is not dict:
        raise ProtocolError(f"a message must be a JSON object, got {show(wire)}")
    tag = wire.get("t")
    kind = _KINDS.get(tag) if type(tag) is str else None
    if kind is None:
        raise ProtocolError(f"unknown message kind {show(tag)}")
    if route is not None and route not in kind.routes:
        raise ProtocolError(f"a {tag!r} message may not travel {route.value}")
    if tag == "log":
        fast = _fast_log(wire)
        if fast is not None:
            return fast
    return kind.cls(**_check_fields(kind, wire))  # type: ignore[no-any-return]


_STREAMS = {"stdout": Stream.STDOUT, "stderr": Stream.STDERR}
_MAX_RANK = (1 << 31) - 1


def _fast_log(wire: dict[str, Any]) -> Log | None:
    """The same checks as ``_check_fields`` for the one kind that comes by the hundred
    thousand, in a third of the time; None sends anything unusual down the general path
    (which says precisely what is wrong)."""
    rank, line, name = wire.get("rank"), wire.get("line"), wire.get("stream")
    stream = _STREAMS.get(name) if type(name) is str else None
    if (
        len(wire) == 4
        and type(rank) is int
        and 0 <= rank <= _MAX_RANK
        and type(line) is str
        and len(line) <= MAX_LOG_CHARS
        and stream is not None
    ):
        log = object.__new__(Log)
        # What the frozen dataclass's __init__ would store, without its per-field setattr.
        log.__dict__.update(rank=rank, stream=stream, line=line)
        return log
    return None


def _check_fields(kind: _Kind, wire: dict[str, Any]) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for name, check, required, label in kind.fields:
        if name in wire:
            values[name] = check(wire[name], label)
        elif required:
            raise ProtocolError(f"a {kind.cls.kind!r} message lacks its {name!r} field")
    if len(wire) != len(values) + 1:
        extra = sorted(str(k) for k in wire if k != "t" and k not in values)
        raise ProtocolError(f"a {kind.cls.kind!r} message has unknown field(s) {extra[:5]}")
    return values


def _reject_constant(name: str) -> Any:
    raise ProtocolError(f"{name} is not a number this protocol carries")


# One encoder and one decoder, made once: ``json.dumps``/``loads`` with options make new ones
# per call. ASCII output: a lone surrogate in a line travels escaped and comes back intact.
_ENCODER = json.JSONEncoder(separators=(",", ":"), allow_nan=False)
_DECODER = json.JSONDecoder(parse_constant=_reject_constant)


def _parse(data: bytes, limit: int) -> Any:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ProtocolError(f"expected bytes, got {type(data).__name__}")
    if len(data) > limit:
        raise ProtocolError(f"{len(data)} bytes exceed the limit of {limit}")
    try:
        text = bytes(data).decode("utf-8")
        # The C parser bounds its own nesting (RecursionError past the interpreter's limit);
        # nothing deeper than three levels is valid anyway.
        # raw_decode: the C scanner alone (decode would add two regex passes for whitespace,
        # which encode never writes and nothing else may).
        value, end = _DECODER.raw_decode(text)
        if end != len(text):
            raise ProtocolError(f"{len(text) - end} bytes follow the message")
        return value
    except ProtocolError:
        raise
    except (ValueError, RecursionError, MemoryError) as exc:
        raise ProtocolError(f"not a JSON message: {str(exc)[:200]}") from None


def kind_of(tag: str) -> type[Any] | None:
    """The record class of a wire tag (``"log"`` -> ``Log``), or None."""
    kind = _KINDS.get(tag)
    return None if kind is None else kind.cls
