"""The control channel's messages: every kind round-trips, and no input raises anything but
ProtocolError (property-based, with Hypothesis), with the refusals spelled out in a table."""

from __future__ import annotations

import json
import math
import pickle
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sparkdist._core.env import RENDEZVOUS_ENV_VARS, ROWS_PER_RANK_VAR
from sparkdist._wire import protocol
from sparkdist._wire.protocol import (
    MAX_LOG_CHARS,
    MAX_MESSAGE_BYTES,
    MAX_REASON_CHARS,
    ProtocolError,
    Route,
    decode,
    decode_batch,
    encode,
    encode_batch,
    from_wire,
)

# -- strategies: one per kind ------------------------------------------------------------------

ranks = st.integers(0, (1 << 31) - 1)
ports = st.integers(0, 65535)
int64 = st.integers(-(1 << 63), (1 << 63) - 1)
finite = st.floats(allow_nan=False, allow_infinity=False)
# Any code point, lone surrogates included: they travel escaped.
text = st.text(st.characters(codec=None, categories=None), max_size=200)
names = st.text(max_size=50)
hexes = st.binary(min_size=32, max_size=32).map(bytes.hex)
rows = st.tuples(names, names, names, names)

MESSAGES: dict[type, st.SearchStrategy] = {
    protocol.Hello: st.builds(protocol.Hello, node=ranks, host=names),
    protocol.Store: st.builds(protocol.Store, port=ports),
    protocol.Ready: st.builds(protocol.Ready, rank=ranks),
    protocol.Failed: st.builds(
        protocol.Failed,
        rank=ranks,
        exit_code=st.none() | int64,
        time=finite,
        hung=st.booleans(),
        last_beat=st.none() | finite,
    ),
    protocol.Rows: st.builds(
        protocol.Rows, counts=st.dictionaries(st.integers(0, 999_999_999), st.integers(0, 1 << 40))
    ),
    protocol.Refused: st.builds(
        protocol.Refused,
        node=ranks,
        host=names,
        reason=st.none() | text,
        rows=st.lists(rows, max_size=5).map(tuple),
    ),
    protocol.Bye: st.builds(protocol.Bye, node=ranks, dropped=st.integers(0, 1 << 40)),
    protocol.Log: st.builds(
        protocol.Log, rank=ranks, stream=st.sampled_from(protocol.Stream), line=text
    ),
    protocol.Report: st.builds(
        protocol.Report,
        rank=ranks,
        step=st.none() | int64,
        total=st.none() | int64,
        metrics=st.dictionaries(st.text(max_size=250), finite, max_size=10),
    ),
    protocol.Sample: st.builds(
        protocol.Sample,
        node=ranks,
        time=finite,
        metrics=st.dictionaries(st.text(max_size=250), finite, max_size=10),
        gpus=names,
    ),
    protocol.Beat: st.builds(protocol.Beat, rank=ranks),
    protocol.Done: st.builds(protocol.Done, rank=ranks, exit_code=st.integers(-64, 255)),
    protocol.Rendezvous: st.builds(
        protocol.Rendezvous,
        master_port=ports,
        env=st.dictionaries(st.sampled_from(sorted(RENDEZVOUS_ENV_VARS)), text),
    ),
    protocol.Abort: st.builds(protocol.Abort, reason=text),
    protocol.Preempted: st.builds(protocol.Preempted, why=text),
    protocol.Drain: st.builds(protocol.Drain, reason=text, grace_s=finite),
    protocol.ClientHello: st.builds(
        protocol.ClientHello, version=st.integers(0, 1 << 16), nonce=hexes
    ),
    protocol.ServerProof: st.builds(protocol.ServerProof, nonce=hexes, mac=hexes),
    protocol.ClientProof: st.builds(protocol.ClientProof, mac=hexes),
    protocol.Welcome: st.just(protocol.Welcome()),
    protocol.Alive: st.just(protocol.Alive()),
}
any_message = st.one_of(*MESSAGES.values())


def test_every_kind_has_a_strategy():
    assert set(MESSAGES) == {protocol.kind_of(tag) for tag in protocol._KINDS}


@given(any_message)
def test_every_message_round_trips(message):
    assert decode(encode(message)) == message


@given(st.lists(any_message, max_size=8))
def test_batches_round_trip(messages):
    assert decode_batch(encode_batch([encode(m) for m in messages])) == messages


