"""The SSH backend: a job in stages on plain hosts (job), each attempt's plan (attempt), watching
it (watch), jobs already on the hosts (jobs, hostops), sharing hosts (claims) and snapshots."""
