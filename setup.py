"""The package list, the one part of the build pyproject.toml cannot state: every package under
orchestrator/ and trainers/, found when the package is built (subpackages, with or without an
__init__.py, included as they are added), and docker/, installed as fabtrain_docker
(pyproject.toml's package-dir). Everything else is in pyproject.toml."""
from setuptools import find_namespace_packages, setup

setup(packages=[*find_namespace_packages(include=["orchestrator", "orchestrator.*", "trainers", "trainers.*"],
                                         exclude=["*.__pycache__"]),
                "fabtrain_docker"])
