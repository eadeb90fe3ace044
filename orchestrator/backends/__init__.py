"""Where a job runs: over SSH on the inventory's hosts (ssh/), as a Slurm job (slurm/), and as
scheduler files to hand to others (export: sbatch script, Kubernetes manifests)."""
