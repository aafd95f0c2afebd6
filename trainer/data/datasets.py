"""Document sources: the embedded English corpus, local files and Hugging Face datasets.

A source is an ordered, finite sequence of documents (plain strings) that can be read from any
document index: ``iter_from(i)`` yields documents ``i, i+1, ...`` up to the end of one epoch. The
order is fixed (no shuffling), so a source read twice gives the same documents; the loader counts
epochs and remembers the index to resume from. An empty string is a valid document with no text.

* ``pydoc`` (:class:`EmbeddedCorpus`): real English text that every CPython installation carries,
  assembled at run time without a download: the reference-manual topics behind ``help()``
  (``pydoc_data.topics``) and the docstrings of the standard library's modules, read from their
  source with ``ast`` (nothing is imported). One document per topic and per module.
* local files (:class:`LocalFiles`): ``.txt`` files are split into documents at blank lines
  (a paragraph, a speech or a stanza is one document); ``.jsonl`` gives one document per line from
  its ``"text"`` field; ``.parquet`` one per row of its ``"text"`` column. A folder is read
  recursively in sorted path order; other files in it are ignored.
* Hugging Face datasets by name (:class:`HuggingFaceDataset`): ``c4`` streams ``allenai/c4``
  (``en``); any other ``owner/name`` or ``owner/name:config`` streams that dataset's train split.
  This needs the ``datasets`` package and the network; without either it fails at once with a
  RuntimeError that says so (the hub is probed with a short timeout, so nothing hangs).
"""
from __future__ import annotations

import ast
import codecs
import difflib
import json
import os
import pathlib
import platform
import random
import re
import socket
import sysconfig
import urllib.parse
from typing import Iterator

LOCAL_SUFFIXES = (".txt", ".jsonl", ".parquet")

# Short names for Hugging Face datasets: name -> (path, config).
HF_ALIASES = {"c4": ("allenai/c4", "en")}
# Names of sample data shipped with the trainer (torchtitan's debug dataset c4_test: C4's layout, public-domain
# text; scripts/make_c4_test.py writes it).
SAMPLES = {"c4_test": pathlib.Path(__file__).resolve().parent / "samples" / "c4_test.jsonl"}


class DocumentSource:
    """An ordered sequence of text documents, readable from any index. ``name`` identifies it."""

    name: str

    def iter_from(self, start: int) -> Iterator[str]:
        """Documents ``start, start+1, ...`` to the end of the source (one epoch)."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


# ----------------------------------------------------------------------------------------------
# The embedded corpus


class EmbeddedCorpus(DocumentSource):
    """Real English text shipped with CPython: ``help()`` topics and standard-library docstrings.

    Units (a topic or a module file) are listed cheaply up front; a unit's text is assembled only
    when it is read. Their order is a fixed shuffle (seed 0, independent of the training seed) so
    that topics and modules of every kind are interleaved from the first batch on. About 2 MB of
    text on CPython 3.11; the exact text depends on the Python version that runs it.
    """

    # The text depends on the Python version, so the name (kept in the loader state) records it.
    name = f"pydoc (Python {platform.python_version()})"
    # Folders of the standard library whose docstrings are not prose (tests, generated codec
    # tables, vendored wheels, demos) are left out.
    _SKIP_PARTS = frozenset(
        {"test", "tests", "idle_test", "encodings", "ensurepip", "turtledemo", "site-packages",
         "dist-packages", "__pycache__", "lib2to3", "idlelib", "pydoc_data"}
    )

    def __init__(self) -> None:
        try:
            from pydoc_data.topics import topics
        except ImportError:  # some distributions ship pydoc_data separately
            topics = {}
        self._topics = topics
        units: list[tuple[str, str]] = [("topic", key) for key in sorted(topics)]
        stdlib = sysconfig.get_paths().get("stdlib")
        self._stdlib = pathlib.Path(stdlib) if stdlib else None
        if self._stdlib is not None and self._stdlib.is_dir():
            units += [("module", f) for f in self._module_files(self._stdlib)]
        if not units:
            raise RuntimeError(
                "training.dataset='pydoc': this Python has neither pydoc_data.topics nor standard-library "
                "sources to build the embedded corpus from; use --training.dataset_path with a text file"
            )
        random.Random(0).shuffle(units)
        self._units = units

    def __len__(self) -> int:
        return len(self._units)

    @classmethod
    def _module_files(cls, root: pathlib.Path) -> list[str]:
        """Relative paths of the standard library's .py files, sorted; skipped folders are not entered."""
        files = []
        for folder, subdirs, names in os.walk(root):
            subdirs[:] = [d for d in subdirs if d not in cls._SKIP_PARTS]
            rel = pathlib.Path(folder).relative_to(root)
            files += [str(rel / n) for n in names if n.endswith(".py")]
        return sorted(files)

    def iter_from(self, start: int) -> Iterator[str]:
        for kind, key in self._units[start:]:
            yield self._topics[key].strip() if kind == "topic" else self._module_text(key)

    def _module_text(self, relpath: str) -> str:
        """The docstrings of one module (module, classes, functions) in source order, blank-line separated."""
        try:
            tree = ast.parse((self._stdlib / relpath).read_bytes())
        except (SyntaxError, ValueError, OSError):
            return ""  # a file this Python cannot parse contributes nothing
        nodes = [n for n in ast.walk(tree) if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]
        nodes.sort(key=lambda n: getattr(n, "lineno", 0))
        docs = (ast.get_docstring(n) for n in nodes)
        return "\n\n".join(d.strip() for d in docs if d and d.strip())