@settings(suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=2048))
def test_arbitrary_bytes_raise_only_protocol_error(data):
    for reader in (decode, decode_batch):
        try:
            reader(data)
        except ProtocolError:
            pass


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner),
    max_leaves=30,
)
tags = st.sampled_from(sorted(protocol._KINDS)) | st.text(max_size=8)
field_names = st.sampled_from(
    ["node", "host", "port", "rank", "exit_code", "time", "hung", "last_beat", "counts",
     "reason", "rows", "dropped", "stream", "line", "step", "total", "metrics", "master_port",
     "env", "version", "nonce", "mac", "x"]
)  # fmt: skip
objects = st.builds(
    lambda tag, fields: {"t": tag, **fields},
    tags,
    st.dictionaries(field_names, json_values, max_size=6),
)


@given(objects | json_values)
def test_arbitrary_json_raises_only_protocol_error(value):
    try:
        data = json.dumps(value).encode()
    except ValueError:
        return
    for route in (None, *Route):
        try:
            decode(data, route)
        except ProtocolError:
            pass


@given(objects)
def test_decoded_records_encode_again(value):
    """Whatever decode accepts is a record encode accepts too (no half-checked records)."""
    try:
        message = from_wire(value)
    except ProtocolError:
        return
    assert decode(encode(message)) == message


log_like = st.builds(
    lambda fields: {"t": "log", **fields},
    st.dictionaries(
        st.sampled_from(["rank", "stream", "line", "x"]),
        json_values | ranks | st.sampled_from(["stdout", "stderr"]) | text,
    ),
)


@given(log_like)
def test_the_fast_path_for_lines_agrees_with_the_general_one(wire):
    kind = protocol._KINDS["log"]
    fast = protocol._fast_log(wire)
    try:
        general = protocol.Log(**protocol._check_fields(kind, wire))
    except ProtocolError:
        assert fast is None
    else:
        assert fast is None or (fast == general and type(fast.stream) is protocol.Stream)


# -- refusals, one per rule --------------------------------------------------------------------

DEEP = 100_000
REFUSED = [
    ("not json", b"\x80\x81"),
    ("pickle", pickle.dumps({"t": "hello", "node": 0, "host": "h"})),
    ("nested arrays", b"[" * DEEP + b"]" * DEEP),
    ("nested objects", b'{"a":' * DEEP + b"1" + b"}" * DEEP),
    ("nested in a field", b'{"t":"report","rank":0,"metrics":' + b"[" * DEEP + b"]" * DEEP + b"}"),
    ("huge integer", b'{"t":"ready","rank":' + b"9" * 5000 + b"}"),
    ("not an object", b"[1, 2]"),
    ("null", b"null"),
    ("no kind", b'{"rank": 0}'),
    ("kind not a string", b'{"t": ["hello"], "node": 0}'),
    ("unknown kind", b'{"t": "exec", "cmd": "sh"}'),
    ("missing field", b'{"t": "hello", "node": 0}'),
    ("unknown field", b'{"t": "ready", "rank": 0, "extra": 1}'),
    ("bool for int", b'{"t": "ready", "rank": true}'),
    ("float for int", b'{"t": "ready", "rank": 1.0}'),
    ("negative rank", b'{"t": "ready", "rank": -1}'),
    ("port out of range", b'{"t": "store", "port": 65536}'),
    ("string for int", b'{"t": "store", "port": "80"}'),
    ("NaN", b'{"t": "failed", "rank": 0, "exit_code": 1, "time": NaN}'),
    ("Infinity", b'{"t": "failed", "rank": 0, "exit_code": 1, "time": Infinity}'),
    ("overflowing float", b'{"t": "failed", "rank": 0, "exit_code": 1, "time": 1e999}'),
    ("stream", b'{"t": "log", "rank": 0, "stream": "stdin", "line": ""}'),
    ("rank key", b'{"t": "rows", "counts": {"one": 1}}'),
    ("unicode digit key", '{"t": "rows", "counts": {"²": 1}}'.encode()),
    ("short row", b'{"t": "refused", "node": 0, "host": "h", "reason": null, "rows": [["a"]]}'),
    ("metric value", b'{"t": "report", "rank": 0, "metrics": {"loss": "low"}}'),
    ("sample value", b'{"t": "sample", "node": 0, "time": 1, "metrics": {"cpu": "high"}}'),
    ("sample time", b'{"t": "sample", "node": 0, "time": "now"}'),
    ("sample gpus", b'{"t": "sample", "node": 0, "time": 1, "gpus": [0, 1]}'),
    ("env LD_PRELOAD", b'{"t": "rendezvous", "master_port": 1, "env": {"LD_PRELOAD": "/x.so"}}'),
    ("env MASTER_ADDR", b'{"t": "rendezvous", "master_port": 1, "env": {"MASTER_ADDR": "e"}}'),
    ("env value type", b'{"t": "rendezvous", "master_port": 1, "env": {"MLFLOW_RUN_ID": 1}}'),
    ("nonce length", b'{"t": "c_hello", "version": 2, "nonce": "abcd"}'),
    ("nonce case", b'{"t": "c_proof", "mac": "' + b"A" * 64 + b'"}'),
    ("long line", b'{"t": "log", "rank": 0, "stream": "stdout", "line": "'
     + b"x" * (MAX_LOG_CHARS + 1) + b'"}'),
    ("too big", b" " * (MAX_MESSAGE_BYTES + 1)),
]  # fmt: skip


