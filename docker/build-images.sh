#!/usr/bin/env bash
# Builds the project's images on the local Docker engine with no registry:
#   fabtrain/base:bookworm  Debian minbase + python3, made with mmdebstrap from this machine's mirror
#   fabtrain/host:latest    a test host: sshd, its own Docker engine, rsync, chrony, iptables, faketime,
#                           Slurm and munge (started by fab cluster.up --slurm), iperf3 (the network
#                           bench's reference)
#   fabtrain/trainer:latest base + CPU torch + hydra-core (so the many hydra-configured training
#                           programs, pytorch/examples' minGPT-DDP among them, run as they are) +
#                           tensorboard (the trainers' event files, torch.utils.tensorboard) +
#                           the environment-driven entrypoint
# Each image carries a label with a hash of its build inputs and is rebuilt only when that hash
# changes (FORCE=1 rebuilds all), so running this twice reuses what is there and an edited
# entrypoint or init script, another version asked for, or a changed pin in requirements.lock never
# leaves a stale image behind.
# A real cluster names its own base (e.g. nvcr.io/nvidia/pytorch:24.01-py3) in the inventory instead.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
work=${FABTRAIN_BUILD_DIR:-$here/../.cache/build}
BASE=fabtrain/base:bookworm
HOST=fabtrain/host:latest
TRAINER=fabtrain/trainer:latest
TORCH=${TORCH_VERSION:-2.13.0}
NUMPY=${NUMPY_VERSION:-2.4.6}
HYDRA=${HYDRA_VERSION:-1.3.2}
TENSORBOARD=${TENSORBOARD_VERSION:-2.21.0}
force=${FORCE:-0}
# The test lock: the runtime's pins and those of torch's and tensorboard's dependencies (protobuf...).
lock=$here/../requirements-test.lock  # absent from an installed (not editable) fabtrain: no constraints

# What pip installs into the trainer image, and the versions every other distribution it pulls in
# (tensorboard's and torch's dependencies) is held to: requirements-test.lock's pins, as constraints
# (pip still resolves them; the image and the tests' .venv read event files with the same protobuf).
trainer_requirements() { printf '%s\n' "torch==$TORCH" "numpy==$NUMPY" "hydra-core==$HYDRA" "tensorboard==$TENSORBOARD"; }
trainer_constraints() {
  [ -f "$lock" ] || return 0
  awk -F'==' '/^[A-Za-z0-9._-]+==/ { split($2, v, /[ ;\\]/); n = tolower($1)
    if (n != "torch" && n != "numpy" && n != "hydra-core" && n != "tensorboard") print $1 "==" v[1] }' "$lock"
}

inputs() { cat "$@" | sha256sum | cut -c1-16; }
BASE_KEY=$(inputs "$here/build-images.sh")
HOST_KEY=$(inputs "$here/build-images.sh" "$here/host-init.sh")
# The entrypoint and the runtime modules (fabtrain_*.py, every one a node's start ships), copied
# beside it into the image, as a derived image has them.
ENTRYPOINT_FILES=("$here/entrypoint.py" "$here"/fabtrain_*.py)
TRAINER_KEY=$(inputs "$here/build-images.sh" "$here/trainer.Dockerfile" "${ENTRYPOINT_FILES[@]}" \
  <(trainer_requirements; trainer_constraints))
# have IMAGE KEY: the image exists and was built from these inputs.
have() {
  [ "$force" != 1 ] && [ "$(docker image inspect --format '{{index .Config.Labels "fabtrain.inputs"}}' "$1" 2>/dev/null)" = "$2" ]
}