# ----------------------------------------------------------------------------------------------
# Local files

_BLANK_LINES = re.compile(r"\n[ \t\r\f\v]*\n\s*")


class LocalFiles(DocumentSource):
    """``.txt`` / ``.jsonl`` / ``.parquet`` files, or a folder of them (recursive, sorted by path)."""

    def __init__(self, path: str | pathlib.Path, key: str = "training.dataset_path") -> None:
        root = pathlib.Path(path).expanduser()
        self._key = key
        if root.is_file():
            if root.suffix not in LOCAL_SUFFIXES:
                raise ValueError(
                    f"{key}: {str(root)!r} has suffix {root.suffix!r}; expected one of "
                    f"{', '.join(LOCAL_SUFFIXES)}"
                )
            files = [root]
        elif root.is_dir():
            files = sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in LOCAL_SUFFIXES)
            if not files:
                raise ValueError(
                    f"{key}: folder {str(root)!r} holds no {', '.join(LOCAL_SUFFIXES)} files"
                )
        else:
            raise ValueError(f"{key}: no such file or folder: {str(root)!r}")
        for f in files:
            if f.suffix != ".parquet":
                _sniff_text(f, key)
        self.name = f"files:{root.resolve()}"
        self._files = files
        self._counts: dict[pathlib.Path, int] = {}  # documents per file, learned on first read

    def iter_from(self, start: int) -> Iterator[str]:
        index = 0
        for f in self._files:
            n = self._counts.get(f)
            if n is None and f.suffix == ".parquet":
                n = self._counts[f] = _parquet_rows(f)
            if n is not None and index + n <= start:  # skip a whole file without reading it
                index += n
                continue
            count = 0
            for doc in self._read(f):
                if index >= start:
                    yield doc
                index += 1
                count += 1
            self._counts[f] = count

    def _read(self, f: pathlib.Path) -> Iterator[str]:
        key = self._key
        if f.suffix == ".txt":
            # Universal newlines, as text mode reads them: \r\n and \r are \n.
            text = decode_text(f.read_bytes(), f, key).replace("\r\n", "\n").replace("\r", "\n")
            for doc in _BLANK_LINES.split(text):
                doc = doc.strip("\n")
                if doc.strip():
                    yield doc
        elif f.suffix == ".jsonl":
            with open(f, "rb") as fh:
                offset = 0
                for lineno, raw in enumerate(fh, 1):
                    line = decode_text(raw, f, key, offset)
                    offset += len(raw)
                    if not line.strip():
                        continue
                    try:
                        obj = json.loads(line)
                    except json.JSONDecodeError as exc:
                        raise ValueError(f"{key}: {f}:{lineno} is not valid JSON ({exc})") from None
                    if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
                        keys = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
                        raise ValueError(
                            f"{key}: {f}:{lineno}: expected an object with a string 'text' field, got {keys}"
                        )
                    yield obj["text"]
        else:
            import pyarrow.parquet as pq

            pf = pq.ParquetFile(f)
            if "text" not in pf.schema_arrow.names:
                raise ValueError(
                    f"{key}: {f}: expected a 'text' column, got columns {pf.schema_arrow.names}"
                )
            for batch in pf.iter_batches(columns=["text"], batch_size=1024):
                for value in batch.column(0).to_pylist():
                    yield value or ""


# How much of each .txt / .jsonl file is checked when the source is built, before any model: a
# binary file (a NUL byte) or one in another encoding shows itself within its first megabyte; the
# rest is checked as it is read. Reading 1 MiB costs about a millisecond per file.
SNIFF_BYTES = 1 << 20
_BOMS = {b"\xff\xfe\x00\x00": "UTF-32 (little-endian)", b"\x00\x00\xfe\xff": "UTF-32 (big-endian)",
         b"\xff\xfe": "UTF-16 (little-endian)", b"\xfe\xff": "UTF-16 (big-endian)"}  # longest first


def decode_text(data: bytes, path: pathlib.Path, key: str = "training.dataset_path", offset: int = 0,
                final: bool = True) -> str:
    """``data`` (bytes ``offset...`` of ``path``) as UTF-8 text; ValueError naming the file and byte offset
    for a NUL byte (a binary file) or bytes that are not UTF-8, instead of training on garbage.
    ``final=False``: ``data`` may end inside a multi-byte character (a file's first bytes only)."""
    bom = next((b for b in _BOMS if data.startswith(b)), None) if offset == 0 else None
    if bom is not None:  # a byte order mark: text, in an encoding we do not read
        enc = _BOMS[bom]
        raise ValueError(f"{key}: {path} is {enc} text (a byte order mark at byte offset 0); expected UTF-8: "
                         f"convert it (e.g. iconv -f {enc.split()[0].lower()} -t utf-8)")
    nul = data.find(b"\x00")
    if nul != -1:
        raise ValueError(
            f"{key}: {path} is not a text file: a NUL byte at byte offset {offset + nul} (binary data?); "
            f"expected UTF-8 text"
        )
    try:
        return codecs.getincrementaldecoder("utf-8")().decode(data, final=final)
    except UnicodeDecodeError as exc:
        raise ValueError(
            f"{key}: {path} is not UTF-8 text: byte 0x{data[exc.start]:02x} at byte offset {offset + exc.start} "
            f"({exc.reason}); convert it to UTF-8 (e.g. iconv -t utf-8)"
        ) from None


