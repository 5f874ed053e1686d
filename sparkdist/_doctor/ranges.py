"""The doctor's verdict on a package's version: inside sparkdist's tested range or not
(``_core.supported`` defines the ranges).

Non-goals: finding the versions (the checks that call this).
"""

from __future__ import annotations

from sparkdist._core.supported import BY_NAME, describe
from sparkdist._doctor.table import Check, Status


def in_range(name: str, version: str, found: str | None = None) -> Check:
    """OK when ``version`` of ``name`` is in its tested range; else a NOTE with the fix (an
    untested version may work, but nothing here has shown that it does). ``found`` is the
    row's text (default: the version and its range)."""
    text = found if found is not None else describe(name, version)
    entry = BY_NAME[name]
    if entry.holds(version):
        return Check(name, Status.OK, text)
    return Check(name, Status.NOTE, text, entry.fix())
