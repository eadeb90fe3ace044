"""Phase 1 of a preflight: the raw facts of a host. One probe script per host (one SSH round trip)
runs every fact's command between markers, with Docker commands bounded so a stuck engine costs
its timeout once; `parse_probe` and the parse_* functions turn the output into plain data. Also
how a host gives containers its GPUs (`gpu_access`), counting GPUs from the vendor's tool, and the
hash of this machine's code tree, computed as the hosts compute it."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

from orchestrator.config import codetree
from orchestrator.config.inventory import Host, Inventory
from orchestrator.hostcmds import dockerargs, hostfiles
from orchestrator.hostcmds.sshargs import shell
from orchestrator.transport.remote import Session

# What the probe found on a host: fact name -> (exit status of its command, its output).
Facts = dict[str, tuple[int, str]]
# Seconds a Docker command of the probe may take: a stuck engine answers SSH but never this. The
# whole probe of a host is bounded by PROBE_TIMEOUT; a GPU container start gets longer.
DOCKER_TIMEOUT = 8
GPU_CONTAINER_TIMEOUT = 60
PROBE_TIMEOUT = 30
# Probe facts that need the Docker engine: skipped once it has not answered.
DOCKER_FACTS = ("docker", "image", "image_info")
# Run in the image with its python3 (not its ENTRYPOINT, which we never use): what the job needs.
IMAGE_INFO_PY = """import json, platform
info = {"python": platform.python_version()}
try:
    import torch
except Exception as exc:
    info["error"] = type(exc).__name__ + ": " + str(exc)
else:
    info.update(torch=torch.__version__, cuda=torch.version.cuda, hip=getattr(torch.version, "hip", None),
                gpus=torch.cuda.device_count())
print("IMAGEINFO " + json.dumps(info))
"""
# Exit code of coreutils' timeout when it had to stop the command.
TIMED_OUT = 124


def probe_commands(
    inv: Inventory,
    host: Host,
    image: str,
    access: dockerargs.GpuAccess | None = None,
    code: str | None = None,
) -> dict[str, list[str]]:
    """The raw facts gathered on one host, as name -> argv (run in one script). `access`: how the
    host gives containers its GPUs (dockerargs.gpu_probe_argv, read before this probe); `code`: where
    the local tree's copy would be (job.code_dir/KEY)."""
    cmds = {
        "docker": ["docker", "version", "--format", "{{.Server.Version}}"],
        "image": ["docker", "image", "inspect", "--format", "{{.Id}}", image],
        "image_info": image_info_argv(inv, host, image, access),
        "dirs": dirs_argv(inv),
        "addr": ["ip", "-o", "-4", "addr", "show"],
        "link": ["ip", "-o", "link", "show"],
        "route": ["ip", "-o", "route", "get", inv.master.hostname],
        "shm": ["df", "-Pk", "/dev/shm"],
        "code": [
            "sh",
            "-c",
            'cd "$1" && find . -type f -print0 | LC_ALL=C sort -z | xargs -0r sha256sum | sha256sum',
            "sh",
            code or inv.job.code_dir,
        ],
        "ntp": [
            "sh",
            "-c",
            "timedatectl show -p NTPSynchronized --value 2>/dev/null "
            "|| chronyc -n tracking 2>/dev/null | grep -i 'leap status' || echo unknown",
        ],
        "python": ["python3", "-c", "print('ok')"],
        "rsync": rsync_fact_argv(),
    }
    if host.rank == 0:
        cmds["port"] = ["ss", "-Htlnp", f"sport = :{inv.job.master_port}"]
    if host.gpu_vendor == "nvidia":
        cmds["gpu"] = ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"]
    elif host.gpu_vendor == "amd":
        # rocm-smi lists one "card" line per GPU (per GCD on an MI250X); without it, the KFD topology
        # has a node per CPU socket too, whose gpu_id is 0 (count_gpus skips those).
        cmds["gpu"] = [
            "sh",
            "-c",
            "rocm-smi --showproductname --csv 2>/dev/null; echo @@sysfs; "
            "cat /sys/class/kfd/kfd/topology/nodes/*/gpu_id 2>/dev/null",
        ]
        cmds["runtime"] = ["ls", "-d", "/dev/kfd", "/dev/dri"]
    return cmds


def dirs_argv(inv: Inventory) -> list[str]:
    """The "dirs" fact: per job directory, from its nearest existing directory (code_dir may not exist
    before the first sync), the free space there (storagecheck.judge_disk), and whether the SSH user
    can create and write it, or which directory above it the user cannot even enter, where it may
    already be (storagecheck.judge_dirs; sync and the job need to)."""
    return [
        "sh",
        "-c",
        'for p in "$@"; do q=$p; while [ ! -e "$q" ]; do q=$(dirname "$q"); done; '
        'df -Pk "$q" | tail -n 1; '
        'if [ -d "$q" ] && [ -w "$q" ] && [ -x "$q" ]; then echo "ok $p"; '
        'else echo "denied $p $q $(stat -c %U "$q") $([ -x "$q" ] && echo open || echo closed)"; fi; done',
        "sh",
        inv.job.code_dir,
        inv.job.output_dir,
    ]


