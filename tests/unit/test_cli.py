"""The command line: every task's help, as `fab` (the checkout's fabfile.py) and as `fabtrain` (the
installed program) render it, and where the inventory is looked for."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
from fabric.main import make_program as make_fab
from invoke.parser import ParserContext

import fabfile
from orchestrator.commandline import cli, program
from orchestrator.config import inventory
from orchestrator.core.errors import UserError
from orchestrator.hosts import survey as survey_mod

ROOT = Path(__file__).resolve().parents[2]
TASKS = sorted(fabfile.ns.task_names)


def flags(ctx: ParserContext) -> set[str]:
    """Every spelling a parser context accepts: long and short names (the parser keeps one of
    them as the flag, the others as aliases) and --no-X for options that default to true."""
    return set(ctx.flags) | set(ctx.flags.aliases) | set(ctx.inverse_flags)


def core_flags() -> set[str]:
    """Every flag Fabric's program takes before the task names, `fab`'s task-runner ones too
    (--collection, --search-root, ...): a task option must not take one of these names."""
    fab = make_fab()
    return flags(ParserContext(args=fab.core_args() + fab.task_args()))


def task_flags(name: str) -> set[str]:
    return flags(ParserContext(name=name, args=fabfile.ns[name].get_arguments()))


def rendered_help(run, capsys, binary: str, name: str) -> str:
    run([binary, "--help", name], exit=False)
    out = capsys.readouterr()
    assert not out.err, out.err
    return out.out


@pytest.fixture(autouse=True)
def keep_bytecode_setting(monkeypatch):
    """Program.run sets sys.dont_write_bytecode (its --write-pyc flag); put it back afterwards."""
    monkeypatch.setattr(sys, "dont_write_bytecode", sys.dont_write_bytecode)


@pytest.fixture(scope="module")
def core():
    flags = core_flags()
    # What the check relies on: Fabric's own flags are there.
    assert {"--hosts", "-H", "-i", "-S", "-d", "-e", "-p", "-c", "-r", "--list", "--help"} <= flags
    return flags


def test_every_task_is_listed_by_both_programs(monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    make_fab().run(["fab", "--list"], exit=False)
    fab_list = capsys.readouterr().out
    program.make_program().run(["fabtrain", "--list"], exit=False)
    fabtrain_list = capsys.readouterr().out
    # The same tasks; `fabtrain`, having them bundled, calls them subcommands.
    assert TASKS and fabtrain_list == fab_list.replace("Available tasks:", "Subcommands:", 1)
    for name in TASKS:
        assert re.search(rf"^  {re.escape(name)}\s", fab_list, re.M), name


@pytest.mark.parametrize("name", TASKS)
def test_task_help_reads_well_and_takes_no_core_flag(name, core, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)  # where `fab` finds fabfile.py
    fab_help = rendered_help(make_fab().run, capsys, "fab", name)
    fabtrain_help = rendered_help(program.make_program().run, capsys, "fabtrain", name)
    # The same task, the same help: only the program's name in the usage line differs.
    assert fab_help.startswith(f"Usage: fab [--core-opts] {name} ")
    assert fabtrain_help == fab_help.replace("Usage: fab ", "Usage: fabtrain ", 1)
    options = fab_help.partition("\nOptions:\n")[2]
    assert "--=" not in fab_help, fab_help
    mine = task_flags(name)
    # No automatic short flag (-d, -e, ... would shadow Fabric's): every option is spelt out.
    short = sorted(f for f in mine if not f.startswith("--"))
    assert not short, f"{name}: short flags {short}; give the task auto_shortflags=False"
    assert not re.search(r"^\s+-[A-Za-z][ ,]", options, re.M), options
    clash = sorted(mine & core)
    assert not clash, f"{name}: option(s) {clash} are also Fabric's core flags; rename them"
    for flag in sorted(f for f in mine if f.startswith("--") and not f.startswith("--no-")):
        assert flag in options or f"--[no-]{flag[2:]}" in options, f"{name}: {flag} missing from its help"


def test_fabtrain_version_names_fabric(capsys):
    program.make_program().run(["fabtrain", "--version"], exit=False)
    out = capsys.readouterr().out
    assert out.startswith(f"fabtrain {program.__version__} (Fabric ")


def test_loading_the_tasks_leaves_the_docker_library_to_the_local_clusters_tasks():
    """Every `fab` loads the task module: the Docker library (~0.1 s) is imported by the tasks that
    drive this machine's engine only, not by the ones that reach hosts over SSH."""
    code = "import sys, fabfile; print(sorted(m for m in sys.modules if m.startswith('docker.')))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


