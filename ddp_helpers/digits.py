"""The offline stand-in for MNIST: deterministic, handwritten-looking digits in MNIST's format.

Each digit is a few pen strokes (polylines and arcs in a unit box). Every image bends its
strokes with a smooth random warp, slants, rotates and stretches them, normalises the result
to MNIST's 20-pixel box centred by centre of mass, and draws them with a random pen width. The
drawing is one batched matrix product per chunk of images (a sum of Gaussian dots along the
strokes, separable in x and y), so all 70,000 images take a few seconds with numpy alone.
"""

from __future__ import annotations

import gzip
import io
import struct
from pathlib import Path

import numpy as np

from .files import replaced_folder

GENERATOR_VERSION = 1  # bump when the images change, so stale files on disk are regenerated
N_TRAIN, N_TEST = 60_000, 10_000
TRAIN_SEED, TEST_SEED = 20_260, 20_261
SIZE = 28
POINTS = 64  # pen positions per digit: about a pixel apart, so strokes look continuous
FILES = {  # torchvision's MNIST file names, split -> (images, labels)
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "t10k": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}


def _arc(cx: float, cy: float, rx: float, ry: float, a0: float, a1: float) -> np.ndarray:
    """Points on an ellipse from angle a0 to a1 (degrees, 90 = top; y grows downwards)."""
    t = np.radians(np.linspace(a0, a1, 48))
    return np.stack([cx + rx * np.cos(t), cy - ry * np.sin(t)], axis=1)


def _line(*points: tuple[float, float]) -> np.ndarray:
    return np.asarray(points, dtype=np.float64)


def _join(*parts: np.ndarray) -> np.ndarray:
    return np.concatenate(parts, axis=0)


def _lissajous_eight() -> np.ndarray:
    s = np.linspace(0, 2 * np.pi, 96)
    return np.stack([0.5 + 0.24 * np.sin(2 * s) * (1.1 - 0.2 * np.cos(s)),
                     0.5 - 0.48 * np.cos(s)], axis=1)


# digit -> variants -> strokes. Coordinates in a unit box, x to the right, y downwards.
_SHAPES: dict[int, list[list[np.ndarray]]] = {
    0: [[_arc(0.5, 0.5, 0.27, 0.48, 95, 455)],
        [_arc(0.5, 0.5, 0.30, 0.46, 110, 480)]],
    1: [[_line((0.5, 0.0), (0.5, 1.0))],
        [_line((0.34, 0.17), (0.53, 0.0), (0.53, 1.0))],
        [_line((0.34, 0.17), (0.53, 0.0), (0.53, 1.0)), _line((0.36, 1.0), (0.7, 1.0))]],
    2: [[_join(_arc(0.5, 0.27, 0.27, 0.27, 165, -20), _line((0.22, 1.0), (0.82, 1.0)))],
        [_join(_arc(0.5, 0.28, 0.26, 0.28, 160, -35),
               _line((0.2, 0.97), (0.5, 0.92), (0.86, 0.98)))]],
    3: [[_join(_arc(0.48, 0.26, 0.25, 0.25, 155, -90), _arc(0.48, 0.74, 0.28, 0.25, 90, -150))],
        [_join(_line((0.22, 0.02), (0.74, 0.02), (0.44, 0.42)),
               _arc(0.48, 0.71, 0.28, 0.28, 95, -155))]],
    4: [[_line((0.62, 0.0), (0.16, 0.66), (0.86, 0.66)), _line((0.64, 0.3), (0.64, 1.0))],
        [_line((0.25, 0.0), (0.22, 0.6), (0.82, 0.6)), _line((0.67, 0.08), (0.67, 1.0))]],
    5: [[_join(_line((0.78, 0.0), (0.32, 0.0), (0.29, 0.44)),
               _arc(0.5, 0.68, 0.27, 0.27, 130, -155))],
        [_join(_line((0.3, 0.0), (0.27, 0.46)), _arc(0.5, 0.7, 0.26, 0.28, 125, -160)),
         _line((0.3, 0.0), (0.8, 0.02))]],
    6: [[_join(_arc(0.58, 0.62, 0.32, 0.6, 75, 185), _arc(0.5, 0.72, 0.24, 0.26, 185, 530))],
        [_join(_line((0.7, 0.0), (0.3, 0.5)), _arc(0.5, 0.72, 0.25, 0.27, 160, 520))]],
    7: [[_line((0.18, 0.0), (0.82, 0.0), (0.42, 1.0))],
        [_line((0.18, 0.0), (0.82, 0.0), (0.42, 1.0)), _line((0.44, 0.52), (0.8, 0.52))],
        [_line((0.18, 0.14), (0.2, 0.0), (0.8, 0.02), (0.55, 0.5), (0.5, 1.0))]],
    8: [[_join(_arc(0.5, 0.26, 0.21, 0.25, -90, 270), _arc(0.5, 0.74, 0.26, 0.25, 90, 450))],
        [_lissajous_eight()]],
    9: [[_join(_arc(0.5, 0.27, 0.25, 0.27, 0, 360), _line((0.75, 0.27), (0.7, 1.0)))],
        [_join(_arc(0.5, 0.28, 0.24, 0.27, 10, 370), _line((0.74, 0.3), (0.73, 0.82)),
               _arc(0.55, 0.82, 0.18, 0.17, 0, -150))]],
}


