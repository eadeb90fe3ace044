#!/bin/sh
# PID 1 of a local test host (a Docker-in-Docker container standing in for a bare-metal server):
# its own SSH host keys, the cluster's public key, its own Docker engine, then sshd in the foreground.
set -eu
mkdir -p /run/sshd /root/.ssh
chmod 700 /root/.ssh
if [ -n "${FABTRAIN_AUTHORIZED_KEY:-}" ]; then
  printf '%s\n' "$FABTRAIN_AUTHORIZED_KEY" >/root/.ssh/authorized_keys
  chmod 600 /root/.ssh/authorized_keys
fi
ssh-keygen -A >/dev/null
# A stale pid file from a previous start of this container would stop dockerd from starting.
rm -f /var/run/docker.pid /var/run/docker/containerd/containerd.pid
dockerd --host unix:///var/run/docker.sock >/var/log/dockerd.log 2>&1 &
exec /usr/sbin/sshd -D -e
