"""fab metrics: a job's newest figures from runs/JOB's event and telemetry files, read from their
tails only, whatever those files hold."""

import json

from orchestrator.progress import latest


def write(path, recs):
    with path.open("a") as fh:
        for r in recs:
            fh.write((r if isinstance(r, str) else json.dumps(r)) + "\n")


def rank(r, step, loss=2.0):
    return {
        "rank": r,
        "step": step,
        "loss": loss,
        "tokens_per_s": 1234.0,
        "step_ms": 20.0,
        "compute_ms": 15.0,
    }


def test_newest_step_per_rank_of_the_newest_attempt_and_newest_sample_per_host(tmp_path):
    run = tmp_path / "gpt-1"
    run.mkdir()
    write(
        run / "events.jsonl",
        [
            {"event": "attempt", "time": 1, "attempt": 1},
            {"event": "progress", "time": 2, "host": "node2", "step": 5, "ranks": [rank(2, 5), rank(3, 5)]},
            {"event": "attempt", "time": 3, "attempt": 2},
            {"event": "progress", "time": 4, "host": "node1", "step": 7, "ranks": [rank(0, 7), rank(1, 7)]},
            "not json {",
            {"event": "progress", "time": 5, "host": "node1", "step": 9, "ranks": [rank(0, 9), "junk"]},
        ],
    )
    write(
        run / "telemetry.jsonl",
        [
            {
                "event": "telemetry",
                "time": 4,
                "host": "node1",
                "sample": {"containers": [], "host": {"load1": 1.0}},
            },
            {
                "event": "telemetry",
                "time": 6,
                "host": "node1",
                "sample": {
                    "gpus": [{"index": 0, "util": 0.5}],
                    "containers": [{"name": "fabtrain-gpt-1-r0", "cpu": 1.5, "mem": 2**30}],
                    "host": {"load1": 2.0},
                },
            },
        ],
    )
    doc = latest.latest(run)
    assert doc["attempt"] == 2 and doc["state"] == "running" and doc["updated"] == 5
    assert [(r["host"], r["rank"], r["step"]) for r in doc["ranks"]] == [("node1", 0, 9), ("node1", 1, 7)]
    assert doc["hosts"]["node1"]["host"]["load1"] == 2.0
    text = "\n".join(latest.lines(doc))
    assert "node1 rank 0: step 9 | loss 2.0000 | 1,234 tok/s | step 20.0 ms | compute 15.0 ms" in text
    assert "node1: GPU 0 50%; fabtrain-gpt-1-r0 1.5 cores 1.00 GiB; load 2.00" in text
    write(run / "events.jsonl", [{"event": "finished", "time": 9, "state": "finished"}])
    assert latest.latest(run)["state"] == "finished"


def test_only_the_tail_is_read(tmp_path):
    path = tmp_path / "events.jsonl"
    record = json.dumps({"event": "attempt", "attempt": 3}).encode()
    path.write_bytes(b"x" * (latest.TAIL + 100) + b"\n" + record + b"\n")
    assert latest.tail_records(path) == [{"event": "attempt", "attempt": 3}]
    assert latest.tail_records(tmp_path / "none.jsonl") == []
