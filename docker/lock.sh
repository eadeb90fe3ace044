#!/usr/bin/env bash
# Regenerates requirements.lock from pyproject.toml: every distribution the runtime, the tests
# (extra `test`) and the linters (extra `dev`) install, at an exact version with its hashes, for
# Python 3.11 on Linux x86_64. docker/bootstrap.sh installs it with --require-hashes.
#
#   bash docker/lock.sh                        keep the locked versions that still satisfy pyproject.toml
#   bash docker/lock.sh --upgrade              newest versions within pyproject.toml's ranges
#   bash docker/lock.sh --upgrade-package rich one package
#
# torch is the CPU build, 2.13.0+cpu, from a local wheel (TORCH_WHEELS, default /opt/wheels, where
# this machine's pip configuration points find-links): PyPI's torch 2.13.0 pulls several GB of CUDA
# packages. The wheel's folder is given to pip-compile as find-links, where 2.13.0+cpu outranks
# PyPI's 2.13.0, so the lock holds that file's hash and no other for torch; the script checks this.
# pip's configuration files are not read while compiling (the machine's extra local indexes carry
# builds PyPI does not have), so every other hash in the lock is one PyPI publishes.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

torch_version=2.13.0+cpu
torch_wheels=${TORCH_WHEELS:-/opt/wheels}
torch_wheel=$(ls "$torch_wheels"/torch-"$torch_version"-cp311-*.whl 2>/dev/null | head -1)
[ -n "$torch_wheel" ] || { echo "lock: no torch-$torch_version wheel for Python 3.11 in $torch_wheels (set TORCH_WHEELS)" >&2; exit 1; }

tools=.cache/lock-tools
if [ ! -x "$tools/bin/pip-compile" ]; then
  python3 -m venv "$tools"
  "$tools/bin/pip" install -q --disable-pip-version-check pip-tools==7.6.2
fi

export PIP_CONFIG_FILE=/dev/null
unset PIP_FIND_LINKS PIP_EXTRA_INDEX_URL PIP_INDEX_URL PIP_NO_INDEX
export CUSTOM_COMPILE_COMMAND="bash docker/lock.sh"
"$tools/bin/pip-compile" --quiet --generate-hashes --allow-unsafe --strip-extras \
  --extra test --extra dev --find-links "$torch_wheels" --no-emit-find-links --no-emit-index-url \
  --output-file requirements.lock "$@" pyproject.toml

# torch: exactly the local CPU wheel, by its hash.
want="--hash=sha256:$(sha256sum "$torch_wheel" | cut -d' ' -f1)"
got=$(awk '/^torch==/{p=1; print; next} p && /^ +--hash/{print; next} {p=0}' requirements.lock)
if [ "$(echo "$got" | head -1)" != "torch==$torch_version \\" ] || [ "$(echo "$got" | grep -c -- --hash)" != 1 ] \
   || ! echo "$got" | grep -qF -- "$want"; then
  echo "lock: requirements.lock does not pin torch to $torch_wheel alone:" >&2
  echo "$got" >&2
  exit 1
fi

# bootstrap.sh installs fabtrain itself with --no-build-isolation: the lock must carry the build
# backend pyproject.toml names (today torch and kubeflow-training require setuptools too).
grep -qE '^setuptools==(7[7-9]|[89][0-9]|[1-9][0-9]{2,})\.' requirements.lock \
  || { echo "lock: requirements.lock has no setuptools>=77 (pyproject.toml's build backend); add it to an extra" >&2; exit 1; }

# The note on torch, above pip-compile's header (which it rewrites each time).
note="# torch==$torch_version is the CPU build from a local wheel (pip's find-links; on this machine
# /opt/wheels), not on PyPI: its hash is that file's. Everything else comes from PyPI.
# Regenerate with docker/lock.sh, which explains how."
{ echo "$note"; cat requirements.lock; } > requirements.lock.tmp && mv requirements.lock.tmp requirements.lock
echo "lock: requirements.lock written ($(grep -c '^[A-Za-z0-9]' requirements.lock) distributions)"
