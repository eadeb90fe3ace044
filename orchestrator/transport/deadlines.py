"""Deadlines of the remote steps, seconds: a host that passes one is named as stuck, and the
other hosts are still served."""

from __future__ import annotations

import os

STATUS_TIMEOUT = 10
# docker run: may create the output directory and start a large image; ended on the host before
# this passes (sshargs.bounded). FABTRAIN_START_TIMEOUT: tests wait seconds, not two minutes.
START_TIMEOUT = float(os.environ.get("FABTRAIN_START_TIMEOUT", "120"))
STOP_MARGIN = 15  # beyond the stop grace period
COPY_TIMEOUT = 600  # one rsync (code, a snapshot, the outputs); rsync's own I/O timeout is shorter
