"""fab status reads every job's last step in one command per host, not one per job in turn."""
import subprocess

from orchestrator.hosts import survey


def run_local(script: str) -> bytes:
    return subprocess.run(["sh", "-c", script], capture_output=True, check=True).stdout


def test_one_command_reads_every_jobs_last_step_on_a_host(tmp_path):
    a, b, missing = tmp_path / "a.log", tmp_path / "b.log", tmp_path / "gone.log"
    a.write_bytes(b"epoch 0 | step 10 | loss 2.5\nepoch 0 | step 11 | loss 2.4\n")
    b.write_bytes(b"step 3 | step 169.2 ms\nstep: 7")  # no newline at the end; a step time is not a step
    script = survey.last_steps_script({"job-a": str(a), "job-b": str(b), "job-c": str(missing)})
    assert survey.parse_last_steps(run_local(script)) == {"job-a": 11, "job-b": 7}


def test_paths_are_quoted_once(tmp_path):
    odd = tmp_path / "it's a file; rm -rf x.log"
    odd.write_bytes(b"step 5\n")
    assert survey.parse_last_steps(run_local(survey.last_steps_script({"j": str(odd)}))) == {"j": 5}


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
    from orchestrator.config.inventory import Host, Inventory, Job
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
    inv = Inventory(path=None, hosts=hosts, job=Job())
    views = {f"job-{k}": survey.JobView(f"job-{k}", ranks={f"node{1 + k % 2}": 0}) for k in range(10)}
    views["job-x"] = survey.JobView("job-x", ranks={"node1": 1})  # not rank 0 here: not read
    outputs = {
        h: "".join(f"\n{survey.STEP_MARK}job-{k}\nstep {k}\n" for k in range(10) if f"node{1 + k % 2}" == h)
        for h in ("node1", "node2")
    }
    session = FakeSession(outputs)
    assert survey.last_steps(session, inv, views) == {f"job-{k}": k for k in range(10)}
    assert sorted(name for name, _ in session.commands) == ["node1", "node2"]
