#!/usr/bin/env bash
# Builds fabtrain/controller:latest on the local Docker engine with no registry: where a detached
# job's control runs (fab train --detach). fabtrain/base (build-images.sh) + rsync and the OpenSSH
# client (chroot apt-get, as the host image) + the orchestrator's runtime libraries at the exact
# versions of requirements.lock, installed with their hashes. The orchestrator's own code is not in
# the image: fab train --detach copies it per job. Rebuilt only when this script or the lock changes
# (FORCE=1 rebuilds).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
work=${FABTRAIN_BUILD_DIR:-$here/../.cache/build}
BASE=fabtrain/base:bookworm
CONTROLLER=fabtrain/controller:latest
# What a controller imports (fabric, paramiko, rich, PyYAML and what they need; pathspec for the code's
# ignore rules; prometheus-client for a detached job's --metrics-port).
LIBS="fabric invoke paramiko bcrypt cryptography cffi pycparser pynacl decorator deprecated wrapt rich markdown-it-py mdurl pygments pyyaml typing-extensions pathspec prometheus-client"
KEY=$(cat "$here/build-controller.sh" "$here/../requirements.lock" | sha256sum | cut -c1-16)
# One build at a time (two `fab train --detach` started at once share $work/rootfs-controller); the
# second waits, then finds the image built.
mkdir -p "$work"
exec 9>"$work/controller.lock"
flock 9
if [ "${FORCE:-0}" != 1 ] && [ "$(docker image inspect --format '{{index .Config.Labels "fabtrain.inputs"}}' "$CONTROLLER" 2>/dev/null)" = "$KEY" ]; then
  exit 0
fi
echo "==> build $CONTROLLER (rsync, ssh, the orchestrator's libraries)"
mkdir -p "$work"
fs=$work/rootfs-controller
rm -rf "$fs"; mkdir -p "$fs"
cid=$(docker create "$BASE" true)
trap 'docker rm -f "$cid" >/dev/null 2>&1 || true; umount "$fs/proc" 2>/dev/null || true' EXIT
docker export "$cid" | tar -C "$fs" -x
cp /etc/resolv.conf "$fs/etc/resolv.conf"
printf '#!/bin/sh\nexit 101\n' >"$fs/usr/sbin/policy-rc.d"; chmod +x "$fs/usr/sbin/policy-rc.d"
mount -t proc proc "$fs/proc"
chroot "$fs" sh -c 'apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    rsync openssh-client >/dev/null' >"$work/controller-apt.log" 2>&1 \
  || { tail -20 "$work/controller-apt.log" >&2; exit 1; }
umount "$fs/proc"
rm -f "$fs/usr/sbin/policy-rc.d"
rm -rf "$fs"/var/cache/apt/archives/*.deb "$fs"/var/lib/apt/lists/*
# The lock's entries for these libraries (each with its hashes), installed as they are. The base's
# python is this machine's minor version (3.11, ENVIRONMENT.md), so the same wheels fit; compiled here, so
# that a controller does not compile its libraries each time it starts.
awk -v want=" $LIBS " '/^[a-z]/ { split($1, p, "=="); keep = index(want, " " p[1] " ") > 0 } keep' \
  "$here/../requirements.lock" >"$work/controller.lock"
python3 -m pip install -q --no-deps --require-hashes \
  --target "$fs/usr/local/lib/python3.11/dist-packages" -r "$work/controller.lock" >"$work/controller-pip.log" 2>&1 \
  || { tail -20 "$work/controller-pip.log" >&2; exit 1; }
rm -rf "$fs"/usr/local/lib/python3.11/dist-packages/bin
tar -C "$fs" -c . | docker import -c 'CMD ["python3"]' -c "ENV PYTHONUNBUFFERED=1" \
  -c "LABEL fabtrain.inputs=$KEY" - "$CONTROLLER" >/dev/null
rm -rf "$fs"
