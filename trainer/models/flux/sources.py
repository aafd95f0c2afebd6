"""Captioned image sources on disk, for Flux training: a folder of images with ``.txt`` captions, a
JSONL or Parquet manifest, or WebDataset tar shards (as cc12m is distributed).

Every source has ``len``, ``item(i) -> ((H, W, 3) uint8 RGB, caption)``, ``key(i)`` (a stable name
of item i, for the encode cache) and ``name``. A file that is not an image, an image without its
caption or a malformed manifest line raises ValueError in one line naming the file (and the line).
``preprocess`` resizes (shorter side) and center-crops to the run's resolution, to [-1, 1].
"""
from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import numpy as np
import torch

IMAGE_EXTS = (".jpg", ".jpeg", ".png", ".webp", ".bmp")
CAPTION_KEYS = ("caption", "text", "prompt")


def pil():
    """The PIL package; raises RuntimeError (one line) without it."""
    try:
        import PIL.Image
    except ImportError:
        raise RuntimeError("Flux's image files need the pillow package: pip install pillow") from None
    return PIL


def _decode(data: bytes | str | Path, where: str) -> np.ndarray:
    pil()
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data) if isinstance(data, bytes) else data) as im:
            return np.asarray(im.convert("RGB"))
    except (UnidentifiedImageError, OSError, ValueError) as exc:
        raise ValueError(f"{where}: not a readable image ({type(exc).__name__})") from None


def _caption(record: dict, where: str) -> str:
    for key in CAPTION_KEYS:
        if isinstance(record.get(key), str):
            return record[key]
    raise ValueError(f"{where}: no caption (expected a string field {', '.join(CAPTION_KEYS)})")


class ImageFolder:
    """Images (``IMAGE_EXTS``) under a folder, each with its caption in ``<stem>.txt`` beside it;
    other files (but hidden ones, ``.json`` and ``.txt``) are refused."""

    def __init__(self, root: Path) -> None:
        self.root = root
        files = sorted(p for p in root.rglob("*") if p.is_file() and not p.name.startswith("."))
        self.images = []
        for p in files:
            ext = p.suffix.lower()
            if ext in IMAGE_EXTS:
                if not p.with_suffix(".txt").is_file():
                    raise ValueError(f"{p}: no caption file {p.with_suffix('.txt').name} beside the image")
                self.images.append(p)
            elif ext not in (".txt", ".json"):
                raise ValueError(f"{p}: not an image ({', '.join(IMAGE_EXTS)}) or a caption (.txt)")
        self.name = f"{root} ({len(self.images)} captioned images)"

    def __len__(self) -> int:
        return len(self.images)

    def key(self, i: int) -> str:
        return str(self.images[i].relative_to(self.root))

    def item(self, i: int) -> tuple[np.ndarray, str]:
        p = self.images[i]
        try:
            caption = p.with_suffix(".txt").read_text(encoding="utf-8").strip()
        except UnicodeDecodeError as exc:  # the message alone named no file
            raise ValueError(f"{p.with_suffix('.txt')}: not UTF-8 text (byte {exc.start})") from None
        return _decode(p, str(p)), caption


