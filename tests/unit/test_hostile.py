"""orchestrator/core/hostile.py: the one place for what hosts and containers send back."""

import io
import random
import string
import time
import tracemalloc
from pathlib import Path

import pytest
from rich.console import Console

from orchestrator.core import hostile
from orchestrator.transport.logs import Multiplexer

ATTACK = "\x1b]52;c;cGF5bG9hZA==\x07\x1b[2J\u009b31m\u202e[/red][link=file:///etc/passwd]x[/link]\r\bok"


# ---------------------------------------------------------------- text


def test_text_removes_everything_a_terminal_obeys_and_keeps_the_rest():
    assert hostile.text(ATTACK) == "]52;c;cGF5bG9hZA==[2J31m[/red][link=file:///etc/passwd]x[/link]ok"
    assert hostile.text("tab\tand\nnewline stay, é and 日本 too") == "tab\tand\nnewline stay, é and 日本 too"


def test_text_bytes_matches_text_on_utf8():
    assert hostile.text_bytes(ATTACK.encode()).decode() == hostile.text(ATTACK)


def test_line_is_one_bounded_line():
    assert hostile.line("a\n\nb\x1b[31m\n", 100) == "a | b[31m"
    assert hostile.line("x" * 500, 10) == "x" * 10 + "...[cut]"


def test_rich_text_is_never_markup_and_never_raises():
    out = io.StringIO()
    console = Console(file=out, force_terminal=False, width=300)
    console.print(hostile.rich_text(ATTACK, "red"))
    printed = out.getvalue()
    assert "\x1b" not in printed and "[/red][link=file:///etc/passwd]x[/link]" in printed
    # On a terminal the style's own colour codes are there, but the text's links are not.
    out = io.StringIO()
    Console(file=out, force_terminal=True, width=300).print(hostile.rich_text(ATTACK, "red"))
    assert (
        "\x1b]8;" not in out.getvalue()
        and "\x1b]52" not in out.getvalue()
        and "\x1b[2J" not in out.getvalue()
    )


# ---------------------------------------------------------------- names and paths


@pytest.mark.parametrize(
    "name, why",
    [
        ("", "empty"),
        ("/etc/passwd", "absolute"),
        ("~/x", "absolute"),
        ("../x", "'..'"),
        ("a/../../b", "'..'"),
        ("ok\n00000000000000000000 /tmp/pwned", "control"),
        ("a\x1b[2Jb", "control"),
        ("a\\..\\b", "backslash"),
        ("x" * 300, "longer"),
        ("./.", "no file name"),
    ],
)
def test_relpath_refuses(name, why):
    with pytest.raises(hostile.UnsafeName, match=why):
        hostile.relpath(name)


def test_relpath_normalises_harmless_forms():
    assert hostile.relpath("./a//b/./c.pt") == "a/b/c.pt"
    assert hostile.relpath("$(touch x)") == "$(touch x)"  # a name, never run: it stays one
    assert hostile.component("node1") == "node1"
    with pytest.raises(hostile.UnsafeName):
        hostile.component("a/b")


def test_relpath_refuses_a_symlink_that_leads_out(tmp_path):
    (tmp_path / "root").mkdir()
    (tmp_path / "root" / "out").symlink_to(tmp_path)
    with pytest.raises(hostile.UnsafeName, match="leads out"):
        hostile.relpath("out/x", tmp_path / "root")
    assert hostile.relpath("in/x", tmp_path / "root") == "in/x"


def test_relpath_fuzzed_never_leads_out(tmp_path):
    """Generated names, hostile alphabet: each one is refused, or stays inside its directory."""
    rng = random.Random(31)
    alphabet = (
        list("/.\\~$()`;'\" \n\r\t\x00\x1b\x7f\u009b\u202e") + list(string.ascii_letters[:6]) + ["..", "é"]
    )
    root = (tmp_path / "runs" / "JOB").resolve()
    root.mkdir(parents=True)
    accepted = 0
    for _ in range(20000):
        name = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 12)))
        try:
            clean = hostile.relpath(name, root)
        except hostile.UnsafeName:
            continue
        accepted += 1
        where = (root / clean).resolve()
        assert root in where.parents, (name, clean)
        assert not any(ord(c) < 32 or 0x7F <= ord(c) <= 0x9F for c in clean)
        assert ".." not in clean.split("/") and not clean.startswith("/")
    assert accepted > 1000  # the fuzz reached the accepting side too


# ---------------------------------------------------------------- sizes


