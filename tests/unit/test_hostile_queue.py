"""What anyone of the group (or anything) can put in a host's claims directory and its queue, judged
by the host's own clock: a queue place or a claim's lease dated ahead of it (it would stay fresh,
and block the host, until that date) or not renewed is dropped, naming the file, its owner and why;
a file that is no claim or place (a link, not a regular file, a name that is no job id, no units= or
ticket= of fabtrain's form) is named and obeyed not at all, its target never read. The exact
scripts and messages, and the scripts run by a real sh against a directory here, with a `date` on
PATH that says the host's time, so every age is exact."""

import os
import subprocess
import time
from pathlib import Path

import pytest

from orchestrator.config.inventory import parse
from orchestrator.hostcmds import hostfiles
from orchestrator.hosts import claimdir, claims, queue
from orchestrator.hosts.survey import HostJobs, job_views
from orchestrator.transport.remote import PerHost

HOSTS = "hosts:\n  - {name: gpu1, address: 10.0.0.1, interface: eth0, gpus: {vendor: nvidia, count: 4}}\n"
INV = parse("job: {output_dir: /opt/out}\n" + HOSTS, Path("i.yaml"))
GPU = INV.hosts[0]
STALE = int(hostfiles.LEASE_STALE)
DIGITS = "[0-9]" * 20
TICKET = "01795000000000000000-x-1"  # of new_ticket's form, earlier than any taken now


def test_the_files_are_read_without_following_links_bounded_and_as_printable_lines():
    assert claimdir.FUTURE_SLACK == 60
    assert claimdir.entries_script() == (
        'printf "in %s\\n" "$PWD"; '
        'ignored() { printf "ignored %s %s\\n" "$(printf %s "${1#./}" | LC_ALL=C tr -c "A-Za-z0-9._/-" "?")" '
        '"$2"; }; '
        'entry() { j=${1##*/}; { [ -e "$1" ] || [ -L "$1" ]; } || return 1; '
        'if [ -L "$1" ]; then ignored "$1" link; return 1; fi; '
        '[ -f "$1" ] || { ignored "$1" special; return 1; }; '
        'case "$j" in [!A-Za-z0-9]*|*[!A-Za-z0-9._-]*|*..*) ignored "$1" name; return 1;; esac; '
        '[ ${#j} -le 128 ] || { ignored "$1" name; return 1; }; '
        '{ command exec 8<"$1"; } 2>/dev/null || return 1; [ ! -L "$1" ] && [ "$1" -ef /dev/fd/8 ] || '
        '{ exec 8<&-; ignored "$1" changed; return 1; }; '
        'c=$(head -c 4096 <&8 | LC_ALL=C tr -cd "\\n -~"); '
        "a=$((now - $(stat -L -c %Y /dev/fd/8))); exec 8<&-; }; "
    )


def test_the_queue_scan_drops_places_dated_ahead_or_not_renewed_and_ignores_what_is_no_place():
    assert queue.queue_scan_script(INV, "gpt-1", None, "al@ws", ()) == (
        hostfiles.shared_dir_script("queue", check=False)
        + 'ahead=""; for f in queue/*; do [ "$f" = queue/gpt-1 ] && continue; entry "$f" || continue; '
        't=$(printf "%s\\n" "$c" | sed -n "s/^ticket=//p"); '
        f'case "$t" in {DIGITS}-*[!A-Za-z0-9._-]*) t="";; {DIGITS}-?*) ;; *) t="";; esac; '
        '[ -n "$t" ] || { ignored "$f" ticket; continue; }; '
        'line="$j age=$a $(printf %s "$c" | tr "\\n" " ")"; '
        f'if [ "$a" -lt -60 ] || [ "$a" -ge {STALE} ]; then rm -f "$f"; printf "dropped %s\\n" "$line"; '
        'continue; fi; if true; then printf "ahead %s\\n" "$line"; ahead=1; fi; done; '
        'wait_here() { exit "$1"; }; '
    )
    # A queued job: only places with an earlier ticket are ahead of it.
    assert 'if [ "$t" \\< 02000000000000000000-gpt-1 ]; then' in queue.queue_scan_script(
        INV, "gpt-1", "02000000000000000000-gpt-1", "al@ws", ()
    )
    assert queue.enqueue_script(INV, "gpt-1", TICKET, "al@ws", ()).count(claimdir.entries_script()) == 1