# ---------------------------------------------------------------- where the inventory is looked for


@pytest.fixture
def places(tmp_path, monkeypatch):
    """A working directory holding inventory.yaml, a file named by $FABTRAIN_INVENTORY, and one
    given explicitly; each test removes what it does not want."""
    work = tmp_path / "project"
    work.mkdir()
    (work / "inventory.yaml").write_text("hosts: []\n")
    env = tmp_path / "env.yaml"
    env.write_text("hosts: []\n")
    given = tmp_path / "given.yaml"
    given.write_text("hosts: []\n")
    monkeypatch.chdir(work)
    monkeypatch.setenv(inventory.INVENTORY_ENV, str(env))
    return work, env, given


def test_explicit_inventory_comes_first(places):
    work, env, given = places
    assert inventory.locate(str(given)) == given
    assert inventory.locate(given) == given


def test_explicit_inventory_is_taken_as_given_even_when_missing(places):
    # load() then says it is not found; locate never falls back to another file.
    work, env, given = places
    missing = work / "nope.yaml"
    assert inventory.locate(str(missing)) == missing


def test_environment_comes_before_the_working_directory(places):
    work, env, given = places
    assert inventory.locate() == env
    assert inventory.locate(None) == env


def test_home_is_expanded_in_explicit_and_environment_paths(places, monkeypatch):
    work, env, given = places
    monkeypatch.setenv("HOME", str(given.parent))
    assert inventory.locate("~/given.yaml") == given
    monkeypatch.setenv(inventory.INVENTORY_ENV, "~/env.yaml")
    assert inventory.locate() == env


def test_working_directory_inventory_when_nothing_else(places, monkeypatch):
    work, env, given = places
    monkeypatch.delenv(inventory.INVENTORY_ENV)
    assert inventory.locate().resolve() == (work / "inventory.yaml").resolve()
    monkeypatch.setenv(inventory.INVENTORY_ENV, "")  # set but empty: not set
    assert inventory.locate().resolve() == (work / "inventory.yaml").resolve()


def test_no_inventory_anywhere_names_all_three_places(places, monkeypatch):
    work, env, given = places
    monkeypatch.delenv(inventory.INVENTORY_ENV)
    (work / "inventory.yaml").unlink()
    (work / "inventory.yaml").mkdir()  # a directory of that name is no inventory
    with pytest.raises(UserError) as err:
        inventory.locate()
    message = str(err.value)
    assert "--inventory" in message and "$FABTRAIN_INVENTORY" in message and "inventory.yaml" in message
    assert str(Path.cwd()) in message


def test_the_inventory_directory_is_never_the_checkout(places, monkeypatch):
    # Run from a user's project, the checkout's own inventory.yaml is not picked up.
    work, env, given = places
    monkeypatch.delenv(inventory.INVENTORY_ENV)
    (work / "inventory.yaml").unlink()
    assert (ROOT / "inventory.yaml").is_file()
    with pytest.raises(UserError):
        inventory.locate()