def _resample(strokes: list[np.ndarray], n: int) -> tuple[np.ndarray, np.ndarray]:
    """n points evenly spaced by arc length over all strokes, and each point's stroke number."""
    lengths = np.array([np.linalg.norm(np.diff(s, axis=0), axis=1).sum() for s in strokes])
    counts = np.maximum(2, np.round(n * lengths / lengths.sum()).astype(int))
    counts[np.argmax(counts)] += n - counts.sum()
    points, ids = [], []
    for i, (s, k) in enumerate(zip(strokes, counts, strict=True)):
        along = np.concatenate([[0], np.cumsum(np.linalg.norm(np.diff(s, axis=0), axis=1))])
        t = np.linspace(0, along[-1], k)
        points.append(np.stack([np.interp(t, along, s[:, 0]), np.interp(t, along, s[:, 1])], 1))
        ids.append(np.full(k, i))
    return np.concatenate(points), np.concatenate(ids)


def _templates() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(points V x P x 2, stroke ids V x P, digit of each variant V) for every shape variant."""
    pts, ids, digit = [], [], []
    for d, variants in _SHAPES.items():
        for strokes in variants:
            p, i = _resample(strokes, POINTS)
            pts.append(p)
            ids.append(i)
            digit.append(d)
    return np.stack(pts), np.stack(ids), np.array(digit)


def _gauss(grid: np.ndarray, centre: np.ndarray, half_inv_var: np.ndarray) -> np.ndarray:
    """exp(-(grid - centre)^2 / 2 sigma^2), computed in place (this is most of the run time)."""
    out = grid - centre[..., None]
    np.square(out, out=out)
    out *= -half_inv_var
    return np.exp(out, out=out)


def _render_chunk(labels: np.ndarray, rng: np.random.Generator, tpl) -> np.ndarray:
    """Images (n x 28 x 28, float in [0, 1]) of the given digits, drawn with random style."""
    tpl_pts, tpl_ids, tpl_digit = tpl
    n = len(labels)
    # Pick a shape variant of each image's digit.
    variant = np.empty(n, dtype=int)
    for d in range(10):
        choices = np.flatnonzero(tpl_digit == d)
        mask = labels == d
        variant[mask] = rng.choice(choices, size=mask.sum())
    p = tpl_pts[variant].copy()  # n x P x 2, unit box
    same_stroke = tpl_ids[variant][:, 1:] == tpl_ids[variant][:, :-1]
    # A smooth random warp: the same writer never draws a digit twice alike.
    for axis in (0, 1):
        for _ in range(2):
            amp = rng.normal(0, 0.05, (n, 1))
            freq = rng.uniform(0.5, 1.6, (n, 1, 2)) * np.pi
            phase = rng.uniform(0, 2 * np.pi, (n, 1))
            p[..., axis] += amp * np.sin((p * freq).sum(-1) + phase)
    # Slant, rotation and aspect, about the box centre.
    p -= 0.5
    slant = rng.normal(0.12, 0.2, (n, 1))
    angle = rng.normal(0, 0.13, (n, 1))
    sx, sy = rng.uniform(0.7, 1.25, (n, 1)), rng.uniform(0.85, 1.1, (n, 1))
    x, y = p[..., 0] * sx, p[..., 1] * sy
    x = x - slant * y  # y grows downwards, so positive slant leans the top to the right
    c, s = np.cos(angle), np.sin(angle)
    x, y = c * x - s * y, s * x + c * y
    # MNIST's own normalisation: fit the larger side to ~20 px, centre the mass at the middle.
    extent = np.maximum(np.ptp(x, axis=1), np.ptp(y, axis=1))[:, None]
    scale = rng.uniform(17.0, 20.0, (n, 1)) / extent
    x, y = x * scale, y * scale
    x += 13.5 - x.mean(1, keepdims=True) + rng.normal(0, 0.75, (n, 1))
    y += 13.5 - y.mean(1, keepdims=True) + rng.normal(0, 0.75, (n, 1))
    # Ink per pen position: the distance to its neighbours on the same stroke (a line integral).
    step = np.hypot(np.diff(x, axis=1), np.diff(y, axis=1)) * same_stroke
    weight = np.zeros_like(x)
    weight[:, 1:] += step / 2
    weight[:, :-1] += step / 2
    sigma = rng.uniform(0.55, 1.1, (n, 1, 1)).astype(np.float32)
    weight = weight / (np.sqrt(2 * np.pi) * sigma[..., 0])  # a straight stroke peaks at 1
    grid = np.arange(SIZE, dtype=np.float32)
    half_inv_var = 0.5 / sigma**2
    gx, gy = (_gauss(grid, v.astype(np.float32), half_inv_var) for v in (x, y))  # n x P x 28
    gy *= weight[..., None].astype(np.float32)
    ink = np.matmul(gy.transpose(0, 2, 1), gx)  # n x 28 x 28: row = y, column = x
    # Pressure: a saturated core with soft edges, a little texture, and the odd speck of dirt.
    gain = rng.uniform(1.4, 3.0, (n, 1, 1)).astype(np.float32)
    img = np.clip(ink * gain, 0, 1)
    img *= 0.88 + 0.24 * rng.random(img.shape, dtype=np.float32)
    specks = rng.poisson(0.4, n)
    who = np.repeat(np.arange(n), specks)
    img[who, rng.integers(0, SIZE, len(who)), rng.integers(0, SIZE, len(who))] += (
        rng.uniform(0.2, 0.7, len(who)).astype(np.float32))
    img = np.clip(img, 0, 1)
    img[img < 0.04] = 0  # MNIST's background is exactly zero
    return img


def generate(n: int, seed: int, chunk: int = 5000) -> tuple[np.ndarray, np.ndarray]:
    """n images (uint8, n x 28 x 28) and labels (uint8, 0-9), the same for the same seed."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 10, n).astype(np.uint8)
    tpl = _templates()
    images = np.empty((n, SIZE, SIZE), dtype=np.uint8)
    for start in range(0, n, chunk):
        part = _render_chunk(labels[start:start + chunk], rng, tpl)
        images[start:start + chunk] = np.round(part * 255).astype(np.uint8)
    return images, labels


