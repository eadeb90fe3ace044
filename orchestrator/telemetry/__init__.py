"""A host's telemetry (GPUs, XID lines, the job's containers): commands (the sample script run on
a host), samples (one sample read, samples summarised), readings (its values, each checked) and amd
(AMD GPUs' sections), and sampler (an attempt's hosts sampled while it is watched)."""