def _sniff_text(path: pathlib.Path, key: str) -> None:
    """Refuse at once a .txt/.jsonl file whose first ``SNIFF_BYTES`` are not UTF-8 text (see
    ``decode_text``); the rest of the file is checked when it is read."""
    with open(path, "rb") as fh:
        head = fh.read(SNIFF_BYTES)
    decode_text(head, path, key, final=len(head) < SNIFF_BYTES)


def _parquet_rows(f: pathlib.Path) -> int:
    import pyarrow.parquet as pq

    return pq.ParquetFile(f).metadata.num_rows


# ----------------------------------------------------------------------------------------------
# Hugging Face datasets


class HuggingFaceDataset(DocumentSource):
    """A Hugging Face dataset streamed by the ``datasets`` package (``text`` field)."""

    def __init__(self, name: str, probe_timeout_s: float = 3.0) -> None:
        self.name = f"hf:{name}"
        if name in HF_ALIASES:
            self._path, self._config = HF_ALIASES[name]
        else:
            self._path, _, config = name.partition(":")
            self._config = config or None
        try:
            import datasets  # noqa: F401
        except ImportError:
            raise RuntimeError(
                f"training.dataset={name!r} streams {self._path} from the Hugging Face hub, which needs the "
                f"'datasets' package (pip install 'titan-kernels[hf]') and network access; offline, use the "
                f"default embedded corpus (--training.dataset pydoc) or --training.dataset_path FILE"
            ) from None
        check_hub_reachable(name, probe_timeout_s)
        self._dataset = None

    def _stream(self):
        if self._dataset is None:
            import datasets

            self._dataset = datasets.load_dataset(self._path, name=self._config, split="train", streaming=True)
        return self._dataset

    def iter_from(self, start: int) -> Iterator[str]:
        ds = self._stream()
        for row in (ds.skip(start) if start else ds):
            if "text" not in row:
                raise ValueError(f"training.dataset={self.name[3:]!r}: expected a 'text' field, got fields {sorted(row)}")
            yield row["text"] or ""


def check_hub_reachable(name: str, timeout_s: float = 3.0) -> None:
    """Raise RuntimeError at once if the Hugging Face hub cannot be reached (offline machine).

    Without this the ``datasets`` package may wait on network time-outs and retries for minutes.
    With ``HF_DATASETS_OFFLINE``/``HF_HUB_OFFLINE`` set, only the local cache can serve the data,
    which the library checks itself; behind an HTTP(S) proxy the direct probe is skipped.
    """
    if os.environ.get("HF_DATASETS_OFFLINE") == "1" or os.environ.get("HF_HUB_OFFLINE") == "1":
        return
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    url = urllib.parse.urlsplit(endpoint)
    host = url.hostname or "huggingface.co"
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            pass
    except OSError as exc:
        raise RuntimeError(
            f"training.dataset={name!r} needs the Hugging Face hub, but {host}:{port} cannot be reached "
            f"({exc.__class__.__name__}: {exc}); offline, use the default embedded corpus "
            f"(--training.dataset pydoc) or --training.dataset_path FILE"
        ) from None


# ----------------------------------------------------------------------------------------------


def build_source(dataset: str, dataset_path: str = "", section: str = "training") -> DocumentSource:
    """The document source for ``training.dataset`` / ``training.dataset_path`` (the path wins).

    ``section`` names the config section in error messages (``validation`` for its own dataset).

    Raises:
        ValueError: an unknown dataset name (with the closest known one), a bad local path, or a
            local text file that is not UTF-8 text (naming the file and the byte offset).
        RuntimeError: a Hugging Face dataset without the ``datasets`` package or the network.
    """
    if dataset_path:
        return LocalFiles(dataset_path, key=f"{section}.dataset_path")
    if dataset == "pydoc":
        return EmbeddedCorpus()
    if dataset in SAMPLES:
        return LocalFiles(SAMPLES[dataset], key=f"{section}.dataset")
    if dataset in HF_ALIASES or "/" in dataset:
        return HuggingFaceDataset(dataset)
    known = ["pydoc", *SAMPLES, *HF_ALIASES]
    hint = difflib.get_close_matches(dataset, known, n=1)
    raise ValueError(
        f"{section}.dataset: unknown dataset {dataset!r}; expected one of {', '.join(known)} or a Hugging Face "
        f"id 'owner/name[:config]'" + (f" (did you mean {hint[0]!r}?)" if hint else "")
    )
