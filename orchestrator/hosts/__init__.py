"""The hosts as shared resources, below every backend and the preflight: which jobs and claims are
on them (hostops.survey), who holds which GPUs or CPU slots and ports (claims), and the plain
operations on them: sync code, stop containers, free a port, clear what a lost job left."""