class JsonlManifest:
    """One JSON object per line: ``image`` (a path relative to the manifest) and a caption field."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.records = []
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            where = f"{path}:{n}"
            try:
                rec = json.loads(line)
            except ValueError:
                raise ValueError(f"{where}: not a JSON object") from None
            if not isinstance(rec, dict) or not isinstance(rec.get("image"), str):
                raise ValueError(f"{where}: expected an object with an 'image' path")
            self.records.append((rec["image"], _caption(rec, where), where))
        self.name = f"{path} ({len(self.records)} captioned images)"

    def __len__(self) -> int:
        return len(self.records)

    def key(self, i: int) -> str:
        return self.records[i][0]

    def item(self, i: int) -> tuple[np.ndarray, str]:
        image, cap, where = self.records[i]
        p = (self.path.parent / image)
        if not p.is_file():
            raise ValueError(f"{where}: image {p} does not exist")
        return _decode(p, str(p)), cap


class ParquetManifest:
    """A Parquet table: an ``image`` column (encoded bytes, or a struct with ``bytes``) and a caption column."""

    def __init__(self, path: Path) -> None:
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(path)
        except Exception as exc:  # pyarrow raises its own types for a non-Parquet file
            raise ValueError(f"{path}: not a Parquet file ({type(exc).__name__})") from None
        cols = table.column_names
        cap = next((c for c in CAPTION_KEYS if c in cols), None)
        if "image" not in cols or cap is None:
            raise ValueError(f"{path}: expected an 'image' column and one of {', '.join(CAPTION_KEYS)}; got {cols}")
        self.path, self.images, self.captions = path, table.column("image").to_pylist(), table.column(cap).to_pylist()
        self.name = f"{path} ({len(self.images)} captioned images)"

    def __len__(self) -> int:
        return len(self.images)

    def key(self, i: int) -> str:
        return f"row-{i}"

    def item(self, i: int) -> tuple[np.ndarray, str]:
        data = self.images[i]
        if isinstance(data, dict):
            data = data.get("bytes")
        where = f"{self.path} row {i}"
        if not isinstance(data, bytes):
            raise ValueError(f"{where}: the image is not encoded bytes")
        if not isinstance(self.captions[i], str):
            raise ValueError(f"{where}: the caption is not a string")
        return _decode(data, where), self.captions[i]


class WebDataset:
    """WebDataset tar shards: members grouped by key (the name before its first dot), each sample an
    image member and a ``.txt`` caption (or a ``.json`` with a caption field)."""

    def __init__(self, shards: list[Path]) -> None:
        self.samples: list[tuple[Path, str, str, str | None]] = []  # shard, key, image member, caption member
        for shard in shards:
            try:
                with tarfile.open(shard) as tar:
                    members = [m.name for m in tar.getmembers() if m.isfile()]
            except (tarfile.TarError, OSError) as exc:
                raise ValueError(f"{shard}: not a tar shard ({exc})") from None
            groups: dict[str, dict[str, str]] = {}
            for name in members:
                base = name.rsplit("/", 1)[-1]
                if base.startswith("."):
                    continue
                stem, _, ext = base.partition(".")
                groups.setdefault(name[:len(name) - len(base)] + stem, {})["." + ext.lower()] = name
            for key, files in sorted(groups.items()):
                image = next((files[e] for e in IMAGE_EXTS if e in files), None)
                if image is None:
                    raise ValueError(f"{shard}: sample {key} has no image member ({', '.join(sorted(files))})")
                cap = files.get(".txt") or files.get(".json")
                if cap is None:
                    raise ValueError(f"{shard}: sample {key} has no caption member ({key}.txt or {key}.json)")
                self.samples.append((shard, key, image, cap))
        self.name = f"{shards[0].parent} ({len(shards)} shards, {len(self.samples)} captioned images)"
        self._open: dict[Path, tarfile.TarFile] = {}

    def __len__(self) -> int:
        return len(self.samples)

    def key(self, i: int) -> str:
        return f"{self.samples[i][0].name}/{self.samples[i][1]}"

    def item(self, i: int) -> tuple[np.ndarray, str]:
        shard, key, image, cap = self.samples[i]
        tar = self._open.get(shard) or self._open.setdefault(shard, tarfile.open(shard))
        where = f"{shard}:{image}"
        img = _decode(tar.extractfile(image).read(), where)
        text = tar.extractfile(cap).read().decode("utf-8")
        if cap.endswith(".json"):
            try:
                text = _caption(json.loads(text), f"{shard}:{cap}")
            except json.JSONDecodeError:
                raise ValueError(f"{shard}:{cap}: not a JSON object") from None
        return img, text.strip()


def open_source(path: str):
    """The source at ``path``: a folder of tar shards (WebDataset) or of images, a ``.tar`` shard, a
    ``.jsonl`` or ``.parquet`` manifest. Raises ValueError naming the path for anything else or an
    empty source."""
    p = Path(path).expanduser()
    if p.is_dir():
        shards = sorted(p.glob("*.tar"))
        src = WebDataset(shards) if shards else ImageFolder(p)
    elif p.suffix == ".tar":
        src = WebDataset([p])
    elif p.suffix == ".jsonl":
        src = JsonlManifest(p)
    elif p.suffix == ".parquet":
        src = ParquetManifest(p)
    else:
        raise ValueError(f"{p}: expected a folder of captioned images or tar shards, a .tar, .jsonl or .parquet file")
    if len(src) == 0:
        raise ValueError(f"{p}: holds no captioned image")
    return src


def preprocess(img: np.ndarray, size: int) -> torch.Tensor:
    """(H, W, 3) uint8 -> (3, size, size) float32 in [-1, 1]: the shorter side resized to ``size``
    (bicubic, antialiased; as-is when it already is), then the center ``size`` x ``size`` crop."""
    t = torch.from_numpy(np.ascontiguousarray(img)).permute(2, 0, 1).float() / 127.5 - 1
    h, w = t.shape[1:]
    if min(h, w) != size:
        scale = size / min(h, w)
        nh, nw = max(size, round(h * scale)), max(size, round(w * scale))
        t = torch.nn.functional.interpolate(t[None], size=(nh, nw), mode="bicubic", antialias=True,
                                            align_corners=False)[0].clamp(-1, 1)
        h, w = nh, nw
    top, left = (h - size) // 2, (w - size) // 2
    return t[:, top:top + size, left:left + size].contiguous()
