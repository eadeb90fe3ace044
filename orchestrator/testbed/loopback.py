"""Warm fabtrain nodes as plain processes on this machine's loopback, for tests and benchmarks that
need the real entrypoint and its keeper without the local cluster: what a node's start would set
(tests/trainers/test_memory_warm.py, tests/bench/memory_loopback.py)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from orchestrator.hostcmds import dockerargs


def runtime_dir(into: Path, memory_module: Path | None = None) -> Path:
    """`into` made a node's runtime directory: the files a node's start unpacks there
    (dockerargs.RUNTIME_SOURCES), fabtrain_memory.py from `memory_module` when given (another
    version of it)."""
    into.mkdir(parents=True, exist_ok=True)
    other = {"fabtrain_memory.py": memory_module} if memory_module else {}
    for name, source in {**dockerargs.RUNTIME_SOURCES, **other}.items():
        shutil.copy(source, into / name)
    return into


def warm_env(node_rank: int, port: int, out: Path, console: Path, **extra: str) -> dict[str, str]:
    """The environment of a warm node of 2 (2 workers each, launched directly, gloo on loopback)
    whose master is 127.0.0.1:`port`; `extra` added last. This process's PYTHONPATH is not passed on:
    a worker finds fabtrain_memory where a real node's would."""
    env = {
        **os.environ,
        "NNODES": "2",
        "NODE_RANK": str(node_rank),
        "NPROC_PER_NODE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "FABTRAIN_WARM": "1",
        "FABTRAIN_LAUNCH": "direct",
        "FABTRAIN_ATTEMPT": "1",
        "FABTRAIN_OUTPUT": str(out),
        "FABTRAIN_CONSOLE": str(console),
        "GLOO_SOCKET_IFNAME": "lo",
        "NCCL_SOCKET_IFNAME": "=lo",
        **extra,
    }
    env.pop("PYTHONPATH", None)
    return env
