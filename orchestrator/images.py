"""Getting the right image onto every host, with no registry: push over SSH, and derived builds.

push: one local `docker save`, streamed at once to `docker load` on every host that lacks the
image (same id = nothing sent), with a progress display; the id is verified on each host after.
build: a derived image from a base image plus the user's requirements file and this project's
entrypoint, so any image starts the same way (see docker/entrypoint.py).
"""
from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from . import plan
from .errors import UserError
from .inventory import Host
from .remote import Session, describe

CHUNK = 1 << 20


@dataclass
class PushResult:
    host: str
    action: str  # "present" | "sent" | "failed"
    seconds: float = 0.0
    bytes: int = 0
    detail: str = ""


def local_image(image: str) -> tuple[str, int]:
    """(id, size in bytes) of an image in the local engine."""
    proc = subprocess.run(["docker", "image", "inspect", "--format", "{{.Id}} {{.Size}}", image],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise UserError(f"image {image} is not in the local Docker engine ({proc.stderr.strip()}); "
                        f"build or pull it here first (fab images, fab image.build, docker pull)")
    image_id, size = proc.stdout.split()
    return image_id, int(size)


def remote_image_id(session: Session, host: Host, image: str) -> str | None:
    r = session.run(host, plan.shell(["docker", "image", "inspect", "--format", "{{.Id}}", image]), timeout=30)
    return r.stdout.strip() if r.ok else None


def push(session: Session, image: str, hosts: tuple[Host, ...] | None = None, progress=None) -> list[PushResult]:
    """Load `image` into every host's engine that does not hold the same id; verify after."""
    hosts = session.hosts if hosts is None else hosts
    want, size = local_image(image)
    have = session.fan_out(lambda h: remote_image_id(session, h, image), hosts)
    results: dict[str, PushResult] = {}
    targets = []
    for h in hosts:
        got = have.value(h.name)
        if have.error(h.name):
            results[h.name] = PushResult(h.name, "failed", detail=describe(h, have.error(h.name)))
        elif got == want:
            results[h.name] = PushResult(h.name, "present")
        else:
            targets.append(h)
    if targets:
        for r in _stream(session, image, size, targets, progress):
            results[r.host] = r
        ids = session.fan_out(lambda h: remote_image_id(session, h, image), tuple(targets))
        for h in targets:
            r = results[h.name]
            if r.action == "sent" and ids[h.name] != want:
                r.action, r.detail = "failed", f"after loading, {h.name} holds {ids[h.name]}, not {want}"
    return [results[h.name] for h in hosts]


# A push may take as long as the image needs at PUSH_MIN_RATE bytes/s, plus a margin; a host that
# stops taking data for longer is named as failed and the others go on.
PUSH_MIN_RATE = 2e6
PUSH_MARGIN = 120


def _stream(session: Session, image: str, size: int, targets: list[Host], progress) -> list[PushResult]:
    """Tee one `docker save` into a `docker load` per host, each bounded by the push deadline."""
    cmds = {}
    failed: dict[str, str] = {}
    deadline = PUSH_MARGIN + size / PUSH_MIN_RATE
    for h in targets:
        try:
            cmd = session.command(h, plan.shell(["docker", "load", "--quiet"]), deadline, "docker load")
            cmds[h.name] = cmd.__enter__()
        except Exception as exc:  # noqa: BLE001 - this host fails, the others go on
            failed[h.name] = describe(h, exc)
    task = progress.add_task(f"push {image}", total=size) if progress else None
    start = time.monotonic()
    sent = 0
    save = subprocess.Popen(["docker", "save", image], stdout=subprocess.PIPE)
    try:
        while len(failed) < len(targets):
            chunk = save.stdout.read(CHUNK)
            if not chunk:
                break
            sent += len(chunk)
            # Every host gets each chunk before the next is read: one save, N loads, in step, on the
            # session's own worker threads.
            live = tuple(h for h in targets if h.name not in failed)
            for name, exc in session.fan_out(lambda h: cmds[h.name].send(chunk), live).errors().items():
                failed[name] = f"{name}: transfer failed: {exc}"
            if progress:
                progress.update(task, completed=min(sent, size or sent))
    finally:
        save.stdout.close()
        save.wait()
    out = []
    for h in targets:
        cmd = cmds.get(h.name)
        try:
            if h.name not in failed:
                cmd.close_stdin()
                code = cmd.exit_status()
                err = b""
                while cmd.chan.recv_stderr_ready():
                    err += cmd.chan.recv_stderr(65536)
            if cmd is not None:
                cmd.__exit__(None, None, None)
        except Exception as exc:  # noqa: BLE001 - e.g. the deadline passed on this host
            failed[h.name] = describe(h, exc)
        if h.name in failed:
            out.append(PushResult(h.name, "failed", detail=failed[h.name]))
        elif code != 0 or save.returncode != 0:
            out.append(PushResult(h.name, "failed", detail=f"docker load exited {code}: {err.decode(errors='replace')[-300:]}"))
        else:
            out.append(PushResult(h.name, "sent", time.monotonic() - start, sent))
    return out


DERIVED_DOCKERFILE = """\
FROM {base}
COPY context/ /tmp/fabtrain-build/
RUN PIP_BREAK_SYSTEM_PACKAGES=1 python3 -m pip install --no-cache-dir {pip_flags}-r /tmp/fabtrain-build/requirements.txt \\
 && rm -rf /tmp/fabtrain-build
COPY entrypoint.py /usr/local/bin/fabtrain-entrypoint
LABEL fabtrain.base="{base}"
ENTRYPOINT ["python3", "/usr/local/bin/fabtrain-entrypoint"]
"""


def derived_dockerfile(base: str, pip_flags: tuple[str, ...] = (), offline: bool = False) -> str:
    """The Dockerfile of a derived image. Offline, pip installs only from wheels in the context
    (downloaded on this machine), so the build needs no index: hosts are often air-gapped."""
    flags = ("--no-index", "--find-links", "/tmp/fabtrain-build/wheels") if offline else ()
    return DERIVED_DOCKERFILE.format(base=base, pip_flags="".join(f"{plan.shell([f])} " for f in (*flags, *pip_flags)))


def build(base: str, requirements: Path, tag: str, pip_flags: tuple[str, ...] = (), wheels: Path | None = None) -> str:
    """Build `tag` from `base` + requirements + the entrypoint on the local engine; its id."""
    if not requirements.is_file():
        raise UserError(f"{requirements}: requirements file not found")
    if wheels is not None and not wheels.is_dir():
        raise UserError(f"--wheels {wheels}: not a directory (fill one with: pip download -r REQUIREMENTS -d DIR)")
    with tempfile.TemporaryDirectory(prefix="fabtrain-build-") as ctx:
        ctxp = Path(ctx)
        (ctxp / "Dockerfile").write_text(derived_dockerfile(base, pip_flags, offline=wheels is not None))
        (ctxp / "context").mkdir()
        (ctxp / "context" / "requirements.txt").write_bytes(requirements.read_bytes())
        if wheels is not None:
            shutil.copytree(wheels, ctxp / "context" / "wheels")
        (ctxp / "entrypoint.py").write_bytes(plan.ENTRYPOINT_SOURCE.read_bytes())
        proc = subprocess.run(["docker", "build", "--quiet", "--tag", tag, ctx], capture_output=True, text=True,
                              env={"DOCKER_BUILDKIT": "0", "PATH": "/usr/local/bin:/usr/bin:/bin"})
    if proc.returncode != 0:
        raise UserError(f"building {tag} from {base} failed:\n{proc.stderr.strip()[-1500:]}")
    return local_image(tag)[0]