def test_the_claim_script_judges_each_claim_by_its_lease_on_the_hosts_clock():
    s = claims.claim_script(INV, "gpt-1", (0, 1), "al@ws", False)
    assert (
        'now=$(date +%s); taken=""; ports=""; '
        + claimdir.entries_script()
        + 'ahead=""; wait_here() { exit "$1"; }; '
        'for f in "$d"/*; do [ "$f" = "$d"/gpt-1 ] && continue; '
        '[ "$f" = "$d"/queue ] && [ -d "$f" ] && [ ! -L "$f" ] && continue; entry "$f" || continue; '
        'u=$(printf "%s\\n" "$c" | sed -n "s/^units=/=/p"); '
        'case "$u" in ""|*[!0-9,=]*|?*=*) ignored "$f" units; continue;; esac; '
        'u=$(printf %s "${u#=}" | tr , " "); r=/opt/out/.runtime/"$j"; '
        'ids=$(timeout -k 2 8 docker ps --quiet --filter label=fabtrain.job="$j" 2>/dev/null) '
        '|| ids=unknown; la=none; [ ! -L "$r" ] && [ -f "$r"/lease ] && [ ! -L "$r"/lease ] && '
        'la=$((now - $(stat -c %Y "$r"/lease))); '
        f'if [ -n "$ids" ] || {{ [ "$la" != none ] && [ "$la" -ge -60 ] && [ "$la" -lt {STALE} ]; }}; then '
        'printf "held %s %s\\n" "$j" "$(printf %s "$c" | tr "\\n" " ")"; taken="$taken ${u:-all}"; '
        'ports="$ports $(printf "%s\\n" "$c" | sed -n "s/^port=//p")"; else rm -f "$f"; '
        'printf "cleared %s age=%s %s\\n" "$j" "$la" "$(printf %s "$c" | tr "\\n" " ")"; fi; done; '
    ) in s
    # The first claim scans the queue too, after the same definitions, once.
    first = claims.claim_script(INV, "gpt-1", (0, 1), "al@ws", True)
    assert first.count(claimdir.entries_script()) == 1 and "for f in queue/*; do" in first


OUTPUT = (
    "in /opt/out/.claims/gpu-host-1\n"
    "ignored queue/a?b name\n"
    f"dropped x-1 age=-100000 who=bob@vm since=1795000000 ticket={TICKET} wants=all age=0\n"
    "dropped y-2 age=75 who=\x1b[2Jcarol@ws since=1795000000 ticket=01795000000000000001-y-2 wants=0,1\n"
    "ignored queue/z-3 link\n"
    "held al-1 who=al@ws since=1795000000 units=2 port=29500\n"
    "cleared ghost-1 age=-86400 who=eve@vm since=1795000000 units= port=\n"
    "cleared old-1 age=none who=bob@vm since=1795000000 units=0,1 port=\n"
    "cleared gone-1 age=90 who=bob@vm since=1795000000 units=3 port=\n"
    "ignored odd-1 units\n"
)


def when(since: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(since))


def test_what_was_dropped_cleared_or_ignored_is_read_back_with_the_hosts_ages_first():
    ahead, dropped = queue.parse_queue_output(OUTPUT)
    # The script's age comes first and counts, whatever age= the file's own text holds; the owner
    # named in a file is made safe to print.
    assert ahead == [] and dropped == [
        queue.Waiting("x-1", "bob@vm", 1795000000.0, TICKET, "all", -100000.0),
        queue.Waiting("y-2", "[2Jcarol@ws", 1795000000.0, "01795000000000000001-y-2", "0,1", 75.0),
    ]
    held, cleared = claims.parse_claim_output(OUTPUT)
    assert held == [claims.Holder("al-1", "al@ws", 1795000000.0, (2,), 29500)]
    assert [(c.job, c.units, c.age) for c in cleared] == [
        ("ghost-1", (), -86400.0),
        ("old-1", (0, 1), None),
        ("gone-1", (3,), 90.0),
    ]
    assert claimdir.where(OUTPUT) == "/opt/out/.claims/gpu-host-1"
    # A line that is no claim: no units= of numbers, or a name that is no job id.
    assert claims.parse_holder("x-1 who=a since=1") is None
    assert claims.parse_holder("x-1 who=a units=0,$(reboot)") is None
    assert claims.parse_holder("../x units=0") is None


