"""Image distribution by chain: which layers a host lacks, who goes in the chain, how a round is
judged and the chain reformed, the exact remote commands, the partial tarball, and the relay itself
run on this machine (three relays over loopback, `docker` stubbed)."""

import hashlib
import io
import json
import os
import shlex
import subprocess
import tarfile
import time

import pytest

from orchestrator.core.errors import UserError
from orchestrator.images import imagechain as ic
from orchestrator.images.relay import RELAY, Report, control_line, relay_command

A, B, C, D = (f"sha256:{c * 64}" for c in "abcd")


def chain_of(*diffs):
    return ic.chain_ids(list(diffs))


def test_chain_ids_follow_the_oci_rule():
    assert chain_of(A) == [A]
    ab = "sha256:" + hashlib.sha256(f"{A} {B}".encode()).hexdigest()
    abc = "sha256:" + hashlib.sha256(f"{ab} {C}".encode()).hexdigest()
    assert chain_of(A, B, C) == [A, ab, abc]


def test_a_layer_is_held_only_on_top_of_the_same_layers():
    held = ic.held_chain_ids([[A, B, C], [D]])
    assert ic.missing_layers((A, B, D), held) == (2,)  # the changed top layer only
    assert ic.missing_layers((A, B, C), held) == ()
    assert ic.missing_layers((D, B), held) == (1,)  # B is held, but on A, not on D
    assert ic.missing_layers((B,), held) == (0,)
    assert ic.missing_layers((A, B), ic.held_chain_ids([])) == (0, 1)


def test_probe_command_is_one_quoted_sh_script_with_the_image_as_its_argument():
    cmd = ic.probe_command("my/img:1; rm -rf /")
    assert shlex.split(cmd) == ["sh", "-c", ic.PROBE_SCRIPT, "sh", "my/img:1; rm -rf /"]


def test_probe_script_on_a_stubbed_docker(tmp_path):
    docker = tmp_path / "docker"
    docker.write_text(
        "#!/bin/sh\n"
        'case "$*" in\n'
        '  "image ls --all --quiet --no-trunc") printf "sha256:1\\nsha256:2\\nsha256:1\\n" ;;\n'
        '  "image inspect --format {{.Id}} img") echo sha256:2 ;;\n'
        f'  "image inspect --format layers {{{{json .RootFS.Layers}}}} sha256:1 sha256:2") '
        f'printf \'layers ["{A}"]\\nlayers ["{A}","{B}"]\\n\' ;;\n'
        '  *) echo "unexpected: $*" >&2; exit 9 ;;\n'
        "esac\n"
    )
    docker.chmod(0o755)
    r = subprocess.run(
        shlex.split(ic.probe_command("img")),
        capture_output=True,
        text=True,
        env={"PATH": f"{tmp_path}:/usr/bin:/bin"},
    )
    assert r.returncode == 0, r.stderr
    p = ic.parse_probe(r.stdout)
    assert p == ic.Probe("sha256:2", ic.held_chain_ids([[A], [A, B]]), True)


def test_parse_probe_of_an_empty_engine_without_python():
    assert ic.parse_probe("python no\nid \n") == ic.Probe(None, frozenset(), False)


def probe(image_id=None, layers=(), python=True):
    return ic.Probe(image_id, ic.held_chain_ids([list(x) for x in layers]), python)


def test_plan_keeps_order_and_sends_the_union_of_what_the_chain_lacks():
    probes = {
        "n1": probe("sha256:old", [[A, B]]),
        "n2": probe(None, [[A]]),
        "n3": probe("sha256:new"),
        "n4": "n4: connection refused",
        "n5": probe(None, [[A, B, C]], python=False),
    }
    p = ic.plan_hosts("sha256:new", (A, B, C), ("n1", "n2", "n3", "n4", "n5"), probes)
    assert p.present == ("n3",)
    assert p.chain == ("n1", "n2")
    assert p.direct == ("n5",)  # no python3: no relay
    assert p.failed == {"n4": "n4: connection refused"}
    assert p.need == {"n1": (2,), "n2": (1, 2), "n5": ()}
    assert p.send == (1, 2)


def test_plan_direct_method_and_a_bad_method():
    probes = {"n1": probe(None), "n2": probe(None)}
    p = ic.plan_hosts("sha256:x", (A,), ("n1", "n2"), probes, method="direct")
    assert p.chain == () and p.direct == ("n1", "n2") and p.send == ()
    with pytest.raises(UserError, match="method 'tree': use chain or direct"):
        ic.plan_hosts("sha256:x", (A,), ("n1",), {"n1": probe()}, method="tree")


