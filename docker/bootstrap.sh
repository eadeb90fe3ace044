#!/usr/bin/env bash
# Makes this machine ready to run fabtrain (and, with --tests, its tests), idempotently:
#
#   bash docker/bootstrap.sh           the runtime: Debian's docker.io (engine and client: the local
#                                      cluster), openssh-client (ssh, ssh-keygen), rsync, mmdebstrap
#                                      (the images' base); a running Docker engine; the virtualenv
#                                      .venv with requirements.lock (fabric, paramiko, docker, rich,
#                                      matplotlib, ...: no torch, no test or lint packages); and this
#                                      clone installed in it (.venv/bin/fab, .venv/bin/fabtrain).
#   bash docker/bootstrap.sh --cluster that, and the local cluster's images (docker/build-images.sh:
#                                      the test hosts' and the trainer's), built while .venv installs.
#   bash docker/bootstrap.sh --tests   that, plus what the tests add: Debian's prometheus, chromium
#                                      and chromium-driver (the metrics and browser tests), pdsh (the
#                                      fan-out benchmarks' baseline), and requirements-test.lock in
#                                      .venv (torch's CPU build, pytest, ruff, mypy, selenium, mkdocs...).
#
# Both locks are installed by hash (docker/lock.sh makes them; docs/install.md explains them). Safe to
# run again: it installs only what is missing, and never removes what --tests installed.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

tests=0
images=0
for arg in "$@"; do
  case $arg in
    --tests) tests=1; images=1 ;;
    --cluster) images=1 ;;
    -h|--help) sed -n '2,18p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "bootstrap: unknown argument $arg (usage: bash docker/bootstrap.sh [--cluster | --tests])" >&2; exit 2 ;;
  esac
done
if [ "$(id -u)" != 0 ]; then SUDO=sudo; else SUDO=; fi

python3 -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
  || { echo "bootstrap: fabtrain needs Python 3.11 or later as python3 (found $(python3 --version 2>&1))" >&2; exit 1; }

# Debian packages, by the command each provides: the runtime's now (the engine and the images need
# them); the tests' own (Prometheus, Chromium, pdsh) in the background, while .venv installs and the
# images build (waited for at the end).
missing() {  # the packages of these command:package pairs whose command is not on PATH
  local out=() pair pkg
  for pair in "$@"; do
    pkg=${pair#*:}
    if ! command -v "${pair%%:*}" >/dev/null 2>&1 && [[ " ${out[*]-} " != *" $pkg "* ]]; then out+=("$pkg"); fi
  done
  echo "${out[*]-}"
}
read -ra need_pkgs <<<"$(missing dockerd:docker.io docker:docker.io ssh:openssh-client ssh-keygen:openssh-client \
  rsync:rsync mmdebstrap:mmdebstrap)"
# Debian's own python3 makes virtualenvs only with python3-venv.
python3 -c 'import ensurepip' >/dev/null 2>&1 || need_pkgs+=(python3-venv)
test_pkgs=()
[ "$tests" = 0 ] || read -ra test_pkgs <<<"$(missing prometheus:prometheus chromium:chromium \
  chromedriver:chromium-driver pdsh:pdsh)"
apt_install() { DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "$@" >/dev/null; }
updated=0
if [ ${#need_pkgs[@]} -gt 0 ]; then
  echo "==> installing Debian packages: ${need_pkgs[*]}"
  $SUDO apt-get update -qq
  updated=1
  apt_install "${need_pkgs[@]}"
fi
apt_pid=
if [ ${#test_pkgs[@]} -gt 0 ]; then
  echo "==> installing Debian packages in the background: ${test_pkgs[*]}"
  mkdir -p .cache
  { [ "$updated" = 1 ] || $SUDO apt-get update -qq; apt_install "${test_pkgs[@]}"; } >.cache/apt-tests.out 2>&1 &
  apt_pid=$!
fi

if ! docker info >/dev/null 2>&1; then
  echo "==> starting the Docker engine"
  $SUDO mkdir -p /var/log
  # A pid file left by an engine that ended with the last session would stop this one.
  $SUDO rm -f /var/run/docker.pid
  $SUDO sh -c 'nohup dockerd >/var/log/dockerd.log 2>&1 &'
  for _ in $(seq 1 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
  docker info >/dev/null 2>&1 || { echo "bootstrap: dockerd did not start; see /var/log/dockerd.log" >&2; tail -20 /var/log/dockerd.log >&2; exit 1; }
fi

# The images build while .venv installs (both wait mostly on downloads; the build's own steps run
# side by side too): its output is shown once it ends, and a failed build fails this script.
images_pid=
if [ "$images" = 1 ]; then
  mkdir -p .cache
  bash docker/build-images.sh >.cache/build-images.out 2>&1 & images_pid=$!
fi

# Each lock is installed when the copy of it kept in .venv (the marker of what is installed there)
# differs: the runtime's always, the tests' with --tests, on top (it repeats the runtime's versions
# and adds its own). pip adds and changes distributions but removes none, so a plain run after
# --tests keeps the test packages.
# torch (test lock) is the CPU build, from the local wheel the machine's pip configuration finds
# (find-links); elsewhere PIP_FIND_LINKS or the CPU index gives it (docs/install.md).
[ -x .venv/bin/python ] || { echo "==> virtualenv .venv"; python3 -m venv .venv; }
rm -f .venv/.requirements  # the marker of the unhashed requirements.txt the locks replaced
install_lock() {
  local lock=$1
  cmp -s "$lock" ".venv/.$lock" 2>/dev/null && return 0
  echo "==> .venv: $lock"
  # The machine's pip configuration names optional local indexes; their "ignored" warnings are noise.
  .venv/bin/pip install -q --require-hashes -r "$lock" 2> >(grep -v "^WARNING: Location" >&2)
  cp "$lock" ".venv/.$lock"
}
install_lock requirements.lock
[ "$tests" = 0 ] || install_lock requirements-test.lock

# The `fabtrain` command (.venv/bin/fabtrain), runnable from any directory: this clone, installed
# in place (its dependencies are the locked ones above; the build backend, setuptools, too).
# Installed means: outside this directory (-I), `import orchestrator` finds this clone's.
if [ ! -x .venv/bin/fabtrain ] || ! .venv/bin/python -I -c 'import orchestrator, os, sys
sys.exit(os.path.dirname(os.path.dirname(os.path.realpath(orchestrator.__file__))) != os.path.realpath(sys.argv[1]))' \
    "$root" >/dev/null 2>&1; then
  echo "==> fabtrain command (.venv/bin/fabtrain)"
  .venv/bin/pip install -q --no-deps --no-build-isolation -e . 2> >(grep -v "^WARNING: Location" >&2)
fi

if [ -n "$apt_pid" ] && ! wait "$apt_pid"; then
  cat .cache/apt-tests.out >&2
  echo "bootstrap: installing the tests' Debian packages (${test_pkgs[*]}) failed" >&2
  exit 1
fi
if [ -n "$images_pid" ]; then
  if ! wait "$images_pid"; then
    cat .cache/build-images.out >&2
    echo "bootstrap: building the images failed (docker/build-images.sh; its steps' logs are in .cache/build)" >&2
    exit 1
  fi
  cat .cache/build-images.out
fi
