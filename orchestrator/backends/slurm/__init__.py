"""The Slurm backend: submit to a login node, follow the job, requeue and resume. backend.py is the
Runner, and the Renderer of the sbatch script alone (`fab export.slurm`); slurm.py submits, stops and
lists jobs; follow.py follows one (its output per node, its state); commands.py holds what is said to
Slurm and how its answers are read; script.py renders the sbatch script."""