def test_each_warning_names_the_file_on_the_host_its_owner_and_why():
    d = "/opt/out/.claims/gpu-host-1"
    t = when(1795000000)
    dropped = [
        f"gpu1: dropped {d}/queue/x-1 from the queue, the place of x-1 (queued by bob@vm at {t}): "
        "future-dated by 100000 s on gpu1's clock (more than the 60 s allowed): fab train dates its places "
        "by the host's own clock, so something else wrote this date, and the place would have held up every "
        "later job until then",
        f"gpu1: dropped {d}/queue/y-2 from the queue, the place of y-2 (queued by [2Jcarol@ws at {t}): "
        f"not renewed for 75 s (its fab train, or controller, renews it every few seconds while it waits; a "
        f"place is dropped after {hostfiles.LEASE_STALE:g} s)",
    ]
    ignored = [
        f"gpu1: ignored {d}/queue/a?b: its name is not a job id, so it holds up no job (fabtrain writes no "
        f"such file); each ? in its name stands for a character that cannot be shown: ls -b {d}/queue "
        "shows it, to remove it",
        f"gpu1: ignored {d}/queue/z-3: a symbolic link (never followed), so it holds up no job (fabtrain "
        f"writes no such file); remove it unless someone of the group needs it: rm -- {d}/queue/z-3",
        f"gpu1: ignored {d}/odd-1: no units= line of a claim (fab train writes units=N,M), so it holds up "
        f"no job (fabtrain writes no such file); remove it unless someone of the group needs it: "
        f"rm -- {d}/odd-1",
    ]
    assert queue.queue_warnings("gpu1", OUTPUT) == dropped + ignored
    assert claims.claim_warnings(GPU, OUTPUT) == [
        f"gpu1: cleared {d}/ghost-1, the claim of ghost-1 (started by eve@vm at {t}, GPUs all): no container "
        "of that job runs there and its lease is future-dated by 86400 s on gpu1's clock (more than the 60 s "
        "allowed): fab train renews it with the host's own clock, so something else wrote this date",
        f"gpu1: cleared {d}/old-1, the claim of old-1 (started by bob@vm at {t}, GPUs 0,1): no container of "
        "that job runs there and it has no lease (the file its fab train renews while it looks after the "
        "job)",
        f"gpu1: cleared {d}/gone-1, the claim of gone-1 (started by bob@vm at {t}, GPUs 3): no container of "
        "that job runs there and its lease was not renewed for 90 s (its fab train is gone)",
        *dropped,
        *ignored,
    ]
    # A path that is no plain word is quoted in the fix, once.
    assert claimdir.ignored_warnings("h", "in /o ut/.claims/h\nignored x-1 special\n") == [
        "h: ignored /o ut/.claims/h/x-1: not a regular file, so it holds up no job (fabtrain writes no such "
        "file); remove it unless someone of the group needs it: rm -- '/o ut/.claims/h/x-1'"
    ]


@pytest.mark.parametrize(
    "age, fresh",
    [
        (None, False),
        (-61, False),
        (-60, True),
        (0, True),
        (hostfiles.LEASE_STALE - 1, True),
        (hostfiles.LEASE_STALE, False),
    ],
)
def test_renewed_within_bounds_an_age_on_both_sides(age, fresh):
    assert claimdir.renewed_within(age, hostfiles.LEASE_STALE) is fresh


def test_the_survey_counts_no_place_or_lease_dated_ahead():
    """fab status, --num-nodes and the plan judge what the survey read as the claim script does."""
    ghost = claims.Holder("ghost-1", "eve@vm", 1.0, ())
    hj = HostJobs(
        {},
        frozenset(),
        {"ghost-1": -86400.0, "al-1": 3.0},
        cpus=4,
        claimed=(ghost, claims.Holder("al-1", "al@ws", 1.0, (0,))),
        queued=(
            queue.Waiting("x-1", "bob@vm", 1.0, TICKET, "all", -100000.0),
            queue.Waiting("y-2", "bob@vm", 1.0, "", "all", 1.0),
            queue.Waiting("w-3", "carol@ws", 1.0, "01795000000000000009-w-3", "all", 2.0),
        ),
    )
    assert [h.job for h in hj.holders()] == ["al-1"]
    views = job_views(PerHost(gpu1=hj))
    assert {j: v.queue for j, v in views.items() if v.queue} == {"w-3": {"gpu1": 1}}


# ------------------------------------------------------------------ run by sh


