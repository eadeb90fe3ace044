"""The hosts as shared resources, below every backend and the preflight: which jobs and claims are
on them (survey), who holds which GPUs or CPU slots and ports (claims), who waits for them
(queue), and the plain operations on them (hostops): sync code, stop containers, free a port, clear
what a lost job left."""
