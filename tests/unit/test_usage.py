"""A job id given bare where the job is an option (`fab stop JOB`, `fab logs JOB`, `fab metrics JOB`)
is parsed as `--job JOB`, by Fabric's program and by fabtrain's; anything else bare is still refused
with the nearest spelling (tests/unit/test_cli.py)."""

from pathlib import Path

import pytest
from fabric.main import make_program as make_fab

from orchestrator.commandline import program

ROOT = Path(__file__).resolve().parents[2]
JOB = "gpt-20260101-120000-ab12"


def parsed(binary: str, argv: list[str]) -> list:
    """The task contexts the program's own parsing steps give for `BINARY ARGV`."""
    p = make_fab() if binary == "fab" else program.make_program()
    p.create_config()
    p.parse_core([binary, *argv])
    p.parse_collection()
    p.parse_tasks()
    return p.tasks


@pytest.mark.parametrize("binary", ["fab", "fabtrain"])
@pytest.mark.parametrize(
    "argv, job",
    [
        (["stop", JOB], JOB),
        (["logs", JOB], JOB),
        (["metrics", JOB], JOB),
        (["stop", "--grace", "5", JOB], JOB),
        (["stop", JOB, "--grace", "5"], JOB),
        (["stop", "--job", JOB], JOB),
        (["stop"], None),
    ],
)
def test_a_job_given_bare_is_the_tasks_job(binary, argv, job, monkeypatch):
    monkeypatch.chdir(ROOT)  # where `fab` finds fabfile.py
    (task,) = parsed(binary, argv)
    assert (task.name, task.args["job"].value) == (argv[0], job)


def test_each_task_on_the_line_takes_its_own_bare_job(monkeypatch):
    monkeypatch.chdir(ROOT)
    tasks = parsed("fab", ["logs", JOB, "stop", JOB.replace("ab12", "cd34")])
    assert [(t.name, t.args["job"].value) for t in tasks] == [
        ("logs", JOB),
        ("stop", JOB.replace("ab12", "cd34")),
    ]


@pytest.mark.parametrize(
    "argv, message",
    [
        # A second job is not taken for the first: refused, with the suggestion.
        (
            ["stop", "--job", JOB, "gpt-20260101-120000-cd34"],
            "No idea what 'gpt-20260101-120000-cd34' is! Did you mean '--job gpt-20260101-120000-cd34'?",
        ),
        # A word that is no job id is refused as before.
        (["stop", "trian"], "No idea what 'trian' is! Did you mean 'train'?"),
        # A task without --job takes no job.
        (["preflight", JOB], f"No idea what '{JOB}' is!"),
    ],
)
def test_what_is_not_a_tasks_one_bare_job_is_still_refused(argv, message, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    with pytest.raises(SystemExit) as exc:
        make_fab().run(["fab", *argv])
    assert (exc.value.code, capsys.readouterr().err) == (2, message + "\n")
