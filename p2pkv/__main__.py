"""``python -m p2pkv``: the same as the ``p2pkv`` command."""

from __future__ import annotations

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