@pytest.mark.parametrize("data", [d for _, d in REFUSED], ids=[name for name, _ in REFUSED])
def test_refused(data):
    with pytest.raises(ProtocolError):
        decode(data)


ROUTES = [
    (b'{"t": "rendezvous", "master_port": 1}', Route.TO_DRIVER),  # agents never send it
    (b'{"t": "abort", "reason": "x"}', Route.TO_DRIVER),
    (b'{"t": "hello", "node": 0, "host": "h"}', Route.TO_AGENT),
    (b'{"t": "log", "rank": 0, "stream": "stdout", "line": ""}', Route.HANDSHAKE),
    (b'{"t": "c_proof", "mac": "' + b"a" * 64 + b'"}', Route.TO_DRIVER),
    (b'{"t": "beat", "rank": 0}', Route.TO_DRIVER),  # the worker's pipe only
    (b'{"t": "sample", "node": 0, "time": 1}', Route.WORKER),  # the agent's own
    (b'{"t": "drain", "reason": "x", "grace_s": 2}', Route.TO_DRIVER),  # the driver's word
    (b'{"t": "preempted", "why": "x"}', Route.TO_AGENT),  # a notice goes up, never down
]


@pytest.mark.parametrize(("data", "route"), ROUTES)
def test_a_kind_travels_only_its_way(data, route):
    decode(data)  # valid in itself
    with pytest.raises(ProtocolError, match="may not travel"):
        decode(data, route)
    with pytest.raises(ProtocolError, match="may not travel"):
        encode(decode(data), route)


def test_encode_refuses_what_decode_would_and_names_the_limit():
    with pytest.raises(ProtocolError, match=f"over the limit of {MAX_LOG_CHARS}"):
        encode(protocol.Log(0, protocol.Stream.STDOUT, "x" * (MAX_LOG_CHARS + 1)))
    with pytest.raises(ProtocolError, match="integer"):
        encode(protocol.Ready(rank=True))  # type: ignore[arg-type]
    with pytest.raises(ProtocolError, match="not a variable the rendezvous may set"):
        encode(protocol.Rendezvous(1, {"LD_PRELOAD": "/tmp/x.so"}))
    with pytest.raises(ProtocolError, match="entries, over the limit"):
        encode(protocol.Report(0, metrics={f"m{i}": 1.0 for i in range(protocol.MAX_METRICS + 1)}))
    with pytest.raises(ProtocolError, match="finite"):
        encode(protocol.Report(0, metrics={"loss": math.nan}))
    with pytest.raises(ProtocolError, match="not a message"):
        encode({"t": "ready", "rank": 0})  # type: ignore[arg-type]


