"""``predictions.png``: the first N evaluated images in a grid, GT boxes green, predictions red with their desc.

Each image is upscaled ``scale`` times (nearest, so pixels stay visible) into a cell sized for the
largest image; a label strip above it names the record and counts GT / predictions. Only the first
image of a multi-image record is drawn (boxes refer to it). PIL only.

    cell = max image width * scale + PAD  by  max image height * scale + LABEL_H + PAD
    canvas = cols * cell_w + PAD  by  rows * cell_h + PAD,  cols = min(COLS, n), rows = ceil(n / cols)
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

from common.data.records import MAX_BIN
from common.evaluation.metrics import ImageResult

SCALE = 3
COLS = 4
PAD = 6
LABEL_H = 14
GT_COLOR = (20, 200, 40)
PRED_COLOR = (235, 20, 20)


def grid_geometry(sizes: Sequence[tuple[int, int]], *, scale: int = SCALE,
                  cols: int = COLS) -> tuple[int, int, int, int]:
    """(canvas width, canvas height, cell width, cell height) for images of ``sizes`` (w, h)."""
    cols = min(cols, len(sizes))
    rows = math.ceil(len(sizes) / cols)
    cell_w = max(w for w, _ in sizes) * scale + PAD
    cell_h = max(h for _, h in sizes) * scale + LABEL_H + PAD
    return cols * cell_w + PAD, rows * cell_h + PAD, cell_w, cell_h


def _load(im: ImageResult) -> Image.Image:
    if im.images and os.path.isfile(im.images[0]):
        with Image.open(im.images[0]) as f:
            return f.convert("RGB")
    return Image.new("RGB", (im.width, im.height), (128, 128, 128))  # image gone: boxes on grey


def _box(bins: Sequence[int], w: int, h: int) -> tuple[float, float, float, float]:
    return bins[0] / MAX_BIN * w, bins[1] / MAX_BIN * h, bins[2] / MAX_BIN * w, bins[3] / MAX_BIN * h


def draw_predictions(images: Sequence[ImageResult], out_path: str | os.PathLike[str], *, n: int = 12,
                     scale: int = SCALE, cols: int = COLS) -> tuple[int, int] | None:
    """Write the grid of the first ``n`` images to ``out_path``; returns its size, None when nothing to draw."""
    chosen = list(images[:n])
    if not chosen:
        return None
    pictures = [_load(im) for im in chosen]
    width, height, cell_w, cell_h = grid_geometry([p.size for p in pictures], scale=scale, cols=cols)
    canvas = Image.new("RGB", (width, height), (255, 255, 255))
    draw = ImageDraw.Draw(canvas)
    font = ImageFont.load_default()
    ncols = min(cols, len(chosen))
    for k, (im, pic) in enumerate(zip(chosen, pictures)):
        x0, y0 = PAD + (k % ncols) * cell_w, PAD + (k // ncols) * cell_h
        flags = " parse failed" if im.parse_failed else ""
        flags += " truncated" if im.finish_reason == "length" else ""
        draw.text((x0, y0), f"{im.id or k}  GT {len(im.gt)}  pred {len(im.preds)}{flags}", fill=(0, 0, 0), font=font)
        w, h = pic.width * scale, pic.height * scale
        top = y0 + LABEL_H
        canvas.paste(pic.resize((w, h), Image.NEAREST), (x0, top))
        for g in im.gt:
            x1, y1, x2, y2 = _box(g.bins, w, h)
            draw.rectangle((x0 + x1, top + y1, x0 + x2, top + y2), outline=GT_COLOR, width=2)
        for p in im.preds:
            x1, y1, x2, y2 = _box(p.bins, w, h)
            draw.rectangle((x0 + x1, top + y1, x0 + x2, top + y2), outline=PRED_COLOR, width=1)
            draw.text((x0 + x1 + 2, top + y1 + 1), p.desc, fill=PRED_COLOR, font=font)
    Path(out_path).parent.mkdir(parents=True, exist_ok=True)
    canvas.save(out_path)
    return canvas.size
