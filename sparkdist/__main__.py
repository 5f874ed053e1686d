"""``python -m sparkdist``: the same command line as the ``sparkdist`` script."""

from __future__ import annotations

from sparkdist.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
