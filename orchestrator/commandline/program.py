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


class Program(Fab):
    """Fabric's program, whose executor is told the argv it was run with: `fabtrain shell JOB -- CMD`
    takes CMD's words as typed (Invoke keeps them only joined by spaces; see access.Executor)."""

    def execute(self) -> None:
        from orchestrator.commandline.access import Executor
        Executor(self.collection, self.config, self.core, argv=self.argv).execute(*self.tasks)


def make_program() -> Fab:
    """The program, built as fabric.main.make_program builds `fab`, with the tasks bundled."""
    return Program(name=NAME, binary=NAME, binary_names=[NAME],
                   version=f"{__version__} (Fabric {fabric_version})", namespace=tasks(),
                   config_class=Config)


def main(argv: list[str] | None = None) -> None:
    """Console script entry point (pyproject.toml: fabtrain = orchestrator.commandline.program:main)."""
    from orchestrator.commandline.cli import quiet_on_closed_pipe
    quiet_on_closed_pipe()  # before the tasks load: `fabtrain --help | head` too
    make_program().run(argv)


if __name__ == "__main__":
    main()