# What the rsync check judges (rsynccheck.judge_rsync), printed as key=value lines by the same script on
# a host (in its probe, so in the environment a non-interactive SSH command gets, the one rsync's
# server side gets) and on this machine (local_rsync): the first line of `rsync --version`
# (version=, empty when there is no rsync); the CVE ids of the two client-side flaws fixed in 3.4
# that the rsync package's changelog names (fixed=: a distribution's build of an older version
# with the fixes backported, as Debian 12's 3.2.7-1+deb12u1 and later); and RSYNC_OLD_ARGS and
# RSYNC_PROTECT_ARGS where set (env=NAME=VALUE, the value cut and kept to one line).
RSYNC_CVES = ("CVE-2024-12087", "CVE-2024-12088")
RSYNC_FACT = (
    "if command -v rsync >/dev/null 2>&1; then v=$(rsync --version 2>&1 | head -n 1 | cut -c 1-200); "
    'else v=; fi; printf "version=%s\n" "$v"; '
    "{ for f in /usr/share/doc/rsync/changelog.Debian.gz /usr/share/doc/rsync/changelog.gz; do "
    '[ -f "$f" ] && gzip -dc "$f"; done; command -v rpm >/dev/null && rpm -q --changelog rsync; } '
    "2>/dev/null "
    "| grep -oE '" + "|".join(RSYNC_CVES) + "' | sort -u | sed 's/^/fixed=/'; "
    'for n in RSYNC_OLD_ARGS RSYNC_PROTECT_ARGS; do x=$(printenv "$n") && '
    'printf "env=%s=%s\n" "$n" "$(printf %s "$x" | tr -c "[:alnum:]._-" "?" | cut -c 1-40)"; done; true'
)
LOCAL_RSYNC_TIMEOUT = 10


def rsync_fact_argv() -> list[str]:
    """The rsync fact's command (RSYNC_FACT), run on a host by its probe and here by local_rsync."""
    return ["sh", "-c", RSYNC_FACT]