def test_the_largest_valid_messages_fit_a_frame():
    # 64 Ki astral characters escape to 12 bytes each: still one message, under the limit.
    line = protocol.Log(0, protocol.Stream.STDERR, "\U0001f600" * MAX_LOG_CHARS)
    assert len(encode(line)) <= MAX_MESSAGE_BYTES
    report = protocol.Report(
        0, 1, 2, {f"{i:0250d}": -1.2345678901234567e-300 for i in range(protocol.MAX_METRICS)}
    )
    assert len(encode(report)) <= MAX_MESSAGE_BYTES
    sample = protocol.Sample(
        0, 1.0, {f"{i:0250d}": -1.2345678901234567e-300 for i in range(protocol.MAX_METRICS)}
    )
    assert len(encode(sample)) <= MAX_MESSAGE_BYTES


def test_long_lines_travel_as_chunks_and_long_reasons_are_cut():
    chunks = protocol.log_chunks(3, "stderr", "y" * (2 * MAX_LOG_CHARS + 5))
    assert [len(c.line) for c in chunks] == [MAX_LOG_CHARS, MAX_LOG_CHARS, 5]
    assert {(c.rank, c.stream) for c in chunks} == {(3, protocol.Stream.STDERR)}
    abort = protocol.Abort("z" * (3 * MAX_REASON_CHARS))
    assert len(abort.reason) == MAX_REASON_CHARS and abort.reason.endswith("(cut)")
    assert decode(encode(abort)) == abort


def test_preemption_travels_up_as_a_notice_and_down_as_a_drain():
    notice = protocol.Preempted("rank 1 got SIGTERM")
    assert decode(encode(notice, Route.WORKER), Route.TO_DRIVER) == notice
    drain = protocol.Drain("the driver got SIGTERM", 25.0)
    assert decode(encode(drain, Route.TO_AGENT), Route.WORKER) == drain
    assert protocol.to_wire(drain) == {
        "t": "drain", "reason": "the driver got SIGTERM", "grace_s": 25.0
    }  # fmt: skip
    assert len(protocol.Preempted("w" * (2 * MAX_REASON_CHARS)).why) == MAX_REASON_CHARS
    with pytest.raises(ProtocolError, match="finite"):
        decode(b'{"t": "drain", "reason": "x", "grace_s": 1e999}')


def test_rendezvous_carries_the_allowed_variables():
    env = {ROWS_PER_RANK_VAR: "[1, 2]", "MLFLOW_RUN_ID": "abc"}
    message = decode(encode(protocol.Rendezvous(29500, env)), Route.TO_AGENT)
    assert message == protocol.Rendezvous(29500, env)


def test_the_wire_form_of_a_record():
    failed = decode(b'{"t": "failed", "rank": 2, "exit_code": null, "time": 5}')
    assert protocol.to_wire(failed) == {
        "t": "failed", "rank": 2, "exit_code": None, "time": 5.0, "hung": False, "last_beat": None
    }  # fmt: skip
    rows = protocol.to_wire(protocol.Rows({0: 5, 1: 6}))
    assert rows == {"t": "rows", "counts": {"0": 5, "1": 6}}
    with pytest.raises(ProtocolError, match="not a message of the control channel"):
        protocol.to_wire({"t": "ready", "rank": 0})  # type: ignore[arg-type]


def test_a_fresh_interpreter_decodes_what_this_one_encodes():
    messages = [
        protocol.Log(1, protocol.Stream.STDOUT, "caf\xe9 \ud800"),
        protocol.Refused(0, "h", None, (("h", "torch", "2.1", "missing"),)),
        protocol.Rows({0: 10, 7: 3}),
    ]
    payload = encode_batch([encode(m) for m in messages])
    code = (
        "import sys; from sparkdist._wire import protocol as p; "
        "ms = p.decode_batch(sys.stdin.buffer.read()); "
        "sys.stdout.write(repr([(type(m).__name__, p.encode(m)) for m in ms]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], input=payload, capture_output=True, check=True, timeout=60
    ).stdout.decode()
    assert out == repr([(type(m).__name__, encode(m)) for m in messages])


def test_a_report_that_cannot_travel_fails_at_its_call():
    """Not dropped on the way (which would silently cut the node off): the rank's own call
    raises, naming the size and the limit."""
    from sparkdist import runtime

    runtime.report(step=1, loss=0.5)  # outside a rank: nothing, no error
    with pytest.raises(ValueError, match="1001 entries, over the limit of 1000"):
        runtime.report(step=1, **{f"m{i}": 1.0 for i in range(1001)})
    with pytest.raises(ValueError, match="over the limit of 250"):
        runtime.report(**{"x" * 251: 1.0})
