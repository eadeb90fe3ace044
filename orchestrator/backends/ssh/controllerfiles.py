"""The files a detached job's controller is given (detached.py's docstring says what is copied
where), staged in a private local folder before submit.py copies them to the controller's host: a
key for this job alone, the host keys this machine trusts, the secrets, the launch as the controller
runs it (its inventory reaching the hosts with that key), and the orchestrator's code."""

from __future__ import annotations

import pickle
import shutil
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from orchestrator.backends.base import Launch
from orchestrator.backends.ssh.detached import MOUNT
from orchestrator.config.sshconf import SSH
from orchestrator.hosts.keys import marker
from orchestrator.transport.hostkeys import host_trust

if TYPE_CHECKING:
    from orchestrator.config.inventory import Inventory


def new_key(job_id: str) -> tuple[bytes, str]:
    """(OpenSSH private key, authorized_keys line) of a key for this job alone."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    key = Ed25519PrivateKey.generate()
    private = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption()
    )
    public = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    return private, f"{public.decode()} {marker(job_id)}"


def controller_inventory(inv: Inventory) -> Inventory:
    """The inventory as the controller uses it: every host reached with the job's key, checked
    against the copied known_hosts, secrets read from /ctl/secrets."""

    def ssh(s: SSH) -> SSH:
        return replace(
            s,
            keys=(f"{MOUNT}/key",),
            keys_only=True,
            known_hosts=(f"{MOUNT}/known_hosts",),
            global_known_hosts=(),
            jump=(),
        )

    return replace(
        inv,
        hosts=tuple(replace(h, ssh=ssh(h.ssh)) for h in inv.hosts),
        spares=tuple(replace(h, ssh=ssh(h.ssh)) for h in inv.spares),
        job=replace(
            inv.job, secret_files=tuple((n, f"{MOUNT}/secrets/{n}") for n, _ in inv.job.secret_files)
        ),
    )


def known_hosts_text(inv: Inventory) -> str:
    lines = []
    for h in inv.all_hosts:
        trust = host_trust(h.ssh)
        lines += [f"{trust.name} {e.key.get_name()} {e.key.get_base64()}" for e in trust.keys]
    return "\n".join(lines) + "\n"


def stage_files(stage: Path, launch: Launch) -> str:
    """The controller's files (module docstring) in a private local folder; the key's public line."""
    inv, spec = launch.inv, launch.spec
    stage.mkdir(mode=0o700)
    private, public = new_key(spec.job_id)
    write(stage / "key", private)
    write(stage / "key.pub", public.encode() + b"\n")
    write(stage / "known_hosts", known_hosts_text(inv).encode())
    (stage / "secrets").mkdir(mode=0o700)
    for name, path in inv.job.secret_files:
        write(stage / "secrets" / name, Path(path).expanduser().read_bytes())
    ctl = replace(
        launch,
        inv=controller_inventory(inv),
        spec=replace(spec, code=f"{MOUNT}/code"),
        runs=Path(MOUNT) / "runs",
        console=None,  # type: ignore[arg-type]
        json=True,
        live=False,
    )
    write(stage / "launch.pickle", pickle.dumps(ctl))
    code_copy(stage / "fabtrain")
    return public


def code_copy(dest: Path) -> None:
    """The orchestrator's code as it runs here, laid out as a checkout (resources.py finds the
    files every node's start ships, docker/entrypoint.py, docker/fabtrain_memory.py and the modules
    they import, beside a pyproject.toml), whether it runs from a checkout or is installed."""
    import orchestrator
    from orchestrator.hostcmds import dockerargs

    shutil.copytree(
        Path(orchestrator.__file__).parent,
        dest / "orchestrator",
        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"),
    )
    (dest / "docker").mkdir()
    for name, source in dockerargs.RUNTIME_SOURCES.items():
        shutil.copyfile(source, dest / "docker" / name)
    (dest / "pyproject.toml").write_text("# fabtrain's code as a detached job's controller runs it\n")


def write(path: Path, data: bytes) -> None:
    path.touch(mode=0o600)
    path.write_bytes(data)
