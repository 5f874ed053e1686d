"""How one field of a control-channel message is checked: small combinators, each a function
``(wire value, where) -> typed value`` that raises ``ProtocolError`` for anything else.

Types are checked exactly (``True`` is not an integer, ``1.0`` is not a rank), sizes against
the limits ``protocol`` passes in, and nothing recurses into what it does not expect.

Non-goals: which fields a message has (``protocol``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping
from typing import Any

INT64 = 1 << 63

Check = Callable[[Any, str], Any]


class ProtocolError(ValueError):
    """Bytes or a record that are not a valid message of the control channel (the only error
    ``protocol.decode`` and ``protocol.encode`` raise)."""


def integer(lo: int = -INT64, hi: int = INT64 - 1) -> Check:
    def check(value: Any, where: str) -> int:
        if type(value) is not int or not lo <= value <= hi:
            raise ProtocolError(f"{where} must be an integer in [{lo}, {hi}], got {show(value)}")
        return value

    return check


def number(value: Any, where: str) -> float:
    if type(value) not in (int, float) or not math.isfinite(value):
        raise ProtocolError(f"{where} must be a finite number, got {show(value)}")
    return float(value)


def boolean(value: Any, where: str) -> bool:
    if type(value) is not bool:
        raise ProtocolError(f"{where} must be true or false, got {show(value)}")
    return value


def text(max_chars: int) -> Check:
    def check(value: Any, where: str) -> str:
        if type(value) is not str:
            raise ProtocolError(f"{where} must be a string, got {show(value)}")
        if len(value) > max_chars:
            raise ProtocolError(
                f"{where} has {len(value)} characters, over the limit of {max_chars}"
            )
        return value

    return check


def hex_digits(count: int) -> Check:
    def check(value: Any, where: str) -> str:
        if type(value) is not str or len(value) != count or value.strip("0123456789abcdef"):
            raise ProtocolError(f"{where} must be {count} lowercase hex digits")
        return value

    return check


def optional(inner: Check) -> Check:
    def check(value: Any, where: str) -> Any:
        return None if value is None else inner(value, where)

    return check


def one_of(choices: Mapping[str, Any]) -> Check:
    """A string among ``choices``' keys, turned into its value."""

    def check(value: Any, where: str) -> Any:
        if type(value) is str and value in choices:
            return choices[value]
        raise ProtocolError(f"{where} must be one of {sorted(choices)}, got {show(value)}")

    return check


def mapping(key: Check, value: Check, max_items: int) -> Check:
    def check(raw: Any, where: str) -> dict[Any, Any]:
        if type(raw) is not dict:
            raise ProtocolError(f"{where} must be an object, got {show(raw)}")
        if len(raw) > max_items:
            raise ProtocolError(f"{where} has {len(raw)} entries, over the limit of {max_items}")
        return {key(k, where): value(v, where) for k, v in raw.items()}

    return check


def rank_key(value: Any, where: str) -> int:
    # JSON object keys are strings: a rank travels as its decimal digits.
    if type(value) is not str or not value.isascii() or not value.isdigit() or len(value) > 9:
        raise ProtocolError(f"{where} must be a rank (decimal digits), got {show(value)}")
    return int(value)


def member(allowed: Collection[str], what: str) -> Check:
    def check(value: Any, where: str) -> str:
        if type(value) is not str or value not in allowed:
            raise ProtocolError(
                f"{where} is {show(value)}, not {what} ({', '.join(sorted(allowed))})"
            )
        return value

    return check


def rows(max_rows: int, max_chars: int) -> Check:
    """A list of (host, package, wanted, found) rows."""
    cell = text(max_chars)

    def check(value: Any, where: str) -> tuple[tuple[str, str, str, str], ...]:
        # Tuples only ever come from a sender's own records; JSON has lists.
        if type(value) not in (list, tuple) or len(value) > max_rows:
            raise ProtocolError(f"{where} must be a list of at most {max_rows} rows")
        checked = []
        for i, row in enumerate(value):
            if type(row) not in (list, tuple) or len(row) != 4:
                raise ProtocolError(f"{where}[{i}] must be a list of 4 strings")
            checked.append(tuple(cell(item, where) for item in row))
        return tuple(checked)

    return check


def show(value: Any) -> str:
    """A short description of a refused value, for the error (never the whole of it)."""
    if isinstance(value, (str, bytes)):
        head = repr(value[:60]) + ("..." if len(value) > 60 else "")
    elif isinstance(value, (list, dict)):
        head = f"of {len(value)} item(s)"
    else:
        head = repr(value)[:60]
    return f"{type(value).__name__} {head}"
