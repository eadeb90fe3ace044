#!/usr/bin/env bash
# Regenerates the two locks from pyproject.toml, for Python 3.11 on Linux x86_64: every distribution
# at an exact version with its hashes (pip installs them with --require-hashes).
#
#   requirements.lock       the runtime (pyproject.toml's dependencies) and the build backend
#                           (setuptools, for bootstrap's editable install of this clone): what
#                           `bash docker/bootstrap.sh` installs. Every hash in it is one PyPI publishes.
#   requirements-test.lock  the runtime plus the extras `test` (pytest, torch, mkdocs, ...) and `dev`
#                           (ruff, mypy, stubs), held to requirements.lock's versions (-c): what
#                           `bash docker/bootstrap.sh --tests` installs on top.
#
#   bash docker/lock.sh                        keep the locked versions that still satisfy pyproject.toml
#   bash docker/lock.sh --upgrade              newest versions within pyproject.toml's ranges
#   bash docker/lock.sh --upgrade-package rich one package (the options go to both pip-compile runs)
#
# pip-compile asks PyPI for versions and hashes, so this needs PyPI (docs/install.md).
# torch (test lock only) is the CPU build, 2.13.0+cpu, from a local wheel (TORCH_WHEELS, default
# /opt/wheels, where this machine's pip configuration points find-links; elsewhere download it from
# the CPU index first, as docs/install.md says): PyPI's torch 2.13.0 pulls several GB of CUDA
# packages. The wheel's folder is given to pip-compile as find-links, where 2.13.0+cpu outranks
# PyPI's 2.13.0, so the test lock holds that file's hash and no other for torch; the script checks
# this. pip's configuration files are not read while compiling (the machine's extra local indexes
# carry builds PyPI does not have), so every other hash is one PyPI publishes.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

torch_version=2.13.0+cpu
torch_wheels=${TORCH_WHEELS:-/opt/wheels}
torch_wheel=$(ls "$torch_wheels"/torch-"$torch_version"-cp311-*.whl 2>/dev/null | head -1)
[ -n "$torch_wheel" ] || { echo "lock: no torch-$torch_version wheel for Python 3.11 in $torch_wheels (set TORCH_WHEELS; docs/install.md)" >&2; exit 1; }

tools=.cache/lock-tools
if [ ! -x "$tools/bin/pip-compile" ]; then
  python3 -m venv "$tools"
  "$tools/bin/pip" install -q --disable-pip-version-check pip-tools==7.6.2
fi

export PIP_CONFIG_FILE=/dev/null
unset PIP_FIND_LINKS PIP_EXTRA_INDEX_URL PIP_INDEX_URL PIP_NO_INDEX PIP_CONSTRAINT
export CUSTOM_COMPILE_COMMAND="bash docker/lock.sh"
# --build-deps-for editable: pyproject.toml's build backend (setuptools>=77) is locked too, since
# bootstrap.sh installs this clone with --no-build-isolation.
compile=("$tools/bin/pip-compile" --quiet --generate-hashes --allow-unsafe --strip-extras
         --build-deps-for editable --no-emit-find-links --no-emit-index-url)

pins() { grep -E '^[A-Za-z0-9][A-Za-z0-9._-]*==' "$1" | sed 's/ .*//' | tr 'A-Z_' 'a-z-' | sort; }

# The runtime compile gets the options less --upgrade-package of what the runtime does not pin
# (pip-compile would add that package to the lock).
runtime_args=()
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do
  case ${args[$i]} in
    -P|--upgrade-package) i=$((i + 1)); pkg=${args[$i]:-} ;;
    --upgrade-package=*) pkg=${args[$i]#*=} ;;
    *) runtime_args+=("${args[$i]}"); continue ;;
  esac
  name=$(echo "${pkg%%[<>=!~ ;[]*}" | tr 'A-Z_' 'a-z-')
  if [ -f requirements.lock ] && pins requirements.lock | grep -q "^$name=="; then
    runtime_args+=(--upgrade-package "$pkg")
  fi
done

echo "lock: requirements.lock (the runtime)"
"${compile[@]}" --output-file requirements.lock ${runtime_args[@]+"${runtime_args[@]}"} pyproject.toml
echo "lock: requirements-test.lock (the runtime, the tests and the linters)"
"${compile[@]}" --extra test --extra dev --constraint requirements.lock --find-links "$torch_wheels" \
  --output-file requirements-test.lock "$@" pyproject.toml

# The runtime lock: no torch and nothing the tests or linters alone need.
for name in torch pytest mypy ruff selenium mkdocs kubernetes; do
  if pins requirements.lock | grep -q "^$name=="; then
    echo "lock: requirements.lock pins $name, which only the tests need; is it a runtime dependency now?" >&2
    exit 1
  fi
done
# The test lock installs on top of the runtime one: every runtime pin, at the same version.
missing=$(comm -23 <(pins requirements.lock) <(pins requirements-test.lock))
[ -z "$missing" ] || { echo "lock: requirements-test.lock differs from requirements.lock on: $missing" >&2; exit 1; }

# torch: exactly the local CPU wheel, by its hash.
want="--hash=sha256:$(sha256sum "$torch_wheel" | cut -d' ' -f1)"
got=$(awk '/^torch==/{p=1; print; next} p && /^ +--hash/{print; next} {p=0}' requirements-test.lock)
if [ "$(echo "$got" | head -1)" != "torch==$torch_version \\" ] || [ "$(echo "$got" | grep -c -- --hash)" != 1 ] \
   || ! echo "$got" | grep -qF -- "$want"; then
  echo "lock: requirements-test.lock does not pin torch to $torch_wheel alone:" >&2
  echo "$got" >&2
  exit 1
fi

# bootstrap.sh installs fabtrain itself with --no-build-isolation: both locks must carry the build
# backend pyproject.toml names.
for lock in requirements.lock requirements-test.lock; do
  grep -qE '^setuptools==(7[7-9]|[89][0-9]|[1-9][0-9]{2,})\.' "$lock" \
    || { echo "lock: $lock has no setuptools>=77 (pyproject.toml's build backend)" >&2; exit 1; }
done

# The notes above pip-compile's header (which it rewrites each time).
runtime_note="# The runtime: what \`bash docker/bootstrap.sh\` installs (pip install --require-hashes -r
# requirements.lock). Every hash is one PyPI publishes. The tests' and linters' distributions are in
# requirements-test.lock. Regenerate both with docker/lock.sh, which explains how."
test_note="# The runtime, the tests and the linters: what \`bash docker/bootstrap.sh --tests\` installs, on top of
# requirements.lock (whose versions this file repeats). torch==$torch_version is the CPU build from a
# local wheel (pip's find-links; on this machine /opt/wheels; elsewhere see docs/install.md), not on
# PyPI: its hash is that file's. Everything else comes from PyPI.
# Regenerate with docker/lock.sh, which explains how."
{ echo "$runtime_note"; cat requirements.lock; } > requirements.lock.tmp && mv requirements.lock.tmp requirements.lock
{ echo "$test_note"; cat requirements-test.lock; } > requirements-test.lock.tmp && mv requirements-test.lock.tmp requirements-test.lock
echo "lock: requirements.lock written ($(pins requirements.lock | wc -l) distributions)," \
     "requirements-test.lock ($(pins requirements-test.lock | wc -l))"
