#!/usr/bin/env python3
"""Build a demo numeric report, render it in headless Chromium and check that the charts drew.

    python scripts/render_html_report.py [--out DIR] [--chromium PATH]

Writes DIR/numeric_report.html and DIR/numeric_report.png (DIR defaults to
$TMPDIR/qlint-numeric-report, so nothing lands in the checkout).  The check decodes the screenshot and counts the
pixels of each chart's series colours (fixed in qlint.numeric.html): the SQNR
chart, the histograms and the sensitivity bars must each have drawn, in that
order down the page.  It also checks the HTML is self-contained: no scripts,
no external stylesheets, images or URLs other than the SVG namespace.
Exit status 0 when everything holds, 1 otherwise.
"""

from __future__ import annotations

import argparse
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import warnings
import zlib
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from qlint.numeric import html as report_html  # noqa: E402
from qlint.numeric.compare import compare  # noqa: E402
from qlint.numeric.examples import (  # noqa: E402
    SmallConvNet,
    bad_layer_qconfig_mapping,
    image_batches,
    quantize_fx_ptq,
    randomize_batch_norm,
)
from qlint.numeric.histograms import activation_histograms, worst_layers  # noqa: E402
from qlint.numeric.sensitivity import sensitivity_rows  # noqa: E402

CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
    "--hide-scrollbars",
]
MIN_PIXELS = 150  # a drawn series covers thousands of pixels; a stray legend swatch ~150


def decode_png(path: Path) -> np.ndarray:
    """RGB(A) 8-bit PNG -> uint8 array (height, width, channels).  Enough for Chromium screenshots."""
    data = path.read_bytes()
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        raise ValueError(f"{path} is not a PNG")
    position, idat, header = 8, bytearray(), None
    while position < len(data):
        length, kind = struct.unpack(">I4s", data[position : position + 8])
        chunk = data[position + 8 : position + 8 + length]
        position += 12 + length
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", chunk)
        elif kind == b"IDAT":
            idat += chunk
        elif kind == b"IEND":
            break
    width, height, depth, color_type, _, _, interlace = header
    channels = {2: 3, 6: 4}.get(color_type)
    if depth != 8 or channels is None or interlace:
        raise ValueError(f"unsupported PNG layout (depth {depth}, colour type {color_type}, interlace {interlace})")
    raw = np.frombuffer(zlib.decompress(bytes(idat)), dtype=np.uint8).reshape(height, 1 + width * channels)
    image = np.zeros((height, width * channels), dtype=np.int32)
    previous = np.zeros(width * channels, dtype=np.int32)
    for row in range(height):
        kind, line = raw[row, 0], raw[row, 1:].astype(np.int32)
        if kind == 0:
            current = line
        elif kind == 2:
            current = (line + previous) & 0xFF
        elif kind == 1:
            current = line.reshape(width, channels).cumsum(axis=0).reshape(-1) & 0xFF
        else:
            current = _unfilter_sequential(kind, line, previous, channels)
        image[row] = current
        previous = current
    return image.reshape(height, width, channels).astype(np.uint8)


def _unfilter_sequential(kind: int, line: np.ndarray, previous: np.ndarray, channels: int) -> np.ndarray:
    """Average (3) and Paeth (4) filters depend on the pixel just decoded: a plain loop."""
    out = [0] * len(line)
    above = previous.tolist()
    values = line.tolist()
    for index, value in enumerate(values):
        left = out[index - channels] if index >= channels else 0
        up = above[index]
        if kind == 3:
            out[index] = (value + ((left + up) >> 1)) & 0xFF
            continue
        upper_left = above[index - channels] if index >= channels else 0
        estimate = left + up - upper_left
        distance_left, distance_up, distance_corner = (
            abs(estimate - left),
            abs(estimate - up),
            abs(estimate - upper_left),
        )
        if distance_left <= distance_up and distance_left <= distance_corner:
            predictor = left
        elif distance_up <= distance_corner:
            predictor = up
        else:
            predictor = upper_left
        out[index] = (value + predictor) & 0xFF
    return np.array(out, dtype=np.int32)


def color_mask(image: np.ndarray, hex_color: str, tolerance: int = 12) -> np.ndarray:
    target = np.array([int(hex_color[i : i + 2], 16) for i in (1, 3, 5)], dtype=np.int32)
    return (np.abs(image[..., :3].astype(np.int32) - target) <= tolerance).all(axis=-1)