def local_rsync() -> tuple[int, str]:
    """The rsync fact of this machine (the one running fab, whose rsync copies to and from the
    hosts), as the probe gives a host's: (exit code, output)."""
    try:
        r = subprocess.run(
            rsync_fact_argv(), capture_output=True, text=True, errors="replace", timeout=LOCAL_RSYNC_TIMEOUT
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return 1, f"{type(exc).__name__}: {exc}"
    return r.returncode, (r.stdout + r.stderr).strip()


def parse_rsync_fact(text: str) -> dict:
    """RSYNC_FACT's output -> {'version': first line of rsync --version ('' for none), 'fixed':
    the RSYNC_CVES its package's changelog names, 'env': {name: value}}; lines of any other form
    are ignored."""
    out: dict = {"version": "", "fixed": set(), "env": {}}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if not sep:
            continue
        if key == "version" and not out["version"]:
            out["version"] = value.strip()
        elif key == "fixed" and value in RSYNC_CVES:
            out["fixed"].add(value)
        elif key == "env":
            name, _, val = value.partition("=")
            if name in ("RSYNC_OLD_ARGS", "RSYNC_PROTECT_ARGS"):
                out["env"][name] = val
    return out


def parse_rsync_version(line: str) -> tuple[int, int, int] | None:
    """(major, minor, patch) from the first line of `rsync --version` ('rsync  version 3.2.7
    protocol version 31'; 3.2.0 to 3.2.3 print 'version v3.2.3'), or None for any other text
    (openrsync, an error, a wrapper's output)."""
    m = re.match(r"\s*rsync\s+version\s+v?(\d{1,4})\.(\d{1,4})(?:\.(\d{1,4}))?(?!\d)", line)
    if not m:
        return None
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


def image_info_argv(inv: Inventory, host: Host, image: str, access: dockerargs.GpuAccess | None) -> list[str]:
    """The image as the job runs it: its python3, torch and CUDA/ROCm, and the GPUs a container
    started with the job's device flags sees. Never pulled here (--pull never).

    Starting a container and importing torch takes seconds, so on a CPU host the answer is kept
    on the host under the image id (an id names one immutable image), in a directory the group
    shares (several accounts use one cache, as .runtime); a GPU host always looks again, since
    what it must show is that the GPUs work now."""
    run = [
        "docker",
        "run",
        "--rm",
        "--pull",
        "never",
        "--network",
        "none",
        *dockerargs.device_args(host, access),
        "--entrypoint",
        "python3",
        image,
        "-c",
        IMAGE_INFO_PY,
    ]
    if host.gpu_vendor != "none":
        return run
    # The cache directory is the group's: any member can put a link or a file at any name there, so
    # the answer is written new (noclobber), readable by all whatever the umask, in the directory
    # entered and checked (never through a link at the directory's name), and a link is never read
    # as an answer.
    script = (
        'id=$(docker image inspect --format "{{.Id}}" "$1") || exit 1; f="$2/${id#sha256:}"; '
        'if [ -s "$f" ] && [ -r "$f" ] && [ ! -L "$f" ]; then cat "$f"; exit 0; fi; '
        'shift 2; out=$("$@"); rc=$?; printf "%s\\n" "$out"; '
        'case "$out" in *IMAGEINFO*) [ $rc = 0 ] && d="${f%/*}" && [ ! -L "$d" ] && mkdir -p "$d" && '
        'cd -P "$d" && [ ! -L "$d" ] && [ "$d" -ef . ] && { [ ! -O . ] || chmod g+ws .; } && '
        't="./${f##*/}.$$" && rm -f "$t" && ( umask 022; set -C; printf "%s\\n" "$out" > "$t" ) && '
        'mv -T "$t" "./${f##*/}";; esac 2>/dev/null; exit $rc'
    )
    return ["sh", "-c", script, "sh", image, f"{inv.job.output_dir}/.runtime/{hostfiles.IMAGE_CACHE}", *run]


def count_gpus(vendor: str, text: str) -> tuple[int, str]:
    """(GPU count, model) from `nvidia-smi --query-gpu=name` or the AMD probe (rocm-smi's CSV, then
    the KFD topology's gpu_id per node, 0 for a CPU node)."""
    if vendor == "nvidia":
        names = [line.strip() for line in text.splitlines() if line.strip()]
        return len(names), names[0] if names else "none"
    smi, _, sysfs = text.partition("@@sysfs")
    cards = [line.split(",") for line in smi.splitlines() if line.startswith("card")]
    if cards:
        return len(cards), cards[0][1].strip() if len(cards[0]) > 1 and cards[0][1].strip() else "AMD GPU"
    ids = [line.strip() for line in sysfs.splitlines() if line.strip().isdigit()]
    return sum(1 for i in ids if int(i) != 0), "AMD GPU"


def gpu_access(session: Session, host: Host) -> dockerargs.GpuAccess | None:
    """How this GPU host gives containers its GPUs (None for a CPU host), read on the host; the
    same flags serve the preflight's GPU container and the job's."""
    probe = dockerargs.gpu_probe_argv(host)
    if probe is None:
        return None
    return dockerargs.parse_gpu_probe(
        session.run(host, shell(probe), timeout=DOCKER_TIMEOUT + 5, what="reading the GPU runtime").stdout
    )


def probe_script(cmds: dict[str, list[str]], marker: str) -> str:
    """One shell script printing each command's output between markers, with its exit code.

    Docker commands run under `timeout`, and once the engine has not answered the rest of them are
    not tried (exit 124 each), so a stuck engine costs DOCKER_TIMEOUT once and every other fact is
    still gathered."""
    parts = ["stuck=0"]
    for name, argv in cmds.items():
        if name in DOCKER_FACTS:
            limit = GPU_CONTAINER_TIMEOUT if name == "image_info" else DOCKER_TIMEOUT
            cmd = (
                f'if [ $stuck = 1 ]; then echo "engine did not answer"; (exit {TIMED_OUT}); else '
                f"{shell(['timeout', '-k', '2', str(limit), *argv])} 2>&1; fi; "
                f"rc=$?; [ $rc = {TIMED_OUT} ] && stuck=1"
            )
        else:
            cmd = f"{shell(argv)} 2>&1; rc=$?"
        parts.append(f"echo {marker} {name}; {cmd}; echo {marker}rc $rc")
    return "; ".join(parts)


def parse_probe(output: str, marker: str) -> Facts:
    facts: Facts = {}
    pattern = re.compile(rf"^{marker} (\S+)\n(.*?)^{marker}rc (\d+)$", re.S | re.M)
    for m in pattern.finditer(output):
        facts[m.group(1)] = (int(m.group(3)), m.group(2).strip())
    return facts


def parse_addrs(text: str) -> dict[str, list[str]]:
    """`ip -o -4 addr show` -> interface -> ['10.0.0.5/24', ...]."""
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        f = line.split()
        if len(f) >= 4 and f[2] == "inet":
            out.setdefault(f[1], []).append(f[3])
    return out


def parse_links(text: str) -> dict[str, dict]:
    """`ip -o link show` -> interface -> {'up': bool, 'mtu': int}."""
    out: dict[str, dict] = {}
    for line in text.splitlines():
        m = re.match(r"\d+: ([^:@]+)(?:@\S+)?: <([^>]*)>.*? mtu (\d+)", line)
        if m:
            out[m.group(1)] = {"up": "UP" in m.group(2).split(","), "mtu": int(m.group(3))}
    return out


def image_info(facts: Facts) -> dict | None:
    """What IMAGE_INFO_PY printed in the image, or None."""
    m = re.search(r"^IMAGEINFO (\{.*\})$", facts.get("image_info", (1, ""))[1], re.M)
    try:
        return json.loads(m.group(1)) if m else None
    except ValueError:
        return None


def local_code_hash(root: Path, only: str = "") -> str:
    """The same hash the hosts compute over the synced tree (files rsync copies, C sort order)."""
    return codetree.content_hash(root, only)