def test_relink_closes_the_chain_over_a_host_nobody_can_reach():
    assert ic.relink(("n1", "n2", "n3", "n4"), ("n3",)) == (("n1", "n2", "n4"), ("n3",))
    assert ic.relink(("n1", "n2"), ()) == (("n1", "n2"), ())


def ok(size, **kw):
    return Report(received=size, load_exit=0, **kw)


def test_judge_all_loaded():
    out = ic.judge_round(("n1", "n2"), {"n1": ok(10), "n2": ok(10)}, 10)
    assert out == ic.RoundOutcome(("n1", "n2"), {}, ())


def test_judge_a_host_lost_mid_chain_is_named_and_the_hosts_after_it_are_retried():
    reports = {
        "n1": ok(10, next_error="timed out"),
        "n2": "n2: stopped answering mid-chain (nothing for 60s)",
        "n3": Report(4, None, source_error="upstream: timed out"),
        "n4": Report(4, None),
    }
    out = ic.judge_round(("n1", "n2", "n3", "n4"), reports, 10)
    assert out.loaded == ("n1",)
    assert out.failed == {"n2": "n2: stopped answering mid-chain (nothing for 60s)"}
    assert out.retry == ("n3", "n4")


def test_judge_a_host_whose_engine_failed_is_named_and_the_chain_after_it_is_unaffected():
    reports = {"n1": ok(10), "n2": Report(10, 1, "Cannot connect to the Docker daemon"), "n3": ok(10)}
    out = ic.judge_round(("n1", "n2", "n3"), reports, 10)
    assert out.loaded == ("n1", "n3") and out.retry == () and out.load_failed == ("n2",)
    assert out.failed == {"n2": "n2: docker load exited 1: Cannot connect to the Docker daemon"}


def test_judge_a_short_stream_nothing_upstream_explains_is_named():
    out = ic.judge_round(
        ("n1", "n2"), {"n1": Report(3, None, source_error="upstream: reset"), "n2": Report(3, None)}, 10
    )
    assert out.failed == {"n1": "n1: received 3 of 10 bytes from this machine (upstream: reset)"}
    assert out.retry == ("n2",)  # its upstream n1 broke first


def test_judge_upstream_could_not_send_on():
    out = ic.judge_round(("n1", "n2"), {"n1": ok(10, next_error="Broken pipe"), "n2": Report(5, None)}, 10)
    assert out.loaded == ("n1",) and out.retry == ("n2",) and out.failed == {}


def test_relay_command_is_python3_with_the_relay_quoted_once():
    assert shlex.split(relay_command(True, "10.0.0.1")) == ["python3", "-c", RELAY, "first", "10.0.0.1"]
    assert shlex.split(relay_command(False, "10.0.0.2"))[3:] == ["relay", "10.0.0.2"]


def test_control_line():
    line = control_line("t0k", ("10.0.0.2", 4242), 99, 30, 600, 5)
    assert line.endswith(b"\n")
    assert json.loads(line) == {
        "token": "t0k",
        "next": ["10.0.0.2", 4242],
        "size": 99,
        "stall": 30,
        "deadline": 600,
        "connect": 5,
    }
    assert json.loads(control_line("t", None, 1, 1, 1, 1))["next"] is None


def save_like_tar(path, layers):
    """A tarball laid out as `docker save` writes it: a folder per layer, config, manifest last."""
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:

        def add(name, data):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))

        for name, data in layers:
            d = tarfile.TarInfo(name)
            d.type = tarfile.DIRTYPE
            tar.addfile(d)
            add(f"{name}/VERSION", b"1.0")
            add(f"{name}/json", b"{}")
            add(f"{name}/layer.tar", data)
        add("c0ffee.json", b'{"rootfs": {}}')
        add(
            "manifest.json",
            json.dumps(
                [
                    {
                        "Config": "c0ffee.json",
                        "RepoTags": ["x:1"],
                        "Layers": [f"{n}/layer.tar" for n, _ in layers],
                    }
                ]
            ).encode(),
        )
        add("repositories", b"{}")


def test_spool_ranges_leave_out_the_layers_nobody_lacks(tmp_path):
    save_like_tar(
        tmp_path / "img.tar", [("f1", os.urandom(5000)), ("a2", os.urandom(70000)), ("c3", b"top" * 100)]
    )
    spool = ic.Spool(tmp_path / "img.tar")
    assert spool.layer_paths == ["f1/layer.tar", "a2/layer.tar", "c3/layer.tar"]
    assert spool.ranges() == [(0, spool.total)]
    partial = b"".join(spool.chunks(spool.ranges((2,))))
    assert (
        len(partial) == ic.Spool.size(spool.ranges((2,))) < spool.total // 4
    )  # the 75 kB of layers left out
    with tarfile.open(fileobj=io.BytesIO(partial)) as tar:
        names = tar.getnames()
        assert "c3/layer.tar" in names and "f1/layer.tar" not in names and "a2/layer.tar" not in names
        assert {"f1/json", "a2/VERSION", "manifest.json", "repositories"} <= set(names)
        assert tar.extractfile("c3/layer.tar").read() == b"top" * 100


