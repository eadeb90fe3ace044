"""Where a job runs: over SSH on the inventory's hosts (ssh/), as a Slurm job (slurm/, which also
writes its sbatch script), and as manifests to hand to kubectl (kubernetes/: render only). export.py
holds what the sbatch script and the manifests share. base.py says what a Runner and a Renderer
offer; registry.py is the one place that chooses one."""
