"""Files as the tests look at them."""

from __future__ import annotations

import os
import stat


def mode_of(path: str | os.PathLike[str]) -> int:
    """The permission bits of ``path`` itself (a link is not followed)."""
    return stat.S_IMODE(os.lstat(path).st_mode)
