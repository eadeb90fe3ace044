"""The `fabtrain` command: Fabric's own program (fabric.main.Fab) with fabfile.py's tasks bundled,
so it runs from any directory, with Fabric's core flags as Fabric has them. `fab TASK` from the
checkout runs the same tasks.

    fabtrain --list
    fabtrain --help train
    fabtrain train --code . --script main.py --inventory cluster.yaml
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from fabric import Config
from fabric import __version__ as fabric_version
from fabric.main import Fab
from invoke import Collection

__version__ = "0.1.0"  # the package's version (pyproject.toml reads it from here)
NAME = "fabtrain"
# fabfile.py sits beside the orchestrator package: in the checkout, and in site-packages once
# installed (a top-level module of the package).
FABFILE = Path(__file__).resolve().parents[2] / "fabfile.py"


def tasks() -> Collection:
    """fabfile.py's task collection (`ns`): the module beside this package, never another
    directory's fabfile.py that happens to come first on sys.path."""
    loaded = sys.modules.get("fabfile")
    if loaded is not None and Path(getattr(loaded, "__file__", "")).resolve() == FABFILE:
        return loaded.ns
    spec = importlib.util.spec_from_file_location("fabfile", FABFILE)
    if spec is None or spec.loader is None:
        raise ImportError(f"{FABFILE} cannot be loaded as a module")
    module = importlib.util.module_from_spec(spec)
    sys.modules["fabfile"] = module
    spec.loader.exec_module(module)
    return module.ns


# What every command exits with (docs/how-train-works.md, "Exit codes", says the same).
EXIT_CODES = (
    ("0", "done: the job finished on every host, the checks passed, the command did what it was asked"),
    ("1", "failed: a job, a check, or a host that did not answer (the message names it and the fix)"),
    (
        "2",
        "refused, nothing started: an unknown task, option or job, a bad value, options that conflict "
        "(all refused before any host is touched), or what cannot be done as asked (a job still running)",
    ),
    ("128+N", "a job ended by signal N: 130 Ctrl+C, 143 SIGTERM (its containers were stopped)"),
    ("141", "the reader of the output went away (fabtrain status | head)"),
    (
        "other",
        "a job on Slurm (train --on slurm, logs): the Slurm job's own exit code; shell JOB -- CMD: CMD's",
    ),
)


class Program(Fab):
    """Fabric's program, whose executor is told the argv it was run with: `fabtrain shell JOB -- CMD`
    takes CMD's words as typed (Invoke keeps them only joined by spaces; see access.Executor); its
    --help ends with the exit codes."""

    def execute(self) -> None:
        from orchestrator.commandline.access import Executor

        Executor(self.collection, self.config, self.core, argv=self.argv).execute(*self.tasks)

    def print_help(self) -> None:
        super().print_help()
        print("Exit codes:\n")
        self.print_columns(EXIT_CODES)  # wrapped to the terminal, as the options and tasks are


def make_program() -> Fab:
    """The program, built as fabric.main.make_program builds `fab`, with the tasks bundled."""
    return Program(
        name=NAME,
        binary=NAME,
        binary_names=[NAME],
        version=f"{__version__} (Fabric {fabric_version})",
        namespace=tasks(),
        config_class=Config,
    )


def main(argv: list[str] | None = None) -> None:
    """Console script entry point (pyproject.toml: fabtrain = orchestrator.commandline.program:main)."""
    from orchestrator.commandline.cli import quiet_on_closed_pipe

    quiet_on_closed_pipe()  # before the tasks load: `fabtrain --help | head` too
    make_program().run(argv)


if __name__ == "__main__":
    main()