FAKE_DOCKER = """#!/bin/sh
# docker load, stubbed: what it is given lands in $LOAD_OUT; with LOAD_FAIL it dies at once.
[ -n "$LOAD_FAIL" ] && { echo "Cannot connect to the Docker daemon" >&2; exit 1; }
cat > "$LOAD_OUT"
"""


def start_relay(tmp_path, name, first, fail=False):
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    (bindir / "docker").write_text(FAKE_DOCKER)
    (bindir / "docker").chmod(0o755)
    env = {
        "PATH": f"{bindir}:/usr/bin:/bin",
        "LOAD_OUT": str(tmp_path / f"{name}.out"),
        **({"LOAD_FAIL": "1"} if fail else {}),
    }
    argv = shlex.split(relay_command(first, "127.0.0.1"))  # the host's python3, as on a host
    proc = subprocess.Popen(
        argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env
    )
    word, port = proc.stdout.readline().decode().split()
    assert word == "port"
    return proc, int(port)


def run_local_chain(tmp_path, data, fail=()):
    names = ["r1", "r2", "r3"]
    relays = [start_relay(tmp_path, n, i == 0, n in fail) for i, n in enumerate(names)]
    for i, (proc, _) in enumerate(relays):
        nxt = ("127.0.0.1", relays[i + 1][1]) if i + 1 < len(relays) else None
        proc.stdin.write(control_line("secret", nxt, len(data), 10, 60, 5))
        proc.stdin.flush()
    for proc, _ in relays[:-1]:
        assert proc.stdout.readline().decode().strip() == "linked"
    head = relays[0][0]
    for i in range(0, len(data), 1 << 16):
        head.stdin.write(data[i : i + (1 << 16)])
    head.stdin.close()
    reports = {}
    for name, (proc, _) in zip(names, relays, strict=True):
        lines = proc.stdout.read().decode().splitlines()
        proc.wait(timeout=30)
        result = [ln for ln in lines if ln.startswith("result ")]
        assert result, (name, lines, proc.stderr.read())
        reports[name] = Report(**json.loads(result[-1].split(" ", 1)[1]))
        if proc.stdin and not proc.stdin.closed:
            proc.stdin.close()
    return reports


def test_three_relays_over_loopback_each_load_and_forward_the_same_bytes(tmp_path):
    data = os.urandom(3 * (1 << 20) + 123)
    reports = run_local_chain(tmp_path, data)
    for name in ("r1", "r2", "r3"):
        assert reports[name] == Report(len(data), 0), reports[name]
        assert (tmp_path / f"{name}.out").read_bytes() == data
    assert ic.judge_round(("r1", "r2", "r3"), reports, len(data)).loaded == ("r1", "r2", "r3")


def test_a_relay_whose_engine_fails_still_forwards(tmp_path):
    data = os.urandom(2 * (1 << 20))
    reports = run_local_chain(tmp_path, data, fail=("r2",))
    assert reports["r2"].received == len(data) and reports["r2"].load_exit == 1
    assert "Cannot connect to the Docker daemon" in reports["r2"].load_error
    assert (tmp_path / "r3.out").read_bytes() == data and reports["r3"].load_exit == 0
    out = ic.judge_round(("r1", "r2", "r3"), reports, len(data))
    assert out.loaded == ("r1", "r3") and list(out.failed) == ["r2"]


def test_a_relay_refuses_a_connection_without_the_token_and_gives_up_after_stall(tmp_path):
    import socket

    proc, port = start_relay(tmp_path, "lone", False)
    proc.stdin.write(control_line("secret", None, 10, 2, 60, 5))
    proc.stdin.flush()
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(b"wrong!")
    start = time.monotonic()
    lines = []
    while not any(ln.startswith("result") for ln in lines):
        lines.append(proc.stdout.readline().decode())
    report = Report(**json.loads(lines[-1].split(" ", 1)[1]))
    assert report.received == 0 and report.source_error.startswith("no upstream connection")
    assert time.monotonic() - start < 10
    proc.stdin.close()
    proc.wait(timeout=10)
    assert not (tmp_path / "lone.out").exists()
