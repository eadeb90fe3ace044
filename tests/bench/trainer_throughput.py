"""Tokens per second of each GPT preset on this machine (one process; the CPU setting on a CPU).

.venv/bin/python tests/bench/trainer_throughput.py
"""

import contextlib
import io
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "trainers"))
import gpt  # noqa: E402


def main() -> None:
    print("| preset | params (this device) | tokens/s (median of logged intervals) |")
    print("|---|---|---|")
    for preset in ("tiny", "small", "medium"):
        out = Path(tempfile.mkdtemp())
        with contextlib.redirect_stdout(io.StringIO()) as text:
            gpt.main(
                [
                    "--model",
                    preset,
                    "--epochs",
                    "1",
                    "--max-steps-per-epoch",
                    "30",
                    "--log-every",
                    "5",
                    "--sample-chars",
                    "0",
                    "--snapshot-every",
                    "0",
                    "--out",
                    str(out),
                ]
            )
        rates = [
            json.loads(x)["tokens_per_s"]
            for x in (out / "metrics.jsonl").read_text().splitlines()
            if '"train"' in x
        ]
        params = next(
            line.split(": ")[1].split(" params")[0]
            for line in text.getvalue().splitlines()
            if "params" in line
        )
        print(f"| {preset} | {params} | {statistics.median(rates):,.0f} |")


if __name__ == "__main__":
    main()
