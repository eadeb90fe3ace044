"""Faults the tests and benchmarks put on the local cluster's hosts from outside: a host frozen whole
(docker pause) and thawed, and one training worker killed inside a host."""

from __future__ import annotations

import time

import docker.errors

from orchestrator.testbed.cluster import container_name, engine_client


def freeze(name: str, tries: int = 10) -> None:
    """Freeze a whole test host (docker pause): a machine that stops answering without closing a
    connection. The cgroup freezer gives up ("unable to freeze") when the host's processes are busy
    forking at that moment, so the pause is tried again."""
    container = engine_client().containers.get(container_name(name))
    for attempt in range(tries):
        try:
            container.pause()
            return
        except docker.errors.APIError:
            if attempt == tries - 1:
                raise
            time.sleep(0.2)


def thaw(name: str) -> None:
    try:
        engine_client().containers.get(container_name(name)).unpause()
    except docker.errors.APIError:
        pass  # not paused (the freeze never happened) or already gone


# Run inside a test host (sh -c): SIGKILL one training worker of the job's container there (a
# process torchrun started, `python3 -u SCRIPT ...`, or a worker the entrypoint gave its rank, named
# fabtrain-rN; not one still waiting for a rank), not torchrun, not the container; prints its pid.
KILL_ONE_WORKER = """docker exec "$(docker ps -q --filter label=fabtrain.managed=1)" python3 -c '
import os, signal
for p in sorted(os.listdir("/proc")):
    try:
        argv = open("/proc/%s/cmdline" % p, "rb").read().split(b"\\0")
        comm = open("/proc/%s/comm" % p, "rb").read()
    except (OSError, ValueError):
        continue
    if p.isdigit() and (comm.startswith(b"fabtrain-r") or argv[1:2] == [b"-u"] and argv[2:3] != [b"-c"]):
        os.kill(int(p), signal.SIGKILL)
        print(p)
        break
'"""
