"""Files fabtrain ships beside its code (docker/): found in the checkout, or in the installed
package, where pyproject.toml installs docker/ as the package `fabtrain_docker` (a top-level
`docker` would hide the docker library)."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

# In a checkout, pyproject.toml sits beside docker/; in site-packages, neither is there (a
# `docker` directory there is the docker library).
CHECKOUT = Path(__file__).resolve().parents[2]
PACKAGE = "fabtrain_docker"
# How plans and exports name the entrypoint, wherever it was read from.
ENTRYPOINT_NAME = "docker/entrypoint.py"
MEMORY_NAME = "docker/fabtrain_memory.py"


def docker_file(name: str) -> Path:
    """The path of docker/NAME: the checkout's when running from one, else the installed copy."""
    if (CHECKOUT / "pyproject.toml").is_file() and (CHECKOUT / "docker" / name).is_file():
        return CHECKOUT / "docker" / name
    try:
        found = resources.files(PACKAGE) / name
    except ModuleNotFoundError:
        found = None
    if found is None or not found.is_file():
        raise FileNotFoundError(
            f"docker/{name}: neither in a fabtrain checkout ({CHECKOUT}) nor in the "
            f"installed package {PACKAGE}; reinstall fabtrain (pip install .)"
        )
    return Path(str(found))  # pip installs wheels unzipped: a real file


def entrypoint() -> Path:
    """docker/entrypoint.py, the one entrypoint every container runs (dockerargs.ENTRYPOINT_SOURCE)."""
    return docker_file("entrypoint.py")


def memory_module() -> Path:
    """docker/fabtrain_memory.py, which must lie beside the entrypoint in the runtime directory: the
    keeper the entrypoint runs in a warm node, and the API (save, load) the workers import."""
    return docker_file("fabtrain_memory.py")