@pytest.mark.parametrize(
    "flags, message",
    [
        (["-H", "node1,node2"], "-H/--hosts (node1) is Fabric's host list"),
        (["--hosts", "node1"], "-H/--hosts (node1) is Fabric's host list"),
        (["-i", "/tmp/key"], "-i/--identity is Fabric's key option"),
        (["-S", "SSH_CONFIG"], "-S/--ssh-config is Fabric's option"),
    ],
)
def test_fabric_core_flags_that_fabtrain_cannot_honour_stop_with_a_clear_error(flags, message, tmp_path):
    """Never ignored: `fab -H node1 train` once planned every host of the inventory."""
    ssh_config = tmp_path / "ssh_config"
    ssh_config.write_text("")
    flags = [str(ssh_config) if f == "SSH_CONFIG" else f for f in flags]
    r = subprocess.run(
        [str(Path(sys.executable).parent / "fab"), "-r", str(ROOT), *flags, "runs"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("name", TASKS)
def test_each_task_lists_a_whole_sentence(name):
    """`fab --list` shows a docstring's first line: it is the whole summary, never cut mid-sentence."""
    lines = fabfile.ns[name].__doc__.strip().splitlines()
    assert lines[0].endswith("."), f"{name}: {lines[0]!r} does not end a sentence"
    assert len(lines) == 1 or not lines[1].strip(), f"{name}: the summary runs on to a second line"


# Every numeric option of every task, as --help shows it.
NUMERIC = {
    "train": {
        "epochs": "INT",
        "restarts": "INT",
        "min-nodes": "INT",
        "hang-timeout": "NUMBER",
        "num-nodes": "INT",
        "gpus": "INT",
    },
    "stop": {"grace": "NUMBER"},
    "preflight": {"clock-warn": "NUMBER", "clock-fail": "NUMBER"},
    "cluster.up": {"nodes": "INT", "spares": "INT"},
    "export.slurm": {"epochs": "INT"},
    "export.k8s": {"epochs": "INT", "restarts": "INT"},
}


@pytest.mark.parametrize("name", sorted(NUMERIC))
def test_numeric_options_are_typed_in_help(name, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    text = rendered_help(make_fab().run, capsys, "fab", name)
    for option, kind in NUMERIC[name].items():
        assert re.search(rf"^  --{option}={kind}\s", text, re.M), f"{name} --{option} not shown as {kind}"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["train", "--epochs", "x"], "--epochs 'x': give a whole number"),
        (["train", "--hang-timeout", "soon"], "--hang-timeout 'soon': give a number"),
        (["cluster.up", "--nodes", "two"], "--nodes 'two': give a whole number"),
        (["stop", "--grace", "1s"], "--grace '1s': give a number"),
    ],
)
def test_a_bad_number_names_its_option_with_no_traceback(argv, message, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    with pytest.raises(SystemExit) as exc:
        make_fab().run(["fab", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err


@pytest.fixture
def contacts(monkeypatch):
    """Every host a command tries to reach (none is): Session.connection is where SSH starts."""
    from orchestrator.transport.remote import Session

    reached = []

    def refuse(session, host):
        reached.append(host.name)
        raise ConnectionRefusedError(f"{host.name} was reached")

    monkeypatch.setattr(Session, "connection", refuse)
    return reached


@pytest.fixture
def bogus(tmp_path):
    """An inventory of two hosts at documentation addresses (TEST-NET-1): nothing answers there."""
    path = tmp_path / "bogus.yaml"
    path.write_text(
        "ssh: {user: root, config: none}\nhosts:\n"
        + "".join(
            f"  - {{name: node{i}, address: 192.0.2.{10 + i}, interface: eth0, "
            "gpus: {vendor: none, count: 0}}\n"
            for i in (1, 2)
        )
    )
    return path


def refused(argv: list[str], capsys) -> tuple[int, str]:
    """`fabtrain ARGV` run here, in-process: its exit code and its stderr (no traceback in it)."""
    with pytest.raises(SystemExit) as exc:
        program.make_program().run(["fabtrain", *argv])
    out = capsys.readouterr()
    assert "Traceback" not in out.err, out.err
    return exc.value.code, out.err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["train", "--epochs", "0"], "error: --epochs 0: give a whole number, 1 or more"),
        (["train", "--epochs", "-2"], "error: --epochs -2: give a whole number, 1 or more"),
        (["train", "--min-nodes", "0"], "error: --min-nodes 0: give 1 to 2 (the hosts in INV)"),
        (["train", "--min-nodes", "3"], "error: --min-nodes 3: give 1 to 2 (the hosts in INV)"),
        # The hosts --include/--exclude leave, and --num-nodes's count, are known without asking them.
        (
            ["train", "--include", "node1", "--min-nodes", "2"],
            "error: --min-nodes 2: give 1 to 1 (the hosts of INV left by --include)",
        ),
        (
            ["train", "--exclude", "node2", "--min-nodes", "2"],
            "error: --min-nodes 2: give 1 to 1 (the hosts of INV left by --exclude)",
        ),
        (
            ["train", "--num-nodes", "1", "--min-nodes", "2"],
            "error: --min-nodes 2: give 1 to 1 (the hosts of INV left by --num-nodes)",
        ),
        (["train", "--num-nodes", "3"], "error: --num-nodes 3: give 1 to 2 (the hosts in INV)"),
        (
            ["train", "--exclude", "node1", "--num-nodes", "2"],
            "error: --num-nodes 2: give 1 to 1 (the hosts of INV left by --include/--exclude)",
        ),
        (
            ["train", "--num-nodes", "2", "--restarts", "-1"],
            "error: --restarts and --hang-timeout cannot be negative",
        ),
        (["train", "--model", "huge"], "error: --model 'huge': the GPT presets are tiny, small, medium"),
        (
            [
                "train",
                "--script",
                "tests/integration/scripts/progress.py",
                "--model",
                "small",
                "--epochs",
                "3",
            ],
            "error: --model small, --epochs 3: only the built-in trainers take them; "
            '--script runs your program: give its own options in --args "..."',
        ),
    ],
)
def test_bad_input_is_refused_before_any_host_is_touched(argv, message, bogus, contacts, monkeypatch, capsys):
    """Exit 2 and one line naming the option, its value and what is allowed; no host is reached
    (--num-nodes would ask every host which are free)."""
    monkeypatch.chdir(ROOT)
    with pytest.raises(SystemExit) as exc:
        make_fab().run(["fab", *argv, "--inventory", str(bogus)])
    err = capsys.readouterr().err
    assert exc.value.code == 2, err
    assert err == message.replace("INV", str(bogus)) + "\n"
    assert contacts == []


