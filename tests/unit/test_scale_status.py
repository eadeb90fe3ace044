"""fab status reads every job's last step in one command per host, not one per job in turn."""

import subprocess

from orchestrator.hosts import survey


def run_local(script: str) -> bytes:
    return subprocess.run(["sh", "-c", script], capture_output=True, check=True).stdout


def test_one_command_reads_every_jobs_last_step_on_a_host(tmp_path):
    a, b, missing = tmp_path / "a.log", tmp_path / "b.log", tmp_path / "gone.log"
    a.write_bytes(b"epoch 0 | step 10 | loss 2.5\nepoch 0 | step 11 | loss 2.4\n")
    b.write_bytes(b"step 3 | step 169.2 ms\nstep: 7")  # no newline at the end; a step time is not a step
    script = survey.last_steps_script(
        {
            "job-a": (str(tmp_path), a.name),
            "job-b": (str(tmp_path), b.name),
            "job-c": (str(tmp_path), missing.name),
        }
    )
    assert survey.parse_last_steps(run_local(script)) == {"job-a": 11, "job-b": 7}


def test_paths_are_quoted_once(tmp_path):
    odd = tmp_path / "it's a dir; rm -rf x"
    odd.mkdir()
    (odd / "node-0.log").write_bytes(b"step 5\n")
    script = survey.last_steps_script({"j": (str(odd), "node-0.log")})
    assert survey.parse_last_steps(run_local(script)) == {"j": 5}


def test_a_console_linked_to_a_host_file_is_not_read(tmp_path):
    (tmp_path / "secret").write_bytes(b"step 99\n")
    (tmp_path / "job").mkdir()
    (tmp_path / "job" / "node-0.log").symlink_to(tmp_path / "secret")
    assert (
        survey.parse_last_steps(
            run_local(survey.last_steps_script({"j": (str(tmp_path / "job"), "node-0.log")}))
        )
        == {}
    )


class FakeSession:
    """Records the commands: one per host that holds a rank 0."""

    def __init__(self, outputs):
        self.outputs, self.commands = outputs, []

    def run(self, host, command, timeout, what=""):
        from orchestrator.transport.remote import Result

        self.commands.append((host.name, command))
        return Result(self.outputs[host.name], "", 0, 0.0)

    def fan_out(self, fn, hosts):
        from orchestrator.transport.remote import PerHost

        return PerHost({h.name: fn(h) for h in hosts})


def test_many_jobs_on_few_hosts_cost_one_command_per_host():
    from orchestrator.config.inventory import Host, Inventory
    from orchestrator.config.jobdefaults import JobDefaults
    from orchestrator.config.sshconf import SSH

    hosts = tuple(
        Host(
            name=f"node{i}",
            address=f"10.0.0.{i}",
            rank=i - 1,
            ssh=SSH(hostname=f"10.0.0.{i}", user="root"),
            interface="eth0",
        )
        for i in (1, 2)
    )
    inv = Inventory(path=None, hosts=hosts, job=JobDefaults())
    views = {f"job-{k}": survey.JobView(f"job-{k}", ranks={f"node{1 + k % 2}": 0}) for k in range(10)}
    views["job-x"] = survey.JobView("job-x", ranks={"node1": 1})  # not rank 0 here: not read
    outputs = {
        h: "".join(f"\n{survey.STEP_MARK}job-{k}\nstep {k}\n" for k in range(10) if f"node{1 + k % 2}" == h)
        for h in ("node1", "node2")
    }
    session = FakeSession(outputs)
    assert survey.last_steps(session, inv, views) == {f"job-{k}": k for k in range(10)}
    assert sorted(name for name, _ in session.commands) == ["node1", "node2"]
