"""A job's snapshots, kept off its hosts so that a job survives the loss of any host (store.py's
docstring tells the whole story): commands (the pure commands that list, check, copy and place
them), listings (what a host says of them, read safely), checks (their size and SHA-256, here and
on a host), copying (one checked try of a copy) and store (the job's snapshots on this machine: copied
off rank 0's host, placed on the others)."""