def test_the_gpt_presets_named_here_are_the_trainers():
    import ast

    tree = ast.parse((ROOT / "trainers" / "gpt.py").read_text())
    presets = next(
        n.value
        for n in tree.body
        if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "PRESETS"
    )
    assert tuple(k.value for k in presets.keys) == cli.GPT_PRESETS


@pytest.mark.parametrize("argv", [["stop"], ["stop", "--job", "j1"], ["logs"], ["metrics"], ["attach", "j1"]])
def test_a_job_is_optional_where_a_default_exists_and_positional_only_where_one_is_required(argv):
    # invoke's positional arguments are required: 'fab stop' with no job must still parse.
    from invoke.parser import Parser

    parsed = Parser(contexts=fabfile.ns.to_contexts()).parse_argv(argv)
    assert parsed[0].name == argv[0]
    assert parsed[0].args["job"].value == (argv[-1] if len(argv) > 1 else None)


@pytest.mark.parametrize("task", ["logs", "stop", "metrics"])
def test_an_optional_job_is_never_positional(task):
    assert fabfile.ns.tasks[task].positional == []


# ---------------------------------------------------------------- a job id that names no job

NOSUCH = "nosuch-20260101-000000-0000"
LISTS = "'fab runs' lists this machine's, 'fab status' the hosts'"


def hosts_hold(monkeypatch, jobs_there: dict[str, survey_mod.HostJobs] | None = None):
    """survey.survey answering for every host: nothing there, or what `jobs_there` says."""
    from orchestrator.transport.remote import PerHost

    def fake(session, inv, hosts=None):
        empty = survey_mod.HostJobs(running={}, containers=frozenset(), runtime={})
        return PerHost({h.name: (jobs_there or {}).get(h.name, empty) for h in hosts or inv.all_hosts})

    monkeypatch.setattr(survey_mod, "survey", fake)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["metrics", "--job", NOSUCH], f"error: no job {NOSUCH} in runs/; {LISTS}\n"),
        (["metrics", "--job", "../x"], f"error: no job ../x; {LISTS}\n"),
        (
            ["attach", NOSUCH],
            f"error: no job {NOSUCH} in runs/ (fab attach takes over a job started from this "
            f"directory; 'fab logs --job {NOSUCH}' follows one started elsewhere); {LISTS}\n",
        ),
        (["attach", "../x"], f"error: no job ../x; {LISTS}\n"),
        (["logs", "--job", "../x", "--inventory", "INV"], f"error: no job ../x; {LISTS}\n"),
        (["shell", "../x", "--inventory", "INV"], f"error: no job ../x; {LISTS}\n"),
        (["forward", "../x", "6006", "--inventory", "INV"], f"error: no job ../x; {LISTS}\n"),
    ],
)
def test_a_job_that_is_not_one_is_refused_before_any_host_is_touched(
    argv, message, bogus, contacts, tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)
    code, err = refused([str(bogus) if a == "INV" else a for a in argv], capsys)
    assert (code, err) == (2, message)
    assert contacts == [] and not (tmp_path / "runs").exists()


