"""Getting the right image onto every host, with no registry: push over SSH, and derived builds.

push: by default a pipelined chain of hosts carrying only the layers they lack (imagechain); or,
method="direct", one local `docker save` streamed at once to `docker load` on every host that
lacks the image (loadstream). Either way a host with the same id gets nothing and the id is
verified after.
build: a derived image from a base image plus the user's requirements file and this project's
entrypoint, so any image starts the same way (see docker/entrypoint.py).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from orchestrator.config.inventory import Host
from orchestrator.core.errors import UserError
from orchestrator.hostcmds import dockerargs, sshargs
from orchestrator.images import imagechain
from orchestrator.images.loadstream import PushResult, push_deadline, stream_loads
from orchestrator.transport.remote import Session, describe

if TYPE_CHECKING:
    from rich.progress import Progress, TaskID

# A host to push to directly: (host, the layer indices it lacks, why it is not in the chain).
Direct = tuple[str, tuple[int, ...], str]

CHUNK = 1 << 20


def local_image(image: str) -> tuple[str, int]:
    """(id, size in bytes) of an image in the local engine."""
    proc = subprocess.run(
        ["docker", "image", "inspect", "--format", "{{.Id}} {{.Size}}", image], capture_output=True, text=True
    )
    if proc.returncode != 0:
        raise UserError(
            f"image {image} is not in the local Docker engine ({proc.stderr.strip()}); "
            f"build or pull it here first (fab images, fab image.build, docker pull)"
        )
    image_id, size = proc.stdout.split()
    return image_id, int(size)


def controller_image(image: str) -> None:
    """A detached job's controller image, in the local engine: fabtrain's own (the inventory's
    default) is built here the first time a job is detached (docker/build-controller.sh, about a
    minute, once: the local cluster's first run never needs it); any other must be here already."""
    from orchestrator.config import inventory, resources

    try:
        local_image(image)
        return
    except UserError:
        if image != inventory.Controller().image:
            raise
    base = "fabtrain/base:bookworm"
    try:
        local_image(base)
        script = resources.docker_file("build-controller.sh")
    except (UserError, FileNotFoundError):
        raise UserError(
            f"the controller image {image} is not in this machine's Docker engine, nor {base} to build "
            "it from; run 'bash docker/build-images.sh' and then 'bash docker/build-controller.sh'"
        ) from None
    # Its progress goes to stderr, as the cluster's image builds do: stdout is for --json.
    if subprocess.run(["bash", str(script)], stdout=sys.stderr).returncode != 0:
        raise UserError(f"building {image} failed; see the output above and .cache/build/controller-*.log")
    local_image(image)


def remote_image_id(session: Session, host: Host, image: str) -> str | None:
    r = session.run(
        host, sshargs.shell(["docker", "image", "inspect", "--format", "{{.Id}}", image]), timeout=30
    )
    return r.stdout.strip() if r.ok else None


def local_layers(image: str) -> tuple[str, ...]:
    """The image's layer diff IDs (RootFS.Layers), bottom first."""
    proc = subprocess.run(
        ["docker", "image", "inspect", "--format", "{{json .RootFS.Layers}}", image],
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        raise UserError(f"image {image} is not in the local Docker engine ({proc.stderr.strip()})")
    return tuple(json.loads(proc.stdout) or ())


def push(
    session: Session,
    image: str,
    hosts: tuple[Host, ...] | None = None,
    progress: Progress | None = None,
    method: str = "chain",
    stall: float = 60,
) -> list[PushResult]:
    """Load `image` into every host's engine that does not hold the same id; verify after.

    method="chain" (see imagechain): the hosts forward the stream to each other, and only the layers
    they lack are sent; a host without python3, or that its upstream cannot reach, is sent to
    directly, and a host that fails mid-chain is named while the hosts after it get the image from
    a chain reformed without it. method="direct": one `docker save` streamed from this machine to
    every host at once, the whole image to each. `stall`: seconds a chain's link may carry nothing
    before the host is given up."""
    hosts = session.hosts if hosts is None else hosts
    if method == "direct":
        return _push_direct(session, image, hosts, progress)
    want, _ = local_image(image)
    diff_ids = local_layers(image)
    by_name = {h.name: h for h in hosts}
    probed = session.fan_out(lambda h: _probe(session, h, image), hosts)
    probes = {
        h.name: describe(h, error) if (error := probed.error(h.name)) else probed[h.name] for h in hosts
    }
    hp = imagechain.plan_hosts(want, diff_ids, tuple(by_name), probes, method)
    results: dict[str, PushResult] = {h: PushResult(h, "present") for h in hp.present}
    results.update({h: PushResult(h, "failed", detail=why) for h, why in hp.failed.items()})
    if hp.chain or hp.direct:
        spool = imagechain.Spool.save(image)
        try:
            direct = _run_chain(session, image, spool, hp, by_name, progress, stall, results)
            direct += [
                (h, hp.need[h], "no python3 to run the relay" if method == "chain" else "") for h in hp.direct
            ]
            if direct:
                _push_spool_direct(session, image, spool, direct, by_name, progress, results)
        finally:
            spool.close()
        _verify(session, want, image, [by_name[h] for h, r in results.items() if r.action == "sent"], results)
    return [results[h.name] for h in hosts]


def _probe(session: Session, host: Host, image: str) -> imagechain.Probe:
    r = session.run(host, imagechain.probe_command(image), timeout=30, what="looking at its images")
    if not r.ok:
        raise UserError(
            f"{host.name}: cannot list its images (exit {r.exited}): {r.stderr.strip()[-200:]}; "
            f"is its Docker engine running?"
        )
    return imagechain.parse_probe(r.stdout)


def _layers_note(sent: tuple[int, ...], spool: imagechain.Spool) -> str:
    count = len(spool.layer_paths)
    return "" if len(sent) == count else f", {count - len(sent)} of {count} layers already there"


def _sent_to(progress: Progress, task: TaskID) -> Callable[[int], None]:
    """A callback showing the bytes sent so far on `task`."""
    return lambda n: progress.update(task, completed=n)


def _run_chain(
    session: Session,
    image: str,
    spool: imagechain.Spool,
    hp: imagechain.HostPlan,
    by_name: dict[str, Host],
    progress: Progress | None,
    stall: float,
    results: dict[str, PushResult],
) -> list[Direct]:
    """Chain rounds until every chain host is loaded, named, or moved to a direct push (returned:
    (host, layer indices, why))."""
    chain = list(hp.chain)
    direct: list[Direct] = []
    for _ in range(len(hp.chain) + 1):
        if not chain:
            break
        send = tuple(sorted({i for h in chain for i in hp.need[h]}))
        ranges = spool.ranges(send)
        size = imagechain.Spool.size(ranges)
        task = progress.add_task(f"push {image} (chain of {len(chain)})", total=size) if progress else None
        on_sent = _sent_to(progress, task) if progress is not None and task is not None else None
        start = time.monotonic()
        rr = imagechain.run_round(
            session,
            tuple(by_name[h] for h in chain),
            spool.chunks(ranges),
            size,
            push_deadline(size),
            stall=stall,
            on_sent=on_sent,
        )
        seconds = time.monotonic() - start
        if progress is not None and task is not None:
            progress.remove_task(task)
        if rr.dead:
            for h, why in rr.dead.items():
                results[h] = PushResult(h, "failed", detail=why)
            chain = [h for h in chain if h not in rr.dead]
            continue
        if rr.unreachable:
            ups = {h: chain[chain.index(h) - 1] for h in rr.unreachable}
            kept, moved = imagechain.relink(tuple(chain), rr.unreachable)
            direct += [(h, hp.need[h], f"{ups[h]} could not connect to it") for h in moved]
            chain = list(kept)
            continue
        out = imagechain.judge_round(tuple(chain), rr.reports, size)
        for i, h in enumerate(chain):
            if h in out.loaded:
                results[h] = PushResult(
                    h, "sent", seconds, size, f"chain {i + 1}/{len(chain)}{_layers_note(send, spool)}"
                )
            elif h in out.load_failed and "layer.tar" in rr.reports[h].load_error:
                # It no longer holds a layer it held when looked at: the whole image, directly.
                direct.append((h, tuple(range(len(spool.layer_paths))), f"after: {out.failed[h]}"))
            elif h in out.failed:
                results[h] = PushResult(h, "failed", detail=out.failed[h])
        chain = list(out.retry)
    direct += [(h, hp.need[h], "still short after every chain round") for h in chain]
    return direct


def _push_spool_direct(
    session: Session,
    image: str,
    spool: imagechain.Spool,
    direct: list[Direct],
    by_name: dict[str, Host],
    progress: Progress | None,
    results: dict[str, PushResult],
) -> None:
    """One stream from the saved tarball to every host in `direct` at once (the union of the
    layers they lack)."""
    send = tuple(sorted({i for _, need, _ in direct for i in need}))
    ranges = spool.ranges(send)
    size = imagechain.Spool.size(ranges)
    why = {h: w for h, _, w in direct}
    for r in stream_loads(
        session, f"push {image} (direct)", size, [by_name[h] for h in why], progress, spool.chunks(ranges)
    ):
        if r.action == "sent":
            r.detail = f"direct{' (' + why[r.host] + ')' if why[r.host] else ''}{_layers_note(send, spool)}"
        results[r.host] = r


def _verify(session: Session, want: str, image: str, hosts: list[Host], results: dict) -> None:
    ids = session.fan_out(lambda h: remote_image_id(session, h, image), tuple(hosts))
    for h in hosts:
        r = results[h.name]
        if ids.value(h.name) != want:
            r.action, r.detail = "failed", f"after loading, {h.name} holds {ids.value(h.name)}, not {want}"


def _push_direct(
    session: Session, image: str, hosts: tuple[Host, ...], progress: Progress | None
) -> list[PushResult]:
    """One local `docker save` streamed at once to every host that lacks the image, whole."""
    want, size = local_image(image)
    have = session.fan_out(lambda h: remote_image_id(session, h, image), hosts)
    results: dict[str, PushResult] = {}
    targets = []
    for h in hosts:
        got = have.value(h.name)
        error = have.error(h.name)
        if error:
            results[h.name] = PushResult(h.name, "failed", detail=describe(h, error))
        elif got == want:
            results[h.name] = PushResult(h.name, "present")
        else:
            targets.append(h)
    if targets:
        save = subprocess.Popen(["docker", "save", image], stdout=subprocess.PIPE)
        stdout = save.stdout
        assert stdout is not None  # stdout=PIPE
        try:
            streamed = stream_loads(
                session, f"push {image}", size, targets, progress, iter(lambda: stdout.read(CHUNK), b"")
            )
        finally:
            stdout.close()
            save.wait()
        for r in streamed:
            if r.action == "sent" and save.returncode != 0:
                r.action, r.detail = "failed", f"docker save {image} exited {save.returncode}"
            results[r.host] = r
        _verify(session, want, image, [h for h in targets if results[h.name].action == "sent"], results)
    return [results[h.name] for h in hosts]


DERIVED_DOCKERFILE = (
    "FROM {base}\n"
    "COPY context/ /tmp/fabtrain-build/\n"
    "RUN PIP_BREAK_SYSTEM_PACKAGES=1 python3 -m pip install --no-cache-dir {pip_flags}"
    "-r /tmp/fabtrain-build/requirements.txt \\\n"
    " && rm -rf /tmp/fabtrain-build\n"
    "COPY entrypoint.py /usr/local/bin/fabtrain-entrypoint\n"
    "COPY {modules} /usr/local/bin/\n"
    'LABEL fabtrain.base="{base}"\n'
    'ENTRYPOINT ["python3", "/usr/local/bin/fabtrain-entrypoint"]\n'
)


def derived_dockerfile(base: str, pip_flags: tuple[str, ...] = (), offline: bool = False) -> str:
    """The Dockerfile of a derived image. Offline, pip installs only from wheels in the context
    (downloaded on this machine), so the build needs no index: hosts are often air-gapped. Every
    runtime file but the entrypoint lands beside it, where it imports them."""
    flags = ("--no-index", "--find-links", "/tmp/fabtrain-build/wheels") if offline else ()
    return DERIVED_DOCKERFILE.format(
        base=base,
        pip_flags="".join(f"{sshargs.shell([f])} " for f in (*flags, *pip_flags)),
        modules=" ".join(name for name in dockerargs.RUNTIME_SOURCES if name != "entrypoint.py"),
    )


def build(
    base: str,
    requirements: Path,
    tag: str,
    pip_flags: tuple[str, ...] = (),
    wheels: Path | None = None,
    progress: Progress | None = None,
) -> str:
    """Build `tag` from `base` + requirements + the entrypoint on the local engine; its id. With
    `progress` (bars.bar(console, *bars.step_columns())), docker's steps as a bar."""
    if not requirements.is_file():
        raise UserError(f"{requirements}: requirements file not found")
    if wheels is not None and not wheels.is_dir():
        raise UserError(
            f"--wheels {wheels}: not a directory (fill one with: pip download -r REQUIREMENTS -d DIR)"
        )
    with tempfile.TemporaryDirectory(prefix="fabtrain-build-") as ctx:
        ctxp = Path(ctx)
        (ctxp / "Dockerfile").write_text(derived_dockerfile(base, pip_flags, offline=wheels is not None))
        (ctxp / "context").mkdir()
        (ctxp / "context" / "requirements.txt").write_bytes(requirements.read_bytes())
        if wheels is not None:
            shutil.copytree(wheels, ctxp / "context" / "wheels")
        for name, source in dockerargs.RUNTIME_SOURCES.items():
            (ctxp / name).write_bytes(source.read_bytes())
        code, err = run_build(["docker", "build", "--tag", tag, ctx], f"build {tag}", progress)
    if code != 0:
        raise UserError(f"building {tag} from {base} failed:\n{err.strip()[-1500:]}")
    return local_image(tag)[0]


def run_build(argv: list[str], label: str, progress: Progress | None) -> tuple[int, str]:
    """Run a docker build (the classic builder: its 'Step N/M' lines are the bar's steps, read by
    bars.parse_build_step); its exit status and stderr (capped)."""
    from orchestrator.progress import bars

    task = progress.add_task(label, total=None, step="") if progress is not None else None

    def on_line(line: bytes) -> None:
        got = bars.parse_build_step(line)
        if got is not None and progress is not None and task is not None:
            progress.update(task, completed=got[0] - 1, total=got[1], step=got[2])

    try:
        code, err = bars.run_watched(
            argv,
            bars.Lines(on_line).feed,
            env={"DOCKER_BUILDKIT": "0", "PATH": "/usr/local/bin:/usr/bin:/bin"},
        )
    finally:
        if progress is not None and task is not None:
            progress.remove_task(task)
    return code, err.decode("utf-8", "replace")