mirror() {
  # The mirror is read from this machine's apt sources at run time; no host is written into a file.
  local m
  m=$(awk '/^URIs:/ && $2 !~ /security/ {print $2; exit}' /etc/apt/sources.list.d/*.sources 2>/dev/null || true)
  [ -n "$m" ] || m=$(awk '/^deb / && $0 !~ /security/ {print $2; exit}' /etc/apt/sources.list 2>/dev/null || true)
  [ -n "$m" ] || { echo "build-images: no Debian mirror found in /etc/apt/sources*; add one and retry" >&2; exit 1; }
  echo "$m"
}

mkdir -p "$work"
# What every image's root filesystem has, and what a test host adds.
BASE_PACKAGES=python3,python3-pip,ca-certificates,procps,iproute2
HOST_PACKAGES=openssh-server,docker.io,rsync,chrony,iptables,faketime,kmod,slurm-wlm,munge,iperf3
# rootfs NAME PACKAGES: a minbase root filesystem in $work/rootfs-NAME with those packages and what
# they depend on (no recommends), made once per set of inputs. mmdebstrap downloads with apt (in
# parallel, the Release file's signature checked against this machine's keyring), about twice as
# fast as debootstrap; its merged-usr hook makes /usr merged as debootstrap does (without it, the
# usrmerge package and perl come in). No service starts: its chroot has none running.
rootfs() {
  local dir=$work/rootfs-$1
  [ "$(cat "$dir/.complete" 2>/dev/null)" = "$BASE_KEY" ] && return 0
  rm -rf "$dir"
  mmdebstrap --variant=minbase --hook-dir=/usr/share/mmdebstrap/hooks/merged-usr --include="$2" \
    bookworm "$dir" "$(mirror)" >"$work/mmdebstrap-$1.log" 2>&1 \
    || { tail -20 "$work/mmdebstrap-$1.log" >&2; return 1; }
  rm -rf "$dir"/etc/ssh/ssh_host_*
  echo "$BASE_KEY" >"$dir/.complete"
}

# What can run at once does: the trainer's Python packages (torch, the longest) install from the
# start, while the base's and the host's root filesystems are made from the mirror; then the
# trainer's docker build. Each step's log is in $work; a failed step prints its tail.
build_trainer_site() {
  rm -rf "$ctx"; mkdir -p "$ctx"
  trainer_requirements >"$work/trainer-requirements.txt"
  trainer_constraints >"$work/trainer-constraints.txt"
  # torch is installed here, into a plain directory, so the image gets one layer of installed files
  # and never a copy of the wheel. The CPU wheel comes from the machine's pip configuration.
  python3 -m pip install -q --no-compile --target "$ctx/site" -r "$work/trainer-requirements.txt" \
    -c "$work/trainer-constraints.txt" >"$work/pip.log" 2>&1 \
    || { tail -20 "$work/pip.log" >&2; return 1; }
  rm -rf "$ctx"/site/bin
  prune_site "$ctx/site"
}

# What no training program runs: torch's C++ test binaries and test libraries, its headers and CMake
# files (torch.utils.cpp_extension builds need them: such a program names its own image), and the
# TensorBoard server's binary (the trainers only write event files). About 200 MB of 874 that every
# host would otherwise load.
prune_site() {
  local t=$1/torch
  rm -rf "$t/test" "$t/include" "$t/share/cmake" "$1/tensorboard_data_server/bin"
  find "$t/bin" -mindepth 1 -maxdepth 1 ! -name torch_shm_manager -exec rm -rf {} +
  rm -f "$t"/lib/lib{torchbind_test,jitbackend_test,backend_with_compiler,aoti_custom_ops}.so
}

build_trainer_image() {
  cp "${ENTRYPOINT_FILES[@]}" "$here/trainer.Dockerfile" "$ctx/"
  DOCKER_BUILDKIT=0 docker build -q -f "$ctx/trainer.Dockerfile" -t "$TRAINER" --label "fabtrain.inputs=$TRAINER_KEY" --build-arg BASE="$BASE" "$ctx" >"$work/docker-build.log" 2>&1 \
    || { tail -20 "$work/docker-build.log" >&2; return 1; }
  rm -rf "$ctx"
}

build_host() {
  rootfs host "$BASE_PACKAGES,$HOST_PACKAGES" || return 1
  install -m 0755 "$here/host-init.sh" "$work/rootfs-host/usr/local/sbin/host-init"
  tar -C "$work/rootfs-host" --exclude=./.complete -c . | docker import -c 'CMD ["/usr/local/sbin/host-init"]' \
    -c "LABEL fabtrain.inputs=$HOST_KEY" - "$HOST" >/dev/null
}

# wait_for PID WHAT: the background step's status; a failed one ends the build, naming it.
wait_for() { wait "$1" || { echo "build-images: $2 failed (logs in $work)" >&2; exit 1; }; }

ctx=$work/trainer-ctx
site_pid=
if ! have "$TRAINER" "$TRAINER_KEY"; then
  echo "==> build $TRAINER (torch $TORCH, CPU; hydra-core $HYDRA; tensorboard $TENSORBOARD)"
  build_trainer_site & site_pid=$!
fi

host_pid=
if ! have "$HOST" "$HOST_KEY"; then
  echo "==> build $HOST (mmdebstrap with sshd, docker.io, Slurm...)"
  build_host & host_pid=$!
fi

if ! have "$BASE" "$BASE_KEY"; then
  echo "==> build $BASE (mmdebstrap minbase bookworm)"
  rootfs base "$BASE_PACKAGES" || exit 1
  tar -C "$work/rootfs-base" --exclude=./.complete -c . | docker import -c "LABEL fabtrain.inputs=$BASE_KEY" - "$BASE" >/dev/null
fi

if [ -n "$site_pid" ]; then
  wait_for "$site_pid" "the trainer's Python packages"
  build_trainer_image || exit 1
fi
[ -z "$host_pid" ] || wait_for "$host_pid" "the host image"
docker image ls --format '{{.Repository}}:{{.Tag}}  {{.Size}}' | grep '^fabtrain/' || true
