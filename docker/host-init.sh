#!/bin/sh
# PID 1 of a local test host (a Docker-in-Docker container standing in for a bare-metal server):
# its own SSH host keys, the cluster's public key, its own Docker engine and sshd. Neither service
# is PID 1, so tests can stop and restart either one (a stopped sshd or engine is a case preflight
# must catch) while the host stays up.
set -eu
mkdir -p /run/sshd /root/.ssh
chmod 700 /root/.ssh
ssh-keygen -A >/dev/null
# A stale pid file from a previous start of this container would stop dockerd from starting.
rm -f /var/run/docker.pid /var/run/docker/containerd/containerd.pid
# With cgroup v1 (and the host's cgroup namespace), this engine's containers nest under the test
# host's own cgroup, as processes of a real machine do: a limit put on the test host (docker update
# --cpus on its container) slows the containers it runs too. On cgroup v2 they stay where they are.
parent=$(awk -F: '$2 == "cpu" || $2 == "cpu,cpuacct" || $2 == "cpuacct,cpu" {print $3; exit}' /proc/self/cgroup)
if [ -n "$parent" ] && [ "$parent" != / ]; then
  dockerd --host unix:///var/run/docker.sock --cgroup-parent "$parent" >/var/log/dockerd.log 2>&1 &
else
  dockerd --host unix:///var/run/docker.sock >/var/log/dockerd.log 2>&1 &
fi
/usr/sbin/sshd -E /var/log/sshd.log
trap 'kill -TERM $(jobs -p) 2>/dev/null; exit 0' TERM INT
# Reap orphans (this is PID 1) until the container is stopped.
while :; do wait || true; sleep 1; done
