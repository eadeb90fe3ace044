"""Prints N numbered lines as fast as it can (no torch.distributed): the log benchmark's source."""

import os
import sys

n = int(sys.argv[1]) if len(sys.argv) > 1 else 200_000
node = os.environ.get("FABTRAIN_NODE") or os.environ.get("HOSTNAME", "?")
out = sys.stdout
buf = []
for i in range(n):
    buf.append(f"{node} {i} the quick brown fox jumps over the lazy dog\n")
    if len(buf) == 1000:
        out.write("".join(buf))
        buf.clear()
out.write("".join(buf))
out.flush()
