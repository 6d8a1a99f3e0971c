"""A deterministic synthetic detection dataset: coloured shapes on varied backgrounds.

    python -m common.data.synthetic --out artifacts/data/synth --n 64 --seed 0 [--split 56/8] [--force] \
        [--sides 56,84,112] [--max-objects 12] [--size-range 0.12/0.6] [--crowded]

writes ``train.jsonl``, ``val.jsonl``, ``images/synth-000123.png`` and ``manifest.json`` under
``--out``, in the record format of docs/data.md (pixel boxes, ``"coord_mode": "pixel"``).
Record i is drawn from its own random stream ``(seed, i)``, so it is the same whatever ``n`` is,
and the same seed gives byte-identical files. A second run with the same parameters does nothing.

By default each image is 56..112 px per side (multiples of 28, one Qwen2-VL merged patch) with 1..12
shapes (rectangle/square, ellipse/circle, triangle), each side 0.12..0.6 of the image's shorter side;
``sides``, ``max_objects`` and ``size_range`` change that (the demo's detection set uses 112 px images
with 1..3 larger shapes, which a tiny model learns to localise within CPU minutes: docs/warm_start.md).
Shapes may overlap, but every shape keeps
at least half of its pixels visible. ``bbox_2d`` is the tight box of the shape's own pixels (occluded
ones included) in pixel-edge coordinates, so a shape covering pixel columns 3..9 has x1=3, x2=10.
Descriptions are "[small|large] <colour> <shape>", e.g. "large blue triangle".

``--crowded`` (:data:`CROWDED`): 10..40 small shapes (0.06..0.22 of the shorter side) on 112..168 px
images, overlapping, and with probability 0.35 a shape is a near-duplicate of one already drawn
(same shape and colour, size within ±15 %, placed about one box away), so the same desc recurs
close by: a scene where the order of the objects, recall and duplicate boxes matter (issue 34).
``min_objects`` and ``near_duplicate_p`` are the knobs it sets; a manifest records them when not default.

What this module does not know: tokens, models, or how records are serialised for training.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from common.runs import cli
from common.runs.build_dir import build_once

GENERATOR_VERSION = 1
MANIFEST = "manifest.json"

#: Saturated object colours; backgrounds are kept muted so every shape stands out.
COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 170, 40),
    "blue": (30, 60, 220),
    "yellow": (240, 220, 20),
    "orange": (245, 130, 10),
    "purple": (140, 40, 190),
    "pink": (245, 110, 190),
    "cyan": (20, 210, 220),
    "white": (250, 250, 250),
    "black": (10, 10, 10),
    "brown": (120, 70, 20),
}
SHAPES = ("rectangle", "ellipse", "triangle")
NOUNS = ("rectangle", "square", "ellipse", "circle", "triangle")
SIZE_WORDS = ("small", "large")
MIN_VISIBLE_FRACTION = 0.5
MAX_OBJECTS = 12


def desc_vocabulary() -> list[str]:
    """Every word a generated ``desc`` can contain (the tiny model's tokenizer learns them)."""
    return [*SIZE_WORDS, *COLORS, *NOUNS]


def _background(rng: np.random.Generator, w: int, h: int) -> np.ndarray:
    def muted() -> np.ndarray:
        gray = rng.uniform(70, 190)
        return gray + 0.35 * (rng.uniform(40, 220, 3) - gray)

    kind = rng.integers(3)
    if kind == 0:  # solid
        img = np.broadcast_to(muted(), (h, w, 3)).copy()
    elif kind == 1:  # linear gradient in a random direction
        a, b = muted(), muted()
        theta = rng.uniform(0, 2 * np.pi)
        yy, xx = np.mgrid[0:h, 0:w]
        t = xx * np.cos(theta) + yy * np.sin(theta)
        t = (t - t.min()) / max(float(t.max() - t.min()), 1e-6)
        img = a + t[..., None] * (b - a)
    else:  # noise around a muted tone
        img = muted() + rng.normal(0, 18, (h, w, 3))
    return np.clip(img, 0, 255)


def _shape_mask(rng: np.random.Generator, shape: str, w: int, h: int, box: tuple[int, int, int, int]) -> np.ndarray:
    x1, y1, x2, y2 = box  # inclusive pixel corners
    canvas = Image.new("L", (w, h), 0)
    draw = ImageDraw.Draw(canvas)
    if shape == "rectangle":
        draw.rectangle(box, fill=255)
    elif shape == "ellipse":
        draw.ellipse(box, fill=255)
    else:
        cx, cy = (x1 + x2) / 2, (y1 + y2) / 2
        points = {
            0: [(cx, y1), (x1, y2), (x2, y2)],  # apex up
            1: [(x1, y1), (x2, y1), (cx, y2)],  # apex down
            2: [(x1, cy), (x2, y1), (x2, y2)],  # apex left
            3: [(x1, y1), (x1, y2), (x2, cy)],  # apex right
        }[int(rng.integers(4))]
        draw.polygon(points, fill=255)
    return np.asarray(canvas) > 0


def _grow(mask: np.ndarray, pixels: int = 2) -> np.ndarray:
    """The mask dilated by ``pixels`` (4-neighbourhood steps)."""
    out = mask.copy()
    for _ in range(pixels):
        m = out.copy()
        out[1:] |= m[:-1]
        out[:-1] |= m[1:]
        out[:, 1:] |= m[:, :-1]
        out[:, :-1] |= m[:, 1:]
    return out


def _describe(shape: str, color: str, bbox: Sequence[int], w: int, h: int) -> str:
    bw, bh = bbox[2] - bbox[0], bbox[3] - bbox[1]
    square = 0.85 <= bw / bh <= 1 / 0.85
    noun = {"rectangle": "square", "ellipse": "circle"}.get(shape, shape) if square else shape
    area = bw * bh / (w * h)
    size = "small " if area < 0.04 else "large " if area > 0.2 else ""
    return f"{size}{color} {noun}"


DEFAULT_SIDES = (56, 84, 112)
DEFAULT_SIZE_RANGE = (0.12, 0.6)
#: The crowded-scene preset (``--crowded``): generate() keyword arguments.
CROWDED = {"sides": (112, 140, 168), "min_objects": 10, "max_objects": 40, "size_range": (0.06, 0.22),
           "near_duplicate_p": 0.35}


def render_record(seed: int, index: int, sides: Sequence[int] = DEFAULT_SIDES, max_objects: int = MAX_OBJECTS,
                  size_range: Sequence[float] = DEFAULT_SIZE_RANGE, min_objects: int = 1,
                  near_duplicate_p: float = 0.0) -> tuple[Image.Image, dict]:
    """Draw record ``index`` of dataset ``seed``: the image and its JSONL record (without ``images``).

    ``size_range``: a shape's box side as a share of the image's shorter side, (low, high);
    ``near_duplicate_p``: the chance that a shape copies one already drawn, near it (module docstring).
    The defaults draw exactly the random numbers they always drew, so older datasets regenerate identically."""
    rng = np.random.default_rng([seed, index])
    w, h = int(rng.choice(sides)), int(rng.choice(sides))
    pixels = _background(rng, w, h)
    target = int(rng.integers(min_objects, max_objects + 1))
    short = min(w, h)
    lo, hi = max(6, round(size_range[0] * short)), max(8, round(size_range[1] * short))
    placed: list[dict] = []  # {"mask", "visible", "color", "shape", "box"}
    for _ in range(target * 8):
        if len(placed) == target:
            break
        if near_duplicate_p > 0 and placed and rng.random() < near_duplicate_p:
            shape, color, bw, bh, x1, y1 = _near_duplicate(rng, placed[int(rng.integers(len(placed)))], w, h, lo)
        else:
            shape = SHAPES[int(rng.integers(len(SHAPES)))]
            color = list(COLORS)[int(rng.integers(len(COLORS)))]
            bw, bh = int(rng.integers(lo, hi + 1)), int(rng.integers(lo, hi + 1))
            x1, y1 = int(rng.integers(0, w - bw + 1)), int(rng.integers(0, h - bh + 1))
        mask = _shape_mask(rng, shape, w, h, (x1, y1, x1 + bw - 1, y1 + bh - 1))
        area = int(mask.sum())
        if area < 12:
            continue
        # Keep the shape distinguishable from what lies under it.
        under = pixels[mask].mean(axis=0)
        if np.abs(under - np.array(COLORS[color])).sum() < 120:
            continue
        # Same-coloured shapes stay 2 px apart, or they would read as one blob.
        grown = _grow(mask)
        if any(p["color"] == color and (grown & p["visible"]).any() for p in placed):
            continue
        # Drawing it on top must leave every earlier shape at least half visible.
        if any((p["visible"] & ~mask).sum() < MIN_VISIBLE_FRACTION * p["mask"].sum() for p in placed):
            continue
        for p in placed:
            p["visible"] &= ~mask
        pixels[mask] = COLORS[color]
        placed.append({"mask": mask, "visible": mask.copy(), "color": color, "shape": shape, "box": (bw, bh, x1, y1)})
    objects = []
    for p in placed:
        ys, xs = np.nonzero(p["mask"])
        bbox = [int(xs.min()), int(ys.min()), int(xs.max()) + 1, int(ys.max()) + 1]
        objects.append({"desc": _describe(p["shape"], p["color"], bbox, w, h), "bbox_2d": bbox})
    image = Image.fromarray(np.round(pixels).astype(np.uint8), "RGB")
    record = {"id": f"synth-{index:06d}", "width": w, "height": h, "coord_mode": "pixel", "objects": objects}
    return image, record


def _near_duplicate(rng: np.random.Generator, like: dict, w: int, h: int, lo: int) -> tuple:
    """(shape, colour, bw, bh, x1, y1): ``like``'s shape and colour, each side within ±15 %, moved about one
    box side in a random direction (clipped to the image): the same desc again, close by."""
    bw0, bh0, x0, y0 = like["box"]
    bw, bh = (max(lo, int(round(v * rng.uniform(0.85, 1.15)))) for v in (bw0, bh0))
    bw, bh = min(bw, w), min(bh, h)
    angle = rng.uniform(0, 2 * np.pi)
    x1 = int(np.clip(x0 + np.cos(angle) * (bw0 + 3), 0, w - bw))
    y1 = int(np.clip(y0 + np.sin(angle) * (bh0 + 3), 0, h - bh))
    return like["shape"], like["color"], bw, bh, x1, y1


def _params(n_train: int, n_val: int, seed: int, sides: Sequence[int], max_objects: int = MAX_OBJECTS,
            size_range: Sequence[float] = DEFAULT_SIZE_RANGE, min_objects: int = 1,
            near_duplicate_p: float = 0.0) -> dict:
    params = {
        "generator": "common.synthetic",  # moves: keep - the manifest's name for this generator (built sets stay valid)
        "version": GENERATOR_VERSION,
        "n_train": n_train,
        "n_val": n_val,
        "seed": seed,
        "sides": list(sides),
    }
    if max_objects != MAX_OBJECTS or tuple(size_range) != DEFAULT_SIZE_RANGE:  # older manifests stay valid
        params.update(max_objects=max_objects, size_range=[float(x) for x in size_range])
    if min_objects != 1 or near_duplicate_p:
        params.update(min_objects=min_objects, near_duplicate_p=float(near_duplicate_p))
    return params


def _is_complete(out: Path, params: dict) -> bool:
    try:
        manifest = json.loads((out / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    return manifest.get("params") == params and all((out / f).is_file() for f in manifest.get("files", []))


#: Below this many records a dataset is drawn in this process: a worker pool's start-up would cost more.
POOL_MIN_RECORDS = 256


def _draw(out: Path, seed: int, i: int, shape: tuple) -> tuple[str, str]:
    """Draw record ``i``, save its PNG under ``out`` and return (its relative path, its JSONL line)."""
    image, record = render_record(seed, i, *shape)
    rel = f"images/{record['id']}.png"
    image.save(out / rel, format="PNG", optimize=False)
    ordered = {"id": record["id"], "images": [rel], **{k: v for k, v in record.items() if k != "id"}}
    return rel, json.dumps(ordered, ensure_ascii=False, separators=(", ", ": ")) + "\n"


def _draw_range(args: tuple) -> list[tuple[str, str]]:
    out, seed, start, stop, shape = args
    return [_draw(out, seed, i, shape) for i in range(start, stop)]


def resolve_workers(workers: int | None, n_records: int) -> int:
    """``workers`` None = in this process below :data:`POOL_MIN_RECORDS` records, else one per core up to 16."""
    if workers is None:
        return 1 if n_records < POOL_MIN_RECORDS else max(1, min(os.cpu_count() or 1, 16))
    if workers < 1:
        raise ValueError(f"workers must be >= 1 (or None for automatic), got {workers}")
    return workers


def _write(out: Path, n_train: int, n_val: int, seed: int, sides: Sequence[int], max_objects: int,
           size_range: Sequence[float], min_objects: int = 1, near_duplicate_p: float = 0.0,
           workers: int | None = None) -> None:
    """Draw every record, in ``workers`` spawned processes over contiguous index ranges when more than one:
    record i depends on (seed, i) only, so the files are byte-identical whatever the worker count (a 336-px
    crowded image takes ~0.1 s to draw; 1,600 of them held a GPU machine's call for 168 s in one process)."""
    (out / "images").mkdir(parents=True)
    shape = (tuple(sides), max_objects, tuple(size_range), min_objects, near_duplicate_p)
    total = n_train + n_val
    n_workers = resolve_workers(workers, total)
    if n_workers == 1:
        drawn = _draw_range((out, seed, 0, total, shape))
    else:
        import concurrent.futures as cf
        import multiprocessing as mp

        step = -(-total // (n_workers * 4))  # a few ranges a worker: an even finish without per-record overhead
        ranges = [(out, seed, a, min(a + step, total), shape) for a in range(0, total, step)]
        with cf.ProcessPoolExecutor(n_workers, mp_context=mp.get_context("spawn")) as pool:
            drawn = [d for part in pool.map(_draw_range, ranges) for d in part]
    files = [rel for rel, _ in drawn]
    for split, start, count in (("train", 0, n_train), ("val", n_train, n_val)):
        (out / f"{split}.jsonl").write_text("".join(line for _, line in drawn[start:start + count]), encoding="utf-8")
        files.append(f"{split}.jsonl")
    manifest = {"params": _params(n_train, n_val, seed, sides, max_objects, size_range, min_objects, near_duplicate_p),
                "files": sorted(files)}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")


def default_split(n: int) -> tuple[int, int]:
    """``n`` records -> (train, val): one in eight to val, at least one each when ``n >= 2``."""
    n_val = max(1, n // 8) if n >= 2 else 0
    return n - n_val, n_val


def generate(
    out_dir: str | os.PathLike[str],
    n: int = 64,
    seed: int = 0,
    sides: Sequence[int] = DEFAULT_SIDES,
    split: tuple[int, int] | None = None,
    force: bool = False,
    max_objects: int = MAX_OBJECTS,
    size_range: Sequence[float] = DEFAULT_SIZE_RANGE,
    min_objects: int = 1,
    near_duplicate_p: float = 0.0,
    workers: int | None = None,
) -> Path:
    """Write the dataset under ``out_dir`` (unless already there with the same parameters) and
    return the path of ``train.jsonl``. ``split`` = (train, val) counts, default :func:`default_split`;
    ``workers``: drawing processes (:func:`resolve_workers`; the files do not depend on it).

    Built once and atomically (:func:`common.runs.build_dir.build_once`): a folder without our manifest is
    never deleted, and a concurrent call with the same arguments is safe.
    """
    out = Path(out_dir)
    n_train, n_val = split if split is not None else default_split(n)
    if n_train < 0 or n_val < 0 or n_train + n_val < 1 or not sides:
        raise ValueError(f"need n_train, n_val >= 0 with at least one record and some sides, got {split or n}, {sides}")
    if not 1 <= min_objects <= max_objects <= 64:
        raise ValueError(f"need 1 <= min_objects <= max_objects <= 64, got {min_objects}, {max_objects}")
    if not 0.0 <= near_duplicate_p < 1.0:
        raise ValueError(f"near_duplicate_p must be in [0, 1), got {near_duplicate_p}")
    if len(size_range) != 2 or not 0 < size_range[0] <= size_range[1] <= 1:
        raise ValueError(f"size_range must be (low, high) with 0 < low <= high <= 1, got {tuple(size_range)}")
    params = _params(n_train, n_val, seed, sides, max_objects, size_range, min_objects, near_duplicate_p)
    build_once(out, marker=MANIFEST, is_built=lambda d: _is_complete(d, params), owner="common.data.synthetic",
               write=lambda tmp: _write(tmp, n_train, n_val, seed, sides, max_objects, size_range, min_objects,
                                        near_duplicate_p, workers), force=force)
    return out / "train.jsonl"


def ensure_synthetic_data(path: str | os.PathLike[str] = "artifacts/data/synth", n: int = 64, seed: int = 0) -> Path:
    """The dataset folder at ``path`` with the default parameters, generated if missing or stale."""
    return generate(path, n=n, seed=seed).parent


def main(argv: Sequence[str] | None = None) -> int:
    parser = cli.parser("python -m common.data.synthetic", __doc__)
    parser.add_argument("--out", default="artifacts/data/synth", help="output folder (default: %(default)s)")
    parser.add_argument("--n", type=int, default=64, help="number of records, train + val (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="dataset seed (default: %(default)s)")
    parser.add_argument("--split", default=None, metavar="TRAIN/VAL", help="explicit counts, e.g. 56/8 (overrides --n)")
    parser.add_argument("--force", action="store_true", help="regenerate even if the outputs are up to date")
    parser.add_argument("--workers", type=int, default=None,
                        help=f"drawing processes (default: 1 below {POOL_MIN_RECORDS} records, else one per core up "
                             "to 16); the files are the same whatever it is")
    parser.add_argument("--sides", default=None,
                        help=f"image side choices in px (default: {','.join(map(str, DEFAULT_SIDES))}; --crowded: "
                             f"{','.join(map(str, CROWDED['sides']))})")
    parser.add_argument("--max-objects", type=int, default=None,
                        help=f"shapes per image, 1..N (default: {MAX_OBJECTS}; --crowded: {CROWDED['max_objects']})")
    parser.add_argument("--size-range", default=None, metavar="LOW/HIGH",
                        help="shape box side as a share of the shorter image side (default: "
                             f"{'/'.join(map(str, DEFAULT_SIZE_RANGE))}; --crowded: "
                             f"{'/'.join(map(str, CROWDED['size_range']))})")
    parser.add_argument("--crowded", action="store_true",
                        help="crowded scenes: 10..40 small overlapping shapes with near-duplicates on 112..168 px; "
                             "--sides, --max-objects and --size-range given as well replace those values")
    args = parser.parse_args(argv)
    try:
        sides = tuple(int(x) for x in args.sides.split(",")) if args.sides is not None else None
        size_range = tuple(float(x) for x in args.size_range.split("/")) if args.size_range is not None else None
    except ValueError:
        parser.error(f"--sides must look like 56,84,112 and --size-range like 0.12/0.6, got {args.sides!r}, {args.size_range!r}")
    split = None
    if args.split is not None:
        try:
            a, b = (int(x) for x in args.split.split("/"))
            split = (a, b)
        except ValueError:
            parser.error(f"--split must look like TRAIN/VAL, e.g. 56/8, got {args.split!r}")
    shape_args = dict(CROWDED) if args.crowded else {"sides": DEFAULT_SIDES, "max_objects": MAX_OBJECTS,
                                                      "size_range": DEFAULT_SIZE_RANGE}
    given = {"sides": sides, "max_objects": args.max_objects, "size_range": size_range}
    shape_args.update({k: v for k, v in given.items() if v is not None})  # what the command line names wins
    try:
        train = generate(args.out, n=args.n, seed=args.seed, split=split, force=args.force, workers=args.workers,
                         **shape_args)
    except (ValueError, FileExistsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    params = json.loads((train.parent / MANIFEST).read_text())["params"]
    print(f"synthetic data: {train.parent} (train {params['n_train']}, val {params['n_val']}, seed {params['seed']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