def test_line_cutter_cuts_long_lines_only():
    cut = hostile.LineCutter(limit=10)
    assert cut.feed(b"short\n") == b"short\n"
    # A long line arriving in pieces: 10 bytes kept, the marker once, the rest dropped to its newline.
    assert (
        cut.feed(b"0123456") + cut.feed(b"789abc") + cut.feed(b"defg\nnext\n")
        == b"0123456789" + hostile.CUT + b"\nnext\n"
    )


def test_line_cutter_costs_bounded_memory_and_linear_time():
    cut = hostile.LineCutter()
    chunk = b"A" * (1 << 16)
    tracemalloc.start()
    start = time.process_time()
    kept = sum(len(cut.feed(chunk)) for _ in range(4096))  # 256 MB, no newline
    seconds = time.process_time() - start
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert kept == hostile.LINE_MAX + len(hostile.CUT)
    assert peak < 4 << 20, peak
    assert seconds < 5, seconds  # ~0.1 s here; the old concatenation took tens of seconds


def test_capped_keeps_the_first_bytes_and_says_how_many_were_dropped():
    c = hostile.Capped(limit=8)
    c.write(b"12345")
    c.write(b"67890")
    c.write(b"xyz")
    assert c.getvalue() == b"12345678\n...[cut] (5 more bytes)\n"
    small = hostile.Capped(limit=8)
    small.write(b"1234")
    assert small.getvalue() == b"1234"


def test_a_host_sink_keeps_a_huge_line_cut_in_the_file_and_the_terminal(tmp_path):
    out = io.BytesIO()
    sink = Multiplexer(tmp_path, out=out, colour=False).sink("node1", 0)
    for _ in range(64):  # 4 MB with no newline, then a newline and one more line
        sink.feed(b"B" * (1 << 16))
    sink.feed(b"\nafter\n")
    sink.close()
    expected = b"B" * hostile.LINE_MAX + hostile.CUT + b"\nafter\n"
    assert (tmp_path / "node1.log").read_bytes() == expected
    assert out.getvalue() == b"node1 r0 | " + b"B" * hostile.LINE_MAX + hostile.CUT + b"\nnode1 r0 | after\n"


def test_slurm_node_names_that_are_not_plain_names_never_name_a_file(tmp_path):
    from orchestrator.backends.slurm import commands as slurm

    assert slurm.node_name("gpu-a17", 0) == "gpu-a17"
    assert [slurm.node_name(n, i) for i, n in enumerate(["../../x", "/etc/y", "a\x1bb", ".."])] == [
        "node0",
        "node1",
        "node2",
        "node3",
    ]
    with pytest.raises(hostile.UnsafeName):
        Multiplexer(tmp_path, out=io.BytesIO()).sink("../escape", 0)


def test_a_job_record_naming_another_job_is_refused(tmp_path):
    import json

    from orchestrator.core import recovery
    from orchestrator.core.errors import UserError

    (tmp_path / "gpt-1").mkdir()
    doc = {"spec": {"job_id": "../../etc", "script": "x.py"}, "inventory": "inventory.yaml"}
    (tmp_path / "gpt-1" / "job.json").write_text(json.dumps(doc))
    with pytest.raises(UserError, match=r"names job '\.\./\.\./etc', not gpt-1"):
        recovery.JobRecord.load(tmp_path, "gpt-1")


def test_preflight_details_from_hosts_are_shown_as_plain_text():
    import importlib

    from orchestrator.preflight.checks import FAIL, OK, Check

    render = importlib.import_module("orchestrator.preflight.render")
    out = io.StringIO()
    render.render(
        [Check("node1", "ssh", OK, "ok " + ATTACK), Check("node1", "docker", FAIL, ATTACK, "fix [/]it")],
        Console(file=out, width=200),
    )
    printed = out.getvalue()
    assert "\x1b" not in printed and "\x07" not in printed
    assert "FAIL node1 docker: ]52;c;cGF5bG9hZA==[2J31m[/red][link=file:///etc/passwd]x[/link]ok" in printed
    assert "fix: fix [/]it" in printed


@pytest.mark.parametrize("args", [["--help", "train"], ["--list"]])
def test_a_closed_pipe_ends_fab_quietly(args):
    import shlex
    import subprocess
    import sys

    fab = str(Path(sys.executable).parent / "fab")
    root = Path(__file__).resolve().parents[2]
    # `true` reads nothing and is gone long before fab (0.5 s to start) writes: the pipe is closed.
    cmd = f'{shlex.join([fab, "-r", str(root), *args])} | true; echo "rc=${{PIPESTATUS[0]}}"'
    r = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=120)
    assert "Traceback" not in r.stderr and "Exception ignored" not in r.stderr, r.stderr
    assert r.stdout.strip() == "rc=141", r.stdout  # as `yes | true`: 128 + SIGPIPE


