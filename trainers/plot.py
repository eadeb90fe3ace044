"""A loss plot as a PNG, drawn with the standard library only (the image carries no matplotlib).

Train loss in blue, eval loss in red (with dots), on a light grid; x is the optimizer step.
"""
from __future__ import annotations

import json
import struct
import sys
import zlib
from pathlib import Path

W, H, PAD = 640, 400, 40
BLUE, RED, GREY, BLACK = (31, 119, 180), (214, 39, 40), (225, 225, 225), (60, 60, 60)


def _png(pixels: list[bytearray]) -> bytes:
    raw = b"".join(b"\x00" + bytes(row) for row in pixels)

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", W, H, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))


def render(series: dict[tuple[int, int, int], list[tuple[float, float]]]) -> bytes:
    px = [bytearray(b"\xff" * (W * 3)) for _ in range(H)]

    def put(x: int, y: int, c) -> None:
        if 0 <= x < W and 0 <= y < H:
            px[y][3 * x:3 * x + 3] = bytes(c)

    def line(x0, y0, x1, y1, c) -> None:
        n = max(abs(x1 - x0), abs(y1 - y0), 1)
        for i in range(n + 1):
            put(round(x0 + (x1 - x0) * i / n), round(y0 + (y1 - y0) * i / n), c)

    pts = [p for s in series.values() for p in s]
    if not pts:
        return _png(px)
    xmin, xmax = min(p[0] for p in pts), max(p[0] for p in pts)
    ymin, ymax = 0.0, max(p[1] for p in pts) * 1.05
    sx = lambda x: PAD + (x - xmin) / max(xmax - xmin, 1e-9) * (W - 2 * PAD)  # noqa: E731
    sy = lambda y: H - PAD - (y - ymin) / max(ymax - ymin, 1e-9) * (H - 2 * PAD)  # noqa: E731
    for i in range(11):
        gy = round(PAD + i * (H - 2 * PAD) / 10)
        line(PAD, gy, W - PAD, gy, GREY)
    line(PAD, H - PAD, W - PAD, H - PAD, BLACK)
    line(PAD, PAD, PAD, H - PAD, BLACK)
    for colour, s in series.items():
        s = sorted(s)
        for (x0, y0), (x1, y1) in zip(s, s[1:]):
            line(round(sx(x0)), round(sy(y0)), round(sx(x1)), round(sy(y1)), colour)
        if colour == RED:
            for x, y in s:
                for dx in (-2, -1, 0, 1, 2):
                    for dy in (-2, -1, 0, 1, 2):
                        put(round(sx(x)) + dx, round(sy(y)) + dy, colour)
    return _png(px)


def plot_metrics(metrics: Path, out: Path) -> Path:
    series: dict = {BLUE: [], RED: []}
    for line in metrics.read_text().splitlines():
        rec = json.loads(line)
        series[BLUE if rec["kind"] == "train" else RED].append((rec["step"], rec["loss"]))
    out.write_bytes(render(series))
    return out


if __name__ == "__main__":
    plot_metrics(Path(sys.argv[1]), Path(sys.argv[2]))
