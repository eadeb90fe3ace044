"""Benchmark: what one host line with no newline costs fab, by its size, before and after the cut.

    .venv/bin/python tests/bench/long_lines.py --mb 4,16,64,256 --repeat 3

A rank printing a huge line with no newline used to be held whole in memory by its host's sink
(logs.HostSink kept the unfinished line, `partial + data` at every chunk: memory growing with
the line, CPU with its square). Now hostile.LineCutter keeps at most LINE_MAX (64 KiB) of a line.
Both are fed the same 64 KiB chunks here, side by side, into a real HostSink writing its log file
(the old one as it was, inlined), CPU seconds of this process and tracemalloc's peak, median of
--repeat. No network; the old way is skipped above --old-max-mb (it grows quadratically).
"""

from __future__ import annotations

import argparse
import io
import statistics
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from orchestrator.core import hostile  # noqa: E402
from orchestrator.transport.logs import Multiplexer  # noqa: E402

CHUNK = 1 << 16


class OldSink:
    """HostSink's line handling before the cut (its file write and the terminal write kept)."""

    def __init__(self, path: Path, out: io.BytesIO) -> None:
        self.file, self.out, self.partial = path.open("ab"), out, b""

    def feed(self, data: bytes) -> None:
        self.file.write(data)
        data = self.partial + data
        cut = data.rfind(b"\n") + 1
        self.partial = data[cut:]
        if cut:
            self.out.write(hostile.text_bytes(data[:cut]))


def measure(kind: str, mb: int) -> tuple[float, float]:
    with tempfile.TemporaryDirectory() as tmp:
        out = io.BytesIO()
        sink = (
            Multiplexer(Path(tmp), out=out, colour=False).sink("node1", 0)
            if kind == "now"
            else OldSink(Path(tmp) / "node1.log", out)
        )
        chunk = b"A" * CHUNK
        tracemalloc.start()
        start = time.process_time()
        for _ in range(mb * (1 << 20) // CHUNK):
            sink.feed(chunk)
        sink.feed(b"\n")
        seconds = time.process_time() - start
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return seconds, peak / (1 << 20)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mb", default="4,16,64,256")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--old-max-mb", type=int, default=16)
    a = p.parse_args()
    print(f"{'line MB':>8} | {'old CPU s':>9} | {'old peak MB':>11} | {'now CPU s':>9} | {'now peak MB':>11}")
    for mb in (int(x) for x in a.mb.split(",")):
        row = []
        for kind in ("old", "now"):
            if kind == "old" and mb > a.old_max_mb:
                row += ["-", "-"]
                continue
            runs = [measure(kind, mb) for _ in range(a.repeat)]
            row += [
                f"{statistics.median(r[0] for r in runs):.2f}",
                f"{statistics.median(r[1] for r in runs):.1f}",
            ]
        print(f"{mb:>8} | {row[0]:>9} | {row[1]:>11} | {row[2]:>9} | {row[3]:>11}")


if __name__ == "__main__":
    main()