@pytest.fixture
def host(tmp_path):
    """A host for the scripts: its output_dir, a `docker` that lists no container, and a `date` that
    says NOW (the host's clock), so the ages the scripts measure are exact."""
    now = int(time.time())
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "docker").write_text("#!/bin/sh\nexit 0\n")
    (bin_dir / "date").write_text(f"#!/bin/sh\necho {now}\n")
    for tool in ("docker", "date"):
        (bin_dir / tool).chmod(0o755)
    inv = parse(f"job: {{output_dir: {tmp_path / 'out'}}}\n" + HOSTS, Path("i.yaml"))
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    name = subprocess.run(["hostname"], capture_output=True, text=True).stdout.strip()
    d = tmp_path / "out" / ".claims" / name
    (d / "queue").mkdir(parents=True)

    def run(script: str) -> subprocess.CompletedProcess:
        return subprocess.run(["sh", "-c", script], capture_output=True, text=True, env=env, timeout=30)

    return inv, run, d, now


def place(d: Path, job: str, dated: int, ticket: str = TICKET, who: str = "bob@vm") -> Path:
    f = d / "queue" / job
    f.write_text(f"who={who}\nsince=1795000000\nticket={ticket}\nwants=all\n")
    os.utime(f, (dated, dated))
    return f


def test_a_place_dated_ahead_is_dropped_by_the_next_plain_job_naming_the_file_and_its_owner(host):
    inv, run, d, now = host
    f = place(d, "x-1", now + 100000)
    r = run(claims.claim_script(inv, "gpt-1", (0,), "al@ws", True))
    assert r.returncode == 0, (r.stdout, r.stderr)
    assert not f.exists() and (d / "gpt-1").is_file()
    assert claims.claim_warnings(inv.hosts[0], r.stdout) == [
        f"gpu1: dropped {d}/queue/x-1 from the queue, the place of x-1 (queued by bob@vm at "
        f"{when(1795000000)}): future-dated by 100000 s on gpu1's clock (more than the 60 s allowed): fab "
        "train dates its places by the host's own clock, so something else wrote this date, and the place "
        "would have held up every later job until then"
    ]
    # A queued job's own scan drops it the same way (fab train --queue keeping its place).
    f = place(d, "x-1", now + 61)
    r = run(queue.enqueue_script(inv, "bob-1", queue.new_ticket("bob-1"), "bob@ws", ()))
    assert r.returncode == 0 and not f.exists()
    assert [(w.job, w.age) for w in queue.parse_queue_output(r.stdout)[1]] == [("x-1", -61.0)]


def test_a_place_not_renewed_is_dropped_saying_for_how_long(host):
    inv, run, d, now = host
    f = place(d, "x-1", now - STALE - 15, who="carol@ws")
    r = run(claims.claim_script(inv, "gpt-1", (0,), "al@ws", True))
    assert r.returncode == 0 and not f.exists()
    assert [w for w in claims.claim_warnings(inv.hosts[0], r.stdout)] == [
        f"gpu1: dropped {d}/queue/x-1 from the queue, the place of x-1 (queued by carol@ws at "
        f"{when(1795000000)}): not renewed for {STALE + 15} s (its fab train, or controller, renews it every "
        f"few seconds while it waits; a place is dropped after {hostfiles.LEASE_STALE:g} s)"
    ]


def test_a_fresh_place_still_makes_later_jobs_wait_within_the_clocks_slack_too(host):
    inv, run, d, now = host
    for dated in (now - 5, now + 60):  # renewed lately; dated ahead by no more than FUTURE_SLACK
        f = place(d, "x-1", dated)
        r = run(claims.claim_script(inv, "gpt-1", (0,), "al@ws", True))
        assert r.returncode == queue.QUEUED and f.exists() and not (d / "gpt-1").exists()
        assert [(w.job, w.who, w.age) for w in queue.parse_queue_output(r.stdout)[0]] == [
            ("x-1", "bob@vm", float(now - dated))
        ]
        assert claims.claim_warnings(inv.hosts[0], r.stdout) == []


