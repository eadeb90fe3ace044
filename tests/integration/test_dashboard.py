"""fab dashboard in a real browser (Debian's chromium, driven by selenium through chromedriver, both
started here): while alice's 2-host job runs and bob's waits in the queue behind it, the page shows
both jobs, the owner of every host's slots, a loss curve that grows between two looks, and each
host's log tail, in which a line carrying ESC bytes, a <script> element and an <img onerror> is text
and runs nothing. A screenshot of each page is kept (pytest's tmp dir; with FABTRAIN_README_SHOTS=1
also tests/readme/, for the README)."""

import json
import os
import secrets
import shutil
import socket
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from .conftest import ROOT, Run, fab

SCRIPT = "tests/integration/scripts/dashboard_job.py"
COMMON = ("train", "--script", SCRIPT, "--skip-preflight", "--plain")
CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def browser(profile: Path):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    # Without the background-networking flags chromium keeps trying to reach the internet.
    for flag in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-default-apps",
        "--disable-extensions",
        "--window-size=1400,1100",
        f"--user-data-dir={profile}",
    ):
        options.add_argument(flag)
    return webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)


def until(what, check, timeout=90.0):
    """check()'s first truthy value within `timeout` seconds (AssertionError naming `what` else)."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            got = check()
        except Exception as exc:  # noqa: BLE001 - the page may be between two renders; try again
            got, last = None, exc
        if got:
            return got
        time.sleep(0.5)
    raise AssertionError(f"{what} never came (last error: {last!r})")


def get(url: str):
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.status, dict(r.headers), r.read()


def job_of(name: str) -> str:
    return until(
        f"runs/{name}-*", lambda: max((p.name for p in (ROOT / "runs").glob(f"{name}-*")), default=None)
    )


def test_dashboard_in_a_browser_shows_jobs_queue_slots_curves_and_logs_as_text(inventory_path, tmp_path):
    if not (Path(CHROMIUM).exists() and Path(CHROMEDRIVER).exists()):
        if os.environ.get("CI"):
            pytest.fail("no chromium/chromedriver: CI must run bash docker/bootstrap.sh --tests first")
        pytest.skip(
            "Debian's chromium and chromium-driver are not installed (docker/bootstrap.sh "
            "--tests installs them)"
        )
    tag = secrets.token_hex(2)
    port = free_port()
    url = f"http://127.0.0.1:{port}/"
    dash = Run(inventory_path, "dashboard", "--port", str(port), "--refresh", "2")
    alice = bob = driver = None
    jobs: list[str] = []
    try:
        dash.wait_for(f"dashboard: {url}", timeout=60)
        alice = Run(
            inventory_path,
            *COMMON,
            "--args",
            "--steps 600 --step-time 0.5",
            "--name",
            f"dash-{tag}",
            env={"FABTRAIN_USER": "alice"},
        )
        alice.wait_for("attempt 1: starting 2 node(s)")
        job_a = job_of(f"dash-{tag}")
        jobs.append(job_a)
        bob = Run(
            inventory_path,
            *COMMON,
            "--args",
            "--steps 5 --step-time 0.1",
            "--name",
            f"dashq-{tag}",
            "--queue",
            env={"FABTRAIN_USER": "bob"},
        )
        bob.wait_for("queued: position 1 (")
        job_b = job_of(f"dashq-{tag}")
        jobs.append(job_b)

        # The server: read-only, strict headers, job ids checked.
        status, headers, _ = get(url)
        assert status == 200 and "default-src 'self'" in headers["Content-Security-Policy"]
        assert headers["X-Content-Type-Options"] == "nosniff"
        req = urllib.request.Request(url + "api/overview", method="POST", data=b"")
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(req, timeout=10)
        assert refused.value.code == 405
        with pytest.raises(urllib.error.HTTPError) as missing:
            urllib.request.urlopen(url + "api/job/..%2F..%2Fetc", timeout=10)
        assert missing.value.code == 404

        driver = browser(tmp_path / "chromium")
        driver.get(url)
        title = driver.title
        from selenium.webdriver.common.by import By

        def rows():
            return {
                r.get_attribute("data-job"): r.get_attribute("data-state")
                for r in driver.find_elements(By.CSS_SELECTOR, "#jobs tbody tr[data-job]")
            }

        until("both jobs on the page", lambda: job_a in rows() and job_b in rows())
        shown = rows()
        assert shown[job_a] == "running" and shown[job_b].startswith("queued"), shown
        queue = [
            r.get_attribute("data-job") for r in driver.find_elements(By.CSS_SELECTOR, "#queue tbody tr")
        ]
        assert queue == [job_b], queue
        assert "bob@" in driver.find_element(By.CSS_SELECTOR, "#queue tbody tr").text

        def owners():
            out = {}
            for card in driver.find_elements(By.CSS_SELECTOR, "#hosts .host"):
                out[card.get_attribute("data-host")] = [
                    (s.get_attribute("data-job"), s.get_attribute("data-who").partition("@")[0])
                    for s in card.find_elements(By.CSS_SELECTOR, ".slot")
                ]
            return out

        held = until(
            "every slot of both hosts held by alice's job",
            lambda: (
                (o := owners())
                and all(o.get(h) and all(s == (job_a, "alice") for s in o[h]) for h in ("node1", "node2"))
                and o
            ),
        )
        assert sorted(held) == ["node1", "node2"], held
        row_a = driver.find_element(By.CSS_SELECTOR, f'#jobs tbody tr[data-job="{job_a}"]').text
        assert "alice@" in row_a and "node1" in row_a and "node2" in row_a, row_a
        driver.save_screenshot(str(tmp_path / "dashboard.png"))

        # alice's job page: the loss curve grows between two looks, the log tails are there.
        driver.find_element(By.LINK_TEXT, job_a).click()

        def points():
            return int(driver.find_element(By.ID, "loss-chart").get_attribute("data-points") or 0)

        first = until("a loss curve of two points", lambda: (n := points()) >= 2 and n)
        later = until("the curve growing", lambda: (n := points()) > first and n, timeout=60)
        assert later > first >= 2
        assert int(driver.find_element(By.ID, "rate-chart").get_attribute("data-points")) >= 2
        assert driver.find_elements(By.CSS_SELECTOR, "#loss-chart polyline")

        def log_of(host):
            return driver.find_element(By.CSS_SELECTOR, f'#logs .log[data-host="{host}"] pre').text

        until("both hosts' log tails", lambda: "step" in log_of("node1") and "step" in log_of("node2"))
        hostile = log_of("node1")
        assert "<script>window.__pwned = 1; document.title = 'pwned'</script>" in hostile, hostile[-2000:]
        assert '<img src=x onerror="window.__pwned = 2">' in hostile
        assert "\x1b" not in hostile and "[31m" in hostile
        assert driver.execute_script("return window.__pwned === undefined") is True
        assert driver.title == title == "fabtrain dashboard"
        assert not driver.find_elements(By.CSS_SELECTOR, "#logs script, #logs img")
        assert "alice@" in driver.find_element(By.ID, "job-summary").text
        until(
            "attempt 1 listed", lambda: driver.find_element(By.CSS_SELECTOR, "#attempts tbody td").text == "1"
        )
        until(
            "the plan",
            lambda: "docker run" in driver.find_element(By.ID, "plan").get_attribute("textContent"),
        )
        driver.save_screenshot(str(tmp_path / "dashboard-job.png"))
        if os.environ.get("FABTRAIN_README_SHOTS") == "1":
            (ROOT / "tests" / "readme").mkdir(exist_ok=True)
            shutil.copyfile(tmp_path / "dashboard.png", ROOT / "tests" / "readme" / "dashboard.png")
            shutil.copyfile(tmp_path / "dashboard-job.png", ROOT / "tests" / "readme" / "dashboard-job.png")

        # The JSON the page read: the SSH cost is the refresher's alone (one command per host per look).
        _, _, body = get(url + "api/overview")
        cost = json.loads(body)["cost"]
        assert cost["refreshes"] >= 2 and cost["ssh_commands"] <= 2 * cost["refreshes"] + 2, cost
    finally:
        if driver is not None:
            driver.quit()
        for job in reversed(jobs):
            fab(inventory_path, "stop", "--job", job, "--grace", "0", timeout=120)
        for run in (bob, alice, dash):
            if run is not None and run.proc.poll() is None:
                run.proc.kill()
                run.proc.wait(30)


def test_dashboard_on_every_address_asks_for_its_token_and_answers_only_its_names(tmp_path):
    """fab dashboard --address 0.0.0.0 through the real command line: the URL it prints carries a token,
    a request without it (or with another) is refused, the URL's token is traded for a cookie that then
    opens the page and its JSON, and a Host that is not this machine's is refused. No cluster: the
    inventory's one host is a closed port on 127.0.0.1, and every request goes to 127.0.0.1."""
    import http.cookiejar
    import re

    for name in ("id", "known_hosts"):
        (tmp_path / name).write_text("")
    inv = tmp_path / "inventory.yaml"
    inv.write_text(f"""\
ssh: {{user: u, key: {tmp_path}/id, known_hosts: {tmp_path}/known_hosts, connect_timeout: 2}}
job: {{image: img:1, code_dir: /opt/code, output_dir: /opt/out}}
hosts:
  - {{name: nowhere, address: 127.0.0.1, interface: lo, ssh: {{port: {free_port()}}}}}
""")
    missing = fab(
        inv, "dashboard", "--address", "0.0.0.0", "--token-file", str(tmp_path / "none"), timeout=60
    )
    assert missing.returncode == 2 and "Traceback" not in missing.stderr, missing.stderr
    assert missing.stderr.startswith(f"error: --token-file {tmp_path}/none: no such file;"), missing.stderr

    port = free_port()
    dash = Run(
        inv,
        "dashboard",
        "--address",
        "0.0.0.0",
        "--port",
        str(port),
        "--refresh",
        "30",
        "--allow-host",
        "dash.example",
    )
    try:
        dash.wait_for("Ctrl+C ends it", timeout=60)
        printed = re.search(r"dashboard: http://\S+:(\d+)/\?token=([A-Za-z0-9_-]{43,})\n", dash.text)
        assert printed and int(printed[1]) == port, dash.text
        token = printed[2]
        assert (
            f"listening on 0.0.0.0:{port} (every address of this machine); a token is asked for" in dash.text
        ), dash.text
        assert "dash.example" in dash.text and dash.text.count(token) == 1
        url = f"http://127.0.0.1:{port}/"

        def refused(request, code):
            with pytest.raises(urllib.error.HTTPError) as got:
                urllib.request.urlopen(request, timeout=10)
            assert got.value.code == code, got.value.read()
            return got.value.read().decode()

        assert "?token=" in refused(url, 401) and "cookie" in refused(url + "api/overview", 401)
        refused(url + "?token=WRONG", 401)
        refused(
            urllib.request.Request(url + f"?token={token}", headers={"Host": f"rebind.example:{port}"}), 421
        )

        jar = http.cookiejar.CookieJar()
        client = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(jar))
        with client.open(url + f"?token={token}", timeout=10) as r:
            assert r.status == 200 and r.url == url and r.read().startswith(b"<!DOCTYPE html>")
        (cookie,) = jar
        assert (cookie.name, cookie.value, cookie.path) == (f"fabtrain_dashboard_{port}", token, "/")
        assert cookie.has_nonstandard_attr("HttpOnly") and cookie.get_nonstandard_attr("SameSite") == "Strict"
        with client.open(url + "api/overview", timeout=10) as r:
            assert r.status == 200 and "hosts" in json.loads(r.read())
        with client.open(
            urllib.request.Request(url + "api/runs", headers={"Host": f"dash.example:{port}"}), timeout=10
        ) as r:
            assert r.status == 200
        refused(urllib.request.Request(url + "api/runs", headers={"Host": f"evil.example:{port}"}), 421)

        # A real browser: the page opened once by the printed URL loses the token from its address and
        # draws the overview (its own fetches carry the SameSite=Strict cookie); a second profile,
        # without the token, reads how to get in.
        if Path(CHROMIUM).exists() and Path(CHROMEDRIVER).exists():
            from selenium.webdriver.common.by import By

            driver = browser(tmp_path / "chromium")
            try:
                driver.get(url + f"?token={token}")
                assert driver.current_url == url
                until(
                    "the overview, with why the host did not answer",
                    lambda: "nowhere" in driver.find_element(By.ID, "errors").text,
                    timeout=30,
                )
                assert token not in driver.page_source
            finally:
                driver.quit()
            driver = browser(tmp_path / "chromium-2")
            try:
                driver.get(url)
                assert "asks for its token" in driver.find_element(By.TAG_NAME, "body").text
            finally:
                driver.quit()
        assert dash.proc.poll() is None, dash.text
    finally:
        dash.proc.kill()
        dash.proc.wait(30)
