"""The embedded captioned image set: coloured shapes at named positions, generated deterministically
(no download), so that ``python -m trainer --model.name flux --flavor debugmodel`` trains anywhere.

Item i is one of 4 colours x 3 shapes x 5 positions (60 captions), drawn on a dark background at
32 x 32 pixels with a small size and offset jitter from a generator seeded by i; its caption names the
colour, the shape and the position ("a red circle at the top left"). ``region(position, size)``
gives the box a position names (tests measure the colour there in generated images).
"""
from __future__ import annotations

import numpy as np

COLORS = {"red": (220, 40, 40), "green": (40, 190, 60), "blue": (50, 90, 235), "yellow": (235, 215, 40)}
SHAPES = ("square", "circle", "triangle")
POSITIONS = ("top left", "top right", "bottom left", "bottom right", "center")
BACKGROUND = (24, 24, 24)
NATIVE = 32


def region(position: str, size: int) -> tuple[int, int, int, int]:
    """(top, left, bottom, right) pixel box of ``position`` on a size x size image: a quadrant, or the
    central half for ``center``."""
    h, q = size // 2, size // 4
    return {"top left": (0, 0, h, h), "top right": (0, h, h, size), "bottom left": (h, 0, size, h),
            "bottom right": (h, h, size, size), "center": (q, q, 3 * q, 3 * q)}[position]


def attributes(index: int) -> tuple[str, str, str]:
    """(colour, shape, position) of item ``index``: every combination once per 60 items, in a mixed order."""
    k = (index * 37) % 60  # 37 is prime to 60: a permutation of the combinations
    return list(COLORS)[k % 4], SHAPES[(k // 4) % 3], POSITIONS[k // 12]


def caption(index: int) -> str:
    color, shape, position = attributes(index)
    where = "in the center" if position == "center" else f"at the {position}"
    return f"a {color} {shape} {where}"


def draw(index: int, size: int = NATIVE) -> np.ndarray:
    """Item ``index`` as (size, size, 3) uint8 RGB."""
    color, shape, position = attributes(index)
    rng = np.random.default_rng(index)
    img = np.empty((size, size, 3), dtype=np.uint8)
    img[:] = BACKGROUND
    top, left, bottom, right = region(position, size)
    box = bottom - top
    r = box * (0.28 + 0.1 * rng.random())  # half-size of the shape
    cy = (top + bottom) / 2 + (rng.random() - 0.5) * box * 0.2
    cx = (left + right) / 2 + (rng.random() - 0.5) * box * 0.2
    yy, xx = np.mgrid[0:size, 0:size] + 0.5
    if shape == "square":
        mask = (np.abs(yy - cy) <= r) & (np.abs(xx - cx) <= r)
    elif shape == "circle":
        mask = (yy - cy) ** 2 + (xx - cx) ** 2 <= r * r
    else:  # an upward triangle: apex at the top, base at the bottom of its box
        rel = (yy - (cy - r)) / (2 * r)
        mask = (rel >= 0) & (rel <= 1) & (np.abs(xx - cx) <= rel * r)
    img[mask] = COLORS[color]
    return img


class ShapesSource:
    """``n`` items of the embedded set: ``len``, ``item(i) -> ((size, size, 3) uint8, caption)``, ``name``."""

    def __init__(self, n: int = 600, size: int = NATIVE) -> None:
        self.n, self.size = n, size
        self.name = f"shapes ({n} embedded captioned images)"

    def __len__(self) -> int:
        return self.n

    def key(self, i: int) -> str:
        return f"shapes-{i}"

    def item(self, i: int) -> tuple[np.ndarray, str]:
        return draw(i, self.size), caption(i)