def test_files_that_are_no_place_are_named_and_obeyed_not_at_all(host, tmp_path):
    inv, run, d, now = host
    secret = tmp_path / "secret"
    secret.write_text(f"who=PRIVATE\nticket={TICKET}\n")  # a place, were it read through the link
    q = d / "queue"
    (q / "l-1").symlink_to(secret)
    (q / "dir-1").mkdir()
    os.mkfifo(q / "fifo-1")  # read, it would hang the claim
    (q / "x\ny-1").write_text(f"ticket={TICKET}\n")  # a name that is no job id
    (q / "f-1").write_text("who=m\nticket=$(reboot)\n")  # no ticket of new_ticket's form
    (q / "g-1").write_text(f"ticket={TICKET}\nticket={TICKET}\n")
    (q / "h-1").write_text(f"who=m\\nahead x-9 age=0\nticket={TICKET}\n")  # a \\n, for dash's echo
    r = run(claims.claim_script(inv, "gpt-1", (0,), "al@ws", True))
    assert r.returncode == queue.QUEUED  # h-1 alone is a place: its odd text is only text
    assert "PRIVATE" not in r.stdout and [w.job for w in queue.parse_queue_output(r.stdout)[0]] == ["h-1"]
    (q / "h-1").unlink()
    r = run(claims.claim_script(inv, "gpt-1", (0,), "al@ws", True))
    assert r.returncode == 0, (r.stdout, r.stderr)
    assert "PRIVATE" not in r.stdout and (d / "gpt-1").is_file()
    assert sorted(p.name for p in q.iterdir()) == ["dir-1", "f-1", "fifo-1", "g-1", "l-1", "x\ny-1"]
    lines = [line for line in r.stdout.splitlines() if line.startswith("ignored ")]
    assert sorted(lines) == [
        "ignored queue/dir-1 special",
        "ignored queue/f-1 ticket",
        "ignored queue/fifo-1 special",
        "ignored queue/g-1 ticket",
        "ignored queue/l-1 link",
        "ignored queue/x?y-1 name",
    ]
    assert f"gpu1: ignored {d}/queue/l-1: a symbolic link (never followed)" in "\n".join(
        claims.claim_warnings(inv.hosts[0], r.stdout)
    )


def test_a_claim_whose_lease_is_dated_ahead_is_cleared_and_malformed_claims_hold_nothing(host, tmp_path):
    inv, run, d, now = host
    rt = tmp_path / "out" / ".runtime"
    # A claim of the whole host, by a job with no container and a lease dated a day ahead.
    (rt / "ghost-1").mkdir(parents=True)
    (rt / "ghost-1" / "lease").touch()
    os.utime(rt / "ghost-1" / "lease", (now + 86400, now + 86400))
    (d / "ghost-1").write_text("who=eve@vm\nsince=1795000000\nunits=\nport=29500\n")
    # Links and text that is no claim, each asking for every unit.
    secret = tmp_path / "secret"
    secret.write_text("who=PRIVATE\nsince=1\nunits=\n")
    (d / "l-1").symlink_to(secret)
    (d / "odd-1").write_text("who=m\nsince=1\n")
    (d / "odd-2").write_text("who=m\nunits=0,1\nunits=2\n")
    (d / "odd-3").write_text("who=m\nunits=all\n")
    r = run(claims.claim_script(inv, "gpt-1", (0, 1, 2, 3), "al@ws", True))
    assert r.returncode == 0, (r.stdout, r.stderr)
    assert not (d / "ghost-1").exists() and (d / "l-1").is_symlink() and "PRIVATE" not in r.stdout
    assert claims.claim_warnings(inv.hosts[0], r.stdout) == [
        f"gpu1: cleared {d}/ghost-1, the claim of ghost-1 (started by eve@vm at {when(1795000000)}, GPUs "
        "all): no container of that job runs there and its lease is future-dated by 86400 s on gpu1's "
        "clock (more than the 60 s allowed): fab train renews it with the host's own clock, so something "
        "else wrote this date",
        *(
            f"gpu1: ignored {d}/{name}: {why}, so it holds up no job (fabtrain writes no such file); "
            f"remove it unless someone of the group needs it: rm -- {d}/{name}"
            for name, why in (
                ("l-1", claimdir.IGNORED["link"]),
                ("odd-1", claimdir.IGNORED["units"]),
                ("odd-2", claimdir.IGNORED["units"]),
                ("odd-3", claimdir.IGNORED["units"]),
            )
        ),
    ]
    # A lease dated ahead by no more than FUTURE_SLACK (a file server's clock) still holds.
    assert run(claims.release_command(inv, ["gpt-1"])).returncode == 0
    (rt / "al-1").mkdir()
    (rt / "al-1" / "lease").touch()
    os.utime(rt / "al-1" / "lease", (now + 60, now + 60))
    (d / "al-1").write_text("who=al@ws\nsince=1795000000\nunits=0\nport=\n")
    r = run(claims.claim_script(inv, "bob-1", (0,), "bob@ws", True))
    assert r.returncode == claims.REFUSED
    assert [h.job for h in claims.parse_claim_output(r.stdout)[0]] == ["al-1"]