def test_the_claims_survey_skips_a_file_whose_name_would_add_a_line(tmp_path):
    import subprocess

    from orchestrator.config.inventory import parse
    from orchestrator.hosts import claims

    inv = parse(
        f"job: {{output_dir: {tmp_path}}}\nhosts:\n  - {{name: n1, address: 10.0.0.1, interface: eth0}}\n",
        Path("i.yaml"),
    )
    d = tmp_path / ".claims" / subprocess.run(["hostname"], capture_output=True, text=True).stdout.strip()
    d.mkdir(parents=True)
    (d / "gpt-1").write_text("who=al@ws\nsince=1\nunits=0\n")
    (d / "x\nvictim-2 who=me since=1 units=0,1").write_text("who=me\n")
    out = subprocess.run(["sh", "-c", claims.survey_script(inv)], capture_output=True, text=True).stdout
    _, held, _ = claims.parse_survey(out.split("@@claims\n", 1)[1])
    assert [h.job for h in held] == ["gpt-1"]


def test_the_slurm_demultiplexer_holds_a_line_with_no_end_cut(tmp_path):
    from orchestrator.backends.slurm import follow as slurm

    mux = Multiplexer(tmp_path, out=io.BytesIO(), colour=False)
    demux = slurm.Demux(mux, lambda restart: ["gpu1"])
    tracemalloc.start()
    for _ in range(512):  # 32 MB with no newline, on node 0's labelled line
        demux.feed((b"0: " if not _ else b"") + b"C" * (1 << 16))
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    demux.feed(b"\n0: after\n")
    demux.close()
    assert len(demux.partial) == 0 and peak < 4 << 20, peak
    assert (tmp_path / "node0.log").read_bytes() == b"C" * hostile.LINE_MAX + hostile.CUT + b"\nafter\n"


def test_bytes_that_are_not_utf8_never_reach_a_terminal_as_c1_controls():
    assert hostile.text_bytes(b"a\x9b2Jb\xc2\x9bc") == "a\ufffd2Jbc".encode()
    assert hostile.text_bytes("é\u061cx\u202e".encode()) == "éx".encode()
    assert hostile.text_bytes(b"plain\tascii\x1b[0m\n") == b"plain\tascii[0m\n"


def test_a_rank_name_with_math_markup_still_gets_its_curves(tmp_path):
    from orchestrator.progress import report

    line = (
        "[n$\\x$1 rank{r}] epoch 0 | step {s} | loss 2.0 | lr 1.00e-03 | 1,000 tok/s | step 11.0 ms | "
        "compute 10.0 ms\n"
    )
    (tmp_path / "node1.log").write_text("".join(line.format(r=r, s=s) for r in (0, 1) for s in (1, 2, 3)))
    assert report.write_plot([tmp_path], tmp_path / "loss.png").stat().st_size > 0


def test_our_snapshots_are_never_renamed_through_a_link_the_container_left(tmp_path):
    import subprocess

    from orchestrator.snapshots import commands as snapshots

    victim, job = tmp_path / "victim", tmp_path / "job"
    victim.mkdir()
    job.mkdir()
    (job / "snapshots").symlink_to(victim)  # the container owns /output: snapshots/ may be a link
    (victim / ".snapshot-000000001.pt.copy.tmp").write_bytes(b"x")
    cmd = snapshots.rename_command(
        f"{job}/snapshots/.snapshot-000000001.pt.copy.tmp", f"{job}/snapshots/snapshot-000000001.pt"
    )
    r = subprocess.run(["sh", "-c", cmd], capture_output=True, text=True)
    assert r.returncode == 1 and "is a symbolic link; nothing is written through it" in r.stderr
    assert sorted(p.name for p in victim.iterdir()) == [".snapshot-000000001.pt.copy.tmp"]
    # A link at the snapshot's own name is replaced, not followed into the directory it names.
    (job / "snapshots").unlink()
    (job / "snapshots").mkdir()
    (job / "snapshots" / ".snapshot-000000001.pt.copy.tmp").write_bytes(b"y")
    (job / "snapshots" / "snapshot-000000001.pt").symlink_to(victim)
    r = subprocess.run(["sh", "-c", cmd], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert (job / "snapshots" / "snapshot-000000001.pt").read_bytes() == b"y"
    assert not (job / "snapshots" / "snapshot-000000001.pt").is_symlink()
    assert sorted(p.name for p in victim.iterdir()) == [".snapshot-000000001.pt.copy.tmp"]
