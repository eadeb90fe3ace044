"""Finding jobs on a host (survey.py): the survey script run by sh on this machine (docker stubbed), parsed;
and stopping them: `fab stop`'s one command per host, controller keys included."""

import os
import subprocess
import time
from pathlib import Path

from orchestrator.config.inventory import parse
from orchestrator.hostcmds import hostfiles
from orchestrator.hosts import survey
from orchestrator.transport.remote import PerHost


def test_survey_finds_containers_and_runtime_leases_and_only_stale_ones_are_left_over(tmp_path):
    inv = parse(
        f"job: {{output_dir: {tmp_path}/out}}\nhosts:\n  - {{address: h, interface: eth0}}\n", Path("i.yaml")
    )
    rt = tmp_path / "out" / ".runtime"
    for job, age in (("live-1", 5), ("lost-1", 30), ("old-1", 3600), ("running-1", 3600)):
        (rt / job).mkdir(parents=True)
        (rt / job / hostfiles.LEASE).touch()
        os.utime(rt / job / hostfiles.LEASE, (time.time() - age, time.time() - age))
    (rt / "nolease-1").mkdir()
    (rt / hostfiles.IMAGE_CACHE).mkdir()  # the preflight's image cache: never a job, never removed
    (tmp_path / "docker").write_text(
        "#!/bin/sh\nprintf 'running-1\\t0\\tfabtrain-running-1-r0\\trunning\\tUp 1h\\n'\n"
    )
    (tmp_path / "docker").chmod(0o755)
    r = subprocess.run(
        ["sh", "-c", survey.survey_script(inv)],
        capture_output=True,
        text=True,
        env={"PATH": f"{tmp_path}:/usr/bin:/bin"},
    )
    found = survey.parse_survey(r.stdout)
    assert found.running == {"running-1": 0}
    assert (
        found.runtime["live-1"] < hostfiles.LEASE_LIVE <= found.runtime["lost-1"] < hostfiles.LEASE_STALE
        and found.runtime["old-1"] >= 3600
        and found.runtime["nolease-1"] is None
    )
    per = PerHost(h=found)
    assert survey.live_jobs(per) == {"running-1": ["h"], "live-1": ["h"]}
    assert survey.stale_runtime(per) == {"h": ["nolease-1", "old-1"]}