def build_demo(out: Path) -> Path:
    """A 12-layer CNN with one layer's weights quantized to 4 levels; the full report with all charts."""
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)  # small tensors: extra intra-op threads only contend for shared cores
    model = randomize_batch_norm(SmallConvNet()).eval()
    data = image_batches(4, batch_size=4, size=12, seed=3)
    _, quantized = quantize_fx_ptq(model, data, bad_layer_qconfig_mapping("res1.conv2"))
    report = compare(model, quantized, data, model_name="SmallConvNet (res1.conv2 at 2 bits)")
    histograms = activation_histograms(model, quantized, data, report, worst_layers(report, 4))
    ranking = sensitivity_rows(model, data, quantized_model=quantized)
    return report_html.write_html(report, out / "numeric_report.html", sensitivity=ranking, histograms=histograms)


def check_self_contained(page: str) -> list[str]:
    problems = []
    if re.search(r"<script|<link|<img|<iframe|@import|url\(", page, re.IGNORECASE):
        problems.append("the page holds scripts, links, images or CSS urls")
    urls = set(re.findall(r"https?://[^\s\"'<>]+", page)) - {"http://www.w3.org/2000/svg"}
    if urls:
        problems.append(f"the page names external URLs: {sorted(urls)[:5]}")
    return problems


def render(html_path: Path, png_path: Path, chromium: str) -> None:
    command = [
        chromium,
        *CHROMIUM_FLAGS,
        "--window-size=1200,2600",
        f"--screenshot={png_path}",
        html_path.resolve().as_uri(),
    ]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=120)
    if completed.returncode != 0 or not png_path.exists():
        raise RuntimeError(f"chromium failed ({completed.returncode}): {completed.stderr[-800:]}")


def check_charts(image: np.ndarray) -> tuple[dict[str, tuple[int, int, int]], list[str]]:
    """Pixel count and vertical extent of each chart's series colour."""
    charts = {
        "sqnr propagated": report_html.PROPAGATED_COLOR,
        "sqnr shadow": report_html.SHADOW_COLOR,
        "histogram float": report_html.FLOAT_HISTOGRAM_COLOR,
        "histogram quantized": report_html.QUANTIZED_HISTOGRAM_COLOR,
        "sensitivity bars": report_html.SENSITIVITY_COLOR,
    }
    background = (image[..., :3] == 255).all(axis=-1)
    found, problems = {}, []
    for label, color in charts.items():
        mask = color_mask(image, color)
        rows = np.nonzero(mask.sum(axis=1) > 3)[0]  # rows with more than a few such pixels
        count = int(mask.sum())
        found[label] = (count, int(rows.min()) if rows.size else -1, int(rows.max()) if rows.size else -1)
        if count < MIN_PIXELS:
            problems.append(f"{label}: only {count} pixels of {color}; the chart did not draw")
    if (~background).sum() < 0.02 * background.size:
        problems.append("the page is almost blank")
    order = [found["sqnr propagated"][2], found["histogram float"][2], found["sensitivity bars"][2]]
    if order != sorted(order):
        problems.append(f"charts are not in page order (SQNR, histograms, sensitivity): bottoms at {order}")
    return found, problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "qlint-numeric-report")
    parser.add_argument("--chromium", default=shutil.which("chromium") or "/usr/bin/chromium")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    html_path = build_demo(args.out)
    png_path = args.out / "numeric_report.png"
    problems = check_self_contained(html_path.read_text(encoding="utf-8"))
    render(html_path, png_path, args.chromium)
    image = decode_png(png_path)
    found, chart_problems = check_charts(image)
    problems += chart_problems
    print(f"html: {html_path} ({html_path.stat().st_size} bytes)  png: {png_path} {image.shape[1]}x{image.shape[0]}")
    for label, (count, top, bottom) in found.items():
        print(f"  {label:<20} {count:>7} px  rows {top}-{bottom}")
    for problem in problems:
        print(f"FAIL: {problem}")
    print("OK: all charts drew" if not problems else f"{len(problems)} problem(s)")
    return 0 if not problems else 1


if __name__ == "__main__":
    raise SystemExit(main())
