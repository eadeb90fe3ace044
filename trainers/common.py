"""Small helpers shared by the trainers."""
from __future__ import annotations

import datetime
import os
import sys


def log(line: str) -> None:
    """One write per line: ranks sharing a stdout pipe never splice each other's lines."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def pg_timeout() -> datetime.timedelta:
    """Collectives give up on a dead peer after this long (set by the entrypoint; default 60 s)."""
    return datetime.timedelta(seconds=float(os.environ.get("FABTRAIN_PG_TIMEOUT", 60)))