def test_logs_of_a_job_neither_the_hosts_nor_runs_know_is_refused(
    bogus, contacts, tmp_path, monkeypatch, capsys
):
    """Followed anyway, it would wait on every host for containers that never come."""
    from orchestrator.backends.ssh import detachedview

    monkeypatch.chdir(tmp_path)
    hosts_hold(monkeypatch)
    monkeypatch.setattr(detachedview, "found_places", lambda session, inv, job: [])
    code, err = refused(["logs", "--job", NOSUCH, "--inventory", str(bogus)], capsys)
    assert (code, err) == (2, f"error: no job {NOSUCH} on the hosts of {bogus} or in runs/; {LISTS}\n")


def test_logs_of_a_detached_job_another_machine_started_is_still_followed(
    bogus, contacts, tmp_path, monkeypatch, capsys
):
    # No runs/JOB here: its controller's directory on the hosts is what finds it.
    from orchestrator.backends.base import Finished
    from orchestrator.backends.ssh import detachedview
    from orchestrator.backends.ssh.placement import at
    from orchestrator.config import inventory as inventory_file

    monkeypatch.chdir(tmp_path)
    inv = inventory_file.load(str(bogus))
    places = [at(inv, NOSUCH, inv.hosts[0])]
    monkeypatch.setattr(detachedview, "found_places", lambda session, inv, job: places)
    followed = []

    def follow_unowned(inv, job, found, runs, console, live, json=False):
        followed.append((job, found))
        return Finished(job, None, None, f"job {job} ended")

    monkeypatch.setattr(detachedview, "follow_unowned", follow_unowned)
    program.make_program().run(["fabtrain", "logs", "--job", NOSUCH, "--inventory", str(bogus)])
    assert followed == [(NOSUCH, places)]
    assert capsys.readouterr().out == f"job {NOSUCH} ended\n"


def test_shell_into_a_job_neither_the_hosts_nor_runs_know_says_so(
    bogus, contacts, tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)
    hosts_hold(monkeypatch)
    code, err = refused(["shell", NOSUCH, "--inventory", str(bogus)], capsys)
    assert (code, err) == (
        2,
        f"error: job {NOSUCH} is not running on the hosts of {bogus}: no job {NOSUCH} "
        f"there or in runs/; {LISTS}\n",
    )
    # One this machine started, no longer running: that is what it is told.
    (tmp_path / "runs" / NOSUCH).mkdir(parents=True)
    (tmp_path / "runs" / NOSUCH / "job.json").write_text("{}")
    code, err = refused(["shell", NOSUCH, "--inventory", str(bogus)], capsys)
    assert (code, err) == (
        2,
        f"error: job {NOSUCH} is not running on the hosts of {bogus}; 'fab status' lists the jobs\n",
    )


def test_a_job_is_known_by_what_the_hosts_hold_or_runs_records(tmp_path):
    from orchestrator.backends.ssh import jobcontrol
    from orchestrator.transport.remote import PerHost

    empty = survey_mod.HostJobs(running={}, containers=frozenset(), runtime={})
    left = survey_mod.HostJobs(running={}, containers=frozenset({NOSUCH}), runtime={})
    controlled = survey_mod.HostJobs(
        running={}, containers=frozenset(), runtime={}, controllers={NOSUCH: "exited"}
    )
    assert not jobcontrol.known_to(PerHost(node1=empty, node2=empty), NOSUCH, tmp_path)
    assert jobcontrol.known_to(PerHost(node1=empty, node2=left), NOSUCH, tmp_path)  # a container left over
    assert jobcontrol.known_to(PerHost(node1=controlled), NOSUCH, tmp_path)  # a detached job's controller
    # node2 may hold it
    assert jobcontrol.known_to(PerHost(node1=empty, node2=TimeoutError()), NOSUCH, tmp_path)
    assert not jobcontrol.known_to(PerHost(node1=empty), "../x", tmp_path)
    (tmp_path / NOSUCH).mkdir()
    (tmp_path / NOSUCH / "job.json").write_text("{}")
    assert jobcontrol.known_to(PerHost(node1=empty), NOSUCH, tmp_path)


# ---------------------------------------------------------------- a mistyped task or option


