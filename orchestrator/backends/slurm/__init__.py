"""The Slurm backend: submit to a login node, follow the job, requeue and resume."""
