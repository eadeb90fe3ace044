"""The local cluster's test hosts as a Slurm cluster too (fab cluster.up --slurm): munged and
slurmd on every host, slurmctld on the first, next to their sshd and Docker engine."""

from __future__ import annotations

import io
import os
import tarfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

# The library's client by its full name: to mypy, a bare `docker` is this repository's docker/
# folder (a namespace package).
from docker.client import DockerClient

from orchestrator.core.errors import UserError
from orchestrator.testbed.containers import Log, NodeInfo, exec_checked

SLURM_CONF = """\
# Written by fab cluster.up --slurm: the test hosts as a Slurm cluster, controller on the first.
ClusterName=fabtrain
SlurmctldHost={first}({first_address})
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# No cgroup delegation in these containers: processes tracked by parentage, no task binding.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SchedulerType=sched/backfill
ReturnToService=2
MpiDefault=none
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=/var/log/slurmctld.log
SlurmdLogFile=/var/log/slurmd.log
# Finished jobs: their state in sacct --completion (no accounting database here) and in
# scontrol show job for 10 minutes.
JobCompType=jobcomp/filetxt
JobCompLoc=/var/log/slurm-jobcomp.log
AccountingStorageType=accounting_storage/none
MinJobAge=600
KillWait=30
{nodes}
PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""

# Start (or keep) munge, slurmd and, on the controller, slurmctld: restarted only when the config
# or the key changed or a daemon is not running.
SLURM_START = r"""
set -eu
want=$(cat /etc/slurm/slurm.conf /etc/munge/munge.key.new | sha256sum | cut -c1-16)
if [ "$(cat /etc/slurm/.fabtrain 2>/dev/null)" = "$want" ] && pgrep -x munged >/dev/null \
   && pgrep -x slurmd >/dev/null && { [ "$2" = 0 ] || pgrep -x slurmctld >/dev/null; }; then
  rm -f /etc/munge/munge.key.new; echo kept; exit 0
fi
pkill -x slurmctld || true; pkill -x slurmd || true; pkill -x munged || true
sleep 0.5
install -o munge -g munge -m 0400 /etc/munge/munge.key.new /etc/munge/munge.key
rm -f /etc/munge/munge.key.new
mkdir -p /run/munge /var/spool/slurmd /var/spool/slurmctld
chown munge:munge /run/munge
runuser -u munge -- /usr/sbin/munged
if [ "$2" = 1 ]; then slurmctld; fi
slurmd -N "$1"
echo "$want" > /etc/slurm/.fabtrain
echo started
"""


def slurm_up(
    client: DockerClient, nodes: list[NodeInfo], state: Path, log: Log = print, timeout: float = 60
) -> None:
    """The test hosts as a Slurm cluster (Debian's slurm-wlm and munge, in the host image): one
    munge key (kept in `state`, the cluster's state directory), one slurm.conf, slurmd everywhere,
    slurmctld on the first. Idempotent; SSH jobs on the same hosts are unaffected."""
    key_file = state / "munge.key"
    if not key_file.exists():
        key_file.write_bytes(os.urandom(1024))
        key_file.chmod(0o600)
    conf = SLURM_CONF.format(
        first=nodes[0].name,
        first_address=nodes[0].address,
        nodes="\n".join(f"NodeName={n.name} NodeAddr={n.address} State=UNKNOWN" for n in nodes),
    )
    archive = io.BytesIO()
    with tarfile.open(fileobj=archive, mode="w") as tar:
        for name, data, mode in (
            ("slurm/slurm.conf", conf.encode(), 0o644),
            ("munge/munge.key.new", key_file.read_bytes(), 0o400),
        ):
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), mode
            tar.addfile(info, io.BytesIO(data))

    def start(i_node: tuple[int, NodeInfo]) -> str:
        i, node = i_node
        c = client.containers.get(node.container)
        c.put_archive("/etc", archive.getvalue())
        return exec_checked(c, ["sh", "-c", SLURM_START, "sh", node.name, "1" if i == 0 else "0"]).strip()

    with ThreadPoolExecutor(max_workers=len(nodes)) as pool:
        actions = list(pool.map(start, enumerate(nodes)))
    controller = client.containers.get(nodes[0].container)
    deadline = time.monotonic() + timeout
    while True:
        code, out = controller.exec_run(["sinfo", "--noheader", "--Node", "--format", "%N %t"])
        states = dict(line.split() for line in out.decode().splitlines() if len(line.split()) == 2)
        if code == 0 and all(states.get(n.name) in ("idle", "alloc", "mix") for n in nodes):
            break
        if time.monotonic() > deadline:
            raise UserError(
                f"Slurm did not come up within {timeout:g}s (sinfo: {states or out.decode().strip()}); "
                f"see: docker exec {nodes[0].container} cat /var/log/slurmctld.log /var/log/slurmd.log"
            )
        time.sleep(0.5)
    started = sum(a == "started" for a in actions)
    log(
        f"slurm up: controller on {nodes[0].name}, {len(nodes)} node(s) idle "
        f"({started} started, {len(nodes) - started} already running)"
    )