@pytest.mark.parametrize(
    "argv, message",
    [
        (["trian"], "No idea what 'trian' is! Did you mean 'train'?"),
        (["--help", "trian"], "No idea what 'trian' is! Did you mean 'train'?"),
        (["train", "--epoch", "3"], "No idea what '--epoch' is! Did you mean '--epochs'?"),
        (["train", "--epoch=3"], "No idea what '--epoch' is! Did you mean '--epochs'?"),
        (["preflight", "--no-smok"], "No idea what '--no-smok' is! Did you mean '--no-smoke'?"),
        (["train", "stauts"], "No idea what 'stauts' is! Did you mean 'status'?"),
        (["cluster.upp"], "No idea what 'cluster.upp' is! Did you mean 'cluster.up'?"),
        (["--lsit"], "No idea what '--lsit' is! Did you mean '--list'?"),
        # A task that takes no job (a bare job where one is taken: tests/unit/test_usage.py).
        (["preflight", NOSUCH], f"No idea what '{NOSUCH}' is!"),
        (["zzzz"], "No idea what 'zzzz' is!"),
        (["shell"], "'shell' did not receive required positional arguments: 'job'"),
        (["stop", "--job"], "Flag <Option: job> needed value and was not given one!"),
    ],
)
@pytest.mark.parametrize("binary", ["fab", "fabtrain"])
def test_a_mistyped_command_line_gets_the_nearest_spelling_and_exits_2(
    binary, argv, message, contacts, monkeypatch, capsys
):
    monkeypatch.chdir(ROOT)  # where `fab` finds fabfile.py
    run = make_fab().run if binary == "fab" else program.make_program().run
    with pytest.raises(SystemExit) as exc:
        run([binary, *argv])
    out = capsys.readouterr()
    assert (exc.value.code, out.err) == (2, message + "\n")
    assert contacts == []


def test_the_usage_refusal_is_a_parse_error_to_invoke_and_an_exit_to_its_program():
    # Invoke's completion catches ParseError; Program.run exits with an Exit's code.
    from invoke import Exit, ParseError

    from orchestrator.commandline import usage

    e = usage.UsageError("No idea what 'x' is!")
    assert isinstance(e, ParseError) and isinstance(e, Exit)
    assert (str(e), e.code, e.message) == ("No idea what 'x' is!", 2, None)


# ---------------------------------------------------------------- exit codes


def test_fabtrain_help_ends_with_the_exit_codes(capsys):
    program.make_program().run(["fabtrain", "--help"], exit=False)
    text = capsys.readouterr().out
    table = text.partition("\nExit codes:\n\n")[2]
    assert table, text
    # Each code's line, and its meaning wrapped to the terminal under it.
    assert table.split() == " ".join(f"{code} {meaning}" for code, meaning in program.EXIT_CODES).split()


def test_the_documented_exit_codes_are_the_programs():
    """docs/how-train-works.md's table holds every code fabtrain --help lists, and only those."""
    text = (ROOT / "docs" / "how-train-works.md").read_text()
    section = text.partition("\n## Exit codes\n")[2].split("\n## ")[0]
    documented = re.findall(r"^\| (\S+) \|", section, re.M)
    assert documented[1:] == [code for code, _ in program.EXIT_CODES]  # [0]: the header row


def test_every_exit_code_in_use_is_documented():
    """The codes UserError and Exit are raised with, read from the source, are in the table."""
    codes = set()
    for path in [ROOT / "fabfile.py", *(ROOT / "orchestrator").rglob("*.py")]:
        codes.update(int(c) for c in re.findall(r"\b(?:exit_code|code)=(\d+)", path.read_text()))
    listed = {int(code) for code, _ in program.EXIT_CODES if code.isdigit()}
    signals = {c for c in codes if c >= 128}  # 128 + N, a job ended by signal N
    assert codes - signals <= listed, codes
    assert signals <= {128, 130, 143}, signals


def test_stop_json_says_what_was_stopped_where_and_what_failed():
    from orchestrator.backends.base import Stopped

    out = Stopped(
        lines=["node1: removed 2 container(s)", "stopped j-1 (ann@m)"],
        problems=["node2: could not"],
        failed=["node2"],
        jobs=["j-1"],
        removed={"node1": 2},
        left_alone=["j-2"],
    )
    assert out.doc() == {
        "stopped": ["j-1"],
        "containers_removed": {"node1": 2},
        "left_alone": ["j-2"],
        "failed_hosts": ["node2"],
        "problems": ["node2: could not"],
        "lines": ["node1: removed 2 container(s)", "stopped j-1 (ann@m)"],
    }
