#!/usr/bin/env bash
# Makes this machine ready to run fabtrain and its tests, idempotently:
#   Debian packages (Docker engine, OpenSSH client, rsync, debootstrap, pdsh, Prometheus, Chromium
#   and its driver for the dashboard's browser test), a running Docker
#   engine, and the project's virtualenv (.venv) with requirements.lock's exact versions (checked
#   by hash: the runtime, the tests' and the linters'), and this clone installed in it.
# Safe to run again: it installs only what is missing.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

need_pkgs=()
for pair in dockerd:docker.io ssh:openssh-client ssh-keygen:openssh-client rsync:rsync \
            debootstrap:debootstrap pdsh:pdsh ip:iproute2 prometheus:prometheus \
            chromium:chromium chromedriver:chromium-driver; do
  command -v "${pair%%:*}" >/dev/null 2>&1 || need_pkgs+=("${pair#*:}")
done
if [ ${#need_pkgs[@]} -gt 0 ]; then
  if [ "$(id -u)" != 0 ]; then SUDO=sudo; else SUDO=; fi
  echo "==> installing Debian packages: ${need_pkgs[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need_pkgs[@]}" >/dev/null
fi

if ! docker info >/dev/null 2>&1; then
  echo "==> starting the Docker engine"
  if [ "$(id -u)" != 0 ]; then SUDO=sudo; else SUDO=; fi
  $SUDO mkdir -p /var/log
  # A pid file left by an engine that ended with the last session would stop this one.
  $SUDO rm -f /var/run/docker.pid
  $SUDO sh -c 'nohup dockerd >/var/log/dockerd.log 2>&1 &'
  for _ in $(seq 1 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
  docker info >/dev/null 2>&1 || { echo "bootstrap: dockerd did not start; see /var/log/dockerd.log" >&2; tail -20 /var/log/dockerd.log >&2; exit 1; }
fi

# requirements.lock (docker/lock.sh makes it) pins every distribution with its hashes; torch is
# the CPU build, from the local wheel the machine's pip configuration finds (find-links).
if [ ! -x .venv/bin/python ] || ! cmp -s requirements.lock .venv/.requirements.lock 2>/dev/null; then
  echo "==> virtualenv .venv"
  python3 -m venv .venv
  # The machine's pip configuration names optional local indexes; their "ignored" warnings are noise.
  .venv/bin/pip install -q --require-hashes -r requirements.lock 2> >(grep -v "^WARNING: Location" >&2)
  cp requirements.lock .venv/.requirements.lock
  rm -f .venv/.requirements  # the marker of the unhashed requirements.txt this replaced
fi

# The `fabtrain` command (.venv/bin/fabtrain), runnable from any directory: this clone, installed
# in place (its dependencies are the locked ones above; the build backend, setuptools, too).
# Installed means: outside this directory (-I), `import orchestrator` finds this clone's.
if [ ! -x .venv/bin/fabtrain ] || ! .venv/bin/python -I -c 'import orchestrator, os, sys
sys.exit(os.path.dirname(os.path.dirname(os.path.realpath(orchestrator.__file__))) != os.path.realpath(sys.argv[1]))' \
    "$root" >/dev/null 2>&1; then
  echo "==> fabtrain command (.venv/bin/fabtrain)"
  .venv/bin/pip install -q --no-deps --no-build-isolation -e . 2> >(grep -v "^WARNING: Location" >&2)
fi