def idx_bytes(array: np.ndarray) -> bytes:
    """An unsigned-byte array in the IDX format MNIST uses (magic 0x08 0x0N, big-endian dims)."""
    array = np.ascontiguousarray(array, dtype=np.uint8)
    header = struct.pack(">I", 0x0800 | array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    return header + array.tobytes()


def gzip_bytes(data: bytes) -> bytes:
    """gzip with a fixed timestamp, so the same images always give the same file."""
    buf = io.BytesIO()
    with gzip.GzipFile(fileobj=buf, mode="wb", compresslevel=6, mtime=0) as f:
        f.write(data)
    return buf.getvalue()


def write_raw_folder(raw: Path, splits: dict[str, tuple[np.ndarray, np.ndarray]]) -> None:
    """Write MNIST's four files, .gz and extracted (as torchvision leaves them), atomically."""
    with replaced_folder(raw) as tmp:
        for split, arrays in splits.items():
            for name, array in zip(FILES[split], arrays, strict=True):
                data = idx_bytes(array)
                (tmp / name).write_bytes(data)
                (tmp / f"{name}.gz").write_bytes(gzip_bytes(data))
        (tmp / "VERSION").write_text(f"offline digits v{GENERATOR_VERSION}\n")


def write_offline_digits(raw: Path) -> None:
    """Generate the 60,000 + 10,000 stand-in images and write them into `raw` as MNIST files."""
    write_raw_folder(raw, {"train": generate(N_TRAIN, TRAIN_SEED),
                           "t10k": generate(N_TEST, TEST_SEED)})


def is_current(raw: Path) -> bool:
    """True if `raw` holds the stand-in written by this version of the generator."""
    stamp = Path(raw) / "VERSION"
    return stamp.is_file() and stamp.read_text().strip() == f"offline digits v{GENERATOR_VERSION}"
