"""A dependency-free PNG line plot: the quickstart's fallback when matplotlib is not installed.

Stacked panels, one polyline each, on a white canvas with a light frame; no text (the caller prints
the numbers). Pure Python: zlib + struct for the PNG container, Bresenham for the lines.
"""

from __future__ import annotations

import math
import struct
import zlib
from collections.abc import Sequence

__all__ = ["write_line_panels"]

_W, _PANEL_H, _PAD = 640, 240, 20
_COLOURS = ((31, 119, 180), (214, 39, 40), (44, 160, 44))


def _line(px: bytearray, x0: int, y0: int, x1: int, y1: int, rgb: tuple[int, int, int], height: int) -> None:
    dx, dy = abs(x1 - x0), -abs(y1 - y0)
    sx, sy = (1 if x0 < x1 else -1), (1 if y0 < y1 else -1)
    err = dx + dy
    while True:
        for ox in (0, 1):  # 2-pixel-wide strokes
            x = x0 + ox
            if 0 <= x < _W and 0 <= y0 < height:
                i = 3 * (y0 * _W + x)
                px[i : i + 3] = bytes(rgb)
        if x0 == x1 and y0 == y1:
            return
        e2 = 2 * err
        if e2 >= dy:
            err, x0 = err + dy, x0 + sx
        if e2 <= dx:
            err, y0 = err + dx, y0 + sy


def _panel(px: bytearray, top: int, values: Sequence[float], rgb, height: int, log: bool) -> None:
    frame = (200, 200, 200)
    left, right, y_top, y_bot = _PAD, _W - _PAD, top + _PAD, top + _PANEL_H - _PAD
    for x0, y0, x1, y1 in ((left, y_top, right, y_top), (left, y_bot, right, y_bot),
                           (left, y_top, left, y_bot), (right, y_top, right, y_bot)):  # fmt: skip
        _line(px, x0, y0, x1, y1, frame, height)
    pts = [(i, math.log10(max(v, 1e-12)) if log else v) for i, v in enumerate(values) if math.isfinite(v)]
    if not pts:
        return
    lo, hi = min(v for _, v in pts), max(v for _, v in pts)
    span, n = (hi - lo) or 1.0, max(1, len(values) - 1)
    xy = [(left + round(i * (right - left) / n), y_bot - round((v - lo) * (y_bot - y_top) / span)) for i, v in pts]
    for (x0, y0), (x1, y1) in zip(xy, xy[1:] or xy):
        _line(px, x0, y0, x1, y1, rgb, height)


def write_line_panels(path: str, panels: Sequence[tuple[Sequence[float], bool]]) -> None:
    """One panel per ``(values, log_scale)``, stacked vertically, written as an RGB PNG."""
    height = _PANEL_H * len(panels)
    px = bytearray(b"\xff" * (3 * _W * height))
    for k, (values, log) in enumerate(panels):
        _panel(px, k * _PANEL_H, values, _COLOURS[k % len(_COLOURS)], height, log)
    rows = b"".join(b"\x00" + bytes(px[3 * _W * y : 3 * _W * (y + 1)]) for y in range(height))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", _W, height, 8, 2, 0, 0, 0)  # 8-bit RGB
    with open(path, "wb") as f:
        f.write(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b""))
