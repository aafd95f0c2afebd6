"""Tokenizers: Hugging Face ``tokenizer.json``, tiktoken BPE files, SentencePiece models, raw bytes.

:func:`build_tokenizer` detects the kind from the file's content, not its name:

* a JSON file (or a folder holding ``tokenizer.json``): the Hugging Face ``tokenizers`` library;
* a text file of ``<base64 token> <rank>`` lines, as Llama 3's ``tokenizer.model``: ``tiktoken``
  with Llama 3's pre-tokenizer pattern and its 256 special tokens appended after the ranks;
* a SentencePiece protobuf ``.model`` (Llama 2 style): ``sentencepiece``;
* no path: the built-in byte-level tokenizer (UTF-8 bytes 0-255, BOS 256, EOS 257, vocab 258).

Every tokenizer must be lossless: ``decode(encode(text)) == text``. Each file-based tokenizer is
probed with a short text when it is built, and a lossy one raises ``ValueError`` instead of silently
training on mangled text. One case is repaired rather than refused: a ``tokenizer.json`` whose BPE
vocabulary is a ranked byte-level list (ids 0-255 are the single bytes, written raw or as ``\\xNN``)
with no merges. The ``tokenizers`` library cannot apply such a file (it drops every byte it has no
entry for, e.g. spaces), but its ranks fully define a byte-level BPE, which tiktoken applies exactly.
"""
from __future__ import annotations

import base64
import hashlib
import json
import pathlib
import re
from typing import Sequence

import numpy as np

# Llama 3's pre-tokenizer split pattern (Meta's llama3 reference tokenizer, tokenizer.py).
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Llama 3.1's special tokens, appended after the BPE ranks (ids 128000-128255 for the real model).
_LLAMA3_NAMED_SPECIALS = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>",
    "<|finetune_right_pad_id|>",
    "<|step_id|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eom_id|>",
    "<|eot_id|>",
    "<|python_tag|>",
)
LLAMA3_NUM_SPECIAL_TOKENS = 256
LLAMA3_SPECIAL_TOKENS = _LLAMA3_NAMED_SPECIALS + tuple(
    f"<|reserved_special_token_{2 + i}|>" for i in range(LLAMA3_NUM_SPECIAL_TOKENS - len(_LLAMA3_NAMED_SPECIALS))
)

# Names under which tokenizers commonly store their document-start / document-end tokens.
_BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>", "<|im_start|>")
_EOS_NAMES = ("<|end_of_text|>", "</s>", "<eos>", "<|endoftext|>", "<|im_end|>")

# A short text every tokenizer must reproduce exactly: spaces, a tab, newlines, digits, punctuation,
# capitals and non-ASCII letters.
_PROBE_TEXT = "Hello world. It's 2024, and 3 + 4 = 7!\n\tIndented line: naïve café, Ünïcödé; done.\n"


class Tokenizer:
    """Text <-> token ids. Subclasses set ``vocab_size``, ``bos_id``, ``eos_id`` and ``name``.

    Attributes:
        vocab_size: the embedding size the model needs (every id, special tokens included).
        bos_id / eos_id: the ids joined around each document by the loader.
        name: the kind and source file, recorded in the loader state to refuse a mismatched resume.
    """

    vocab_size: int
    bos_id: int
    eos_id: int
    name: str

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; no BOS/EOS added; special-token strings in ``text`` are plain text."""
        raise NotImplementedError

    def decode(self, ids: Sequence[int]) -> str:
        """The text of ``ids`` (special tokens, if any, rendered as their names)."""
        raise NotImplementedError

    def encode_array(self, text: str) -> np.ndarray:
        """``encode`` as an int32 numpy array (the loader's hot path; subclasses may do it faster)."""
        return np.asarray(self.encode(text), dtype=np.int32)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name}, vocab_size={self.vocab_size}, bos={self.bos_id}, eos={self.eos_id})"


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as ids 0-255, BOS = 256, EOS = 257; vocab_size 258. Needs no file."""

    def __init__(self) -> None:
        self.vocab_size = 258
        self.bos_id = 256
        self.eos_id = 257
        self.name = "bytes"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_array(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

    def decode(self, ids: Sequence[int]) -> str:
        # BOS/EOS have no text; invalid UTF-8 (a window cut inside a character) becomes U+FFFD.
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


class HFTokenizer(Tokenizer):
    """A Hugging Face ``tokenizer.json`` applied by the ``tokenizers`` library."""

    def __init__(self, tok, path: pathlib.Path, bos: str, eos: str) -> None:
        self._tok = tok
        # Special-token strings inside training text stay text (no injected BOS/EOS from data).
        tok.encode_special_tokens = True
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        self.bos_id = tok.token_to_id(bos)
        self.eos_id = tok.token_to_id(eos)
        self.name = _file_name("tokenizer.json", path)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


class TiktokenTokenizer(Tokenizer):
    """A byte-level BPE given by ranks, applied by ``tiktoken`` (Llama 3's tokenizer)."""

    def __init__(self, ranks: dict[bytes, int], special_tokens: dict[str, int], bos: str, eos: str,
                 name: str, pattern: str = LLAMA3_PATTERN) -> None:
        import tiktoken

        self._enc = tiktoken.Encoding(
            name=f"titan-{len(ranks)}", pat_str=pattern, mergeable_ranks=ranks, special_tokens=special_tokens
        )
        self.vocab_size = max(max(ranks.values()), max(special_tokens.values(), default=-1)) + 1
        # kept for the Hugging Face export (trainer.hf.tokenizer_files), which writes them as a tokenizer.json
        self.ranks, self.special_tokens, self.pattern = ranks, special_tokens, pattern
        self.bos_id = special_tokens[bos]
        self.eos_id = special_tokens[eos]
        self.name = name

    def encode(self, text: str) -> list[int]:
        return self._enc.encode_ordinary(text)

    def decode(self, ids: Sequence[int]) -> str:
        return self._enc.decode([int(i) for i in ids], errors="replace")


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece ``.model`` (protobuf), applied by ``sentencepiece``."""

    def __init__(self, sp, path: pathlib.Path) -> None:
        self._sp = sp
        self.vocab_size = sp.get_piece_size()
        self.bos_id = sp.bos_id()
        self.eos_id = sp.eos_id()
        self.name = _file_name("sentencepiece", path)
        if self.bos_id < 0 or self.eos_id < 0:
            raise ValueError(
                f"model.tokenizer_path: SentencePiece model {str(path)!r} has no BOS/EOS "
                f"(bos_id={self.bos_id}, eos_id={self.eos_id}); expected both, as documents are joined with them"
            )

    def encode(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        return self._sp.decode([int(i) for i in ids])


# ----------------------------------------------------------------------------------------------


def _file_name(kind: str, path: pathlib.Path) -> str:
    """``kind file sha1:...``: names the tokenizer by its content, so a moved file still matches on resume."""
    digest = hashlib.sha1(path.read_bytes()).hexdigest()[:12]
    return f"{kind} {path.name} sha1:{digest}"


def build_tokenizer(path: str | pathlib.Path | None) -> Tokenizer:
    """The tokenizer stored at ``path`` (kind detected from the content), or the byte-level one.

    Args:
        path: ``None`` or ``""`` for :class:`ByteTokenizer`; a ``tokenizer.json``; a tiktoken BPE
            file (``<base64 token> <rank>`` per line, e.g. Llama 3's ``tokenizer.model``); a
            SentencePiece ``.model``; or a folder holding ``tokenizer.json`` or ``tokenizer.model``.

    Raises:
        ValueError: no such file; a file of none of these kinds; a tokenizer without BOS/EOS
            tokens; or one that does not reproduce text exactly (``decode(encode(t)) != t``).
    """
    if path is None or str(path) == "":
        return ByteTokenizer()
    path = pathlib.Path(path).expanduser()
    if path.is_dir():
        for candidate in ("tokenizer.json", "tokenizer.model"):
            if (path / candidate).is_file():
                path = path / candidate
                break
        else:
            raise ValueError(
                f"model.tokenizer_path: folder {str(path)!r} holds neither tokenizer.json nor tokenizer.model"
            )
    if not path.is_file():
        raise ValueError(f"model.tokenizer_path: no such file: {str(path)!r}")
    head = path.read_bytes()[:4096]
    if head.lstrip().startswith(b"{"):
        tokenizer = _load_hf_json(path)
    elif _looks_like_tiktoken(head):
        tokenizer = _load_tiktoken_file(path)
    else:
        tokenizer = _load_sentencepiece(path)
    _check_lossless(tokenizer, path)
    return tokenizer


def _check_lossless(tokenizer: Tokenizer, path: pathlib.Path) -> None:
    ids = tokenizer.encode(_PROBE_TEXT)
    back = tokenizer.decode(ids)
    if back != _PROBE_TEXT:
        raise ValueError(
            f"model.tokenizer_path: {tokenizer.name} does not reproduce text: {_PROBE_TEXT!r} decodes back "
            f"as {back!r}; expected a lossless tokenizer (byte-level BPE, or SentencePiece with byte_fallback "
            f"and the 'identity' normalization)"
        )


_TIKTOKEN_LINE = re.compile(rb"^[A-Za-z0-9+/]+={0,2} \d+$")


def _looks_like_tiktoken(head: bytes) -> bool:
    first = head.split(b"\n", 1)[0].strip()
    return bool(_TIKTOKEN_LINE.match(first))


def _read_tiktoken_ranks(path: pathlib.Path) -> dict[bytes, int]:
    # Parsed here rather than with tiktoken.load.load_tiktoken_bpe, which caches local files in a
    # temp folder keyed by path only (a changed file at the same path would be served stale).
    ranks: dict[bytes, int] = {}
    for lineno, line in enumerate(path.read_bytes().splitlines(), 1):
        if not line.strip():
            continue
        parts = line.split()
        try:
            token, rank = base64.b64decode(parts[0], validate=True), int(parts[1])
            if len(parts) != 2:
                raise ValueError
        except (ValueError, IndexError):
            raise ValueError(
                f"model.tokenizer_path: {str(path)!r} line {lineno}: expected '<base64 token> <rank>', "
                f"got {line[:80]!r}"
            ) from None
        ranks[token] = rank
    return ranks


def _load_tiktoken_file(path: pathlib.Path) -> TiktokenTokenizer:
    ranks = _read_tiktoken_ranks(path)
    _check_byte_coverage(ranks, path)
    n = max(ranks.values()) + 1
    specials = {tok: n + i for i, tok in enumerate(LLAMA3_SPECIAL_TOKENS)}
    return TiktokenTokenizer(ranks, specials, "<|begin_of_text|>", "<|end_of_text|>", name=_file_name("tiktoken", path))


def _check_byte_coverage(ranks: dict[bytes, int], path: pathlib.Path) -> None:
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise ValueError(
            f"model.tokenizer_path: {str(path)!r} lacks {len(missing)} of the 256 single-byte tokens "
            f"(e.g. byte {missing[0]}); expected a byte-level BPE that can encode any text"
        )


def _load_sentencepiece(path: pathlib.Path) -> SentencePieceTokenizer:
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor()
    try:
        sp.Load(str(path))
    except (OSError, RuntimeError) as exc:
        raise ValueError(
            f"model.tokenizer_path: {str(path)!r} is neither a tokenizer.json, a tiktoken BPE file nor a "
            f"SentencePiece model ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})"
        ) from None
    return SentencePieceTokenizer(sp, path)


def _special_names(path: pathlib.Path, data: dict) -> tuple[str | None, str | None, set[str]]:
    """BOS name, EOS name and the set of special-token strings of a tokenizer.json.

    They come from the ``added_tokens`` of the file and, where present, the ``tokenizer_config.json``
    next to it (Hugging Face keeps ``bos_token``/``eos_token`` there).
    """
    specials = {t["content"] for t in data.get("added_tokens", []) if t.get("special", False)}
    bos = eos = None
    config_path = path.parent / "tokenizer_config.json"
    if config_path.is_file():
        try:
            cfg = json.loads(config_path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"model.tokenizer_path: {str(config_path)!r} is not valid JSON ({exc})") from None

        def content(v):
            return v.get("content") if isinstance(v, dict) else v

        bos, eos = content(cfg.get("bos_token")), content(cfg.get("eos_token"))
        for entry in (cfg.get("added_tokens_decoder") or {}).values():
            if entry.get("special", False):
                specials.add(entry["content"])
    return bos, eos, specials


def _pick(names: Sequence[str], vocab: dict[str, int], preferred: str | None) -> str | None:
    if preferred and preferred in vocab:
        return preferred
    return next((n for n in names if n in vocab), None)


def _load_hf_json(path: pathlib.Path) -> Tokenizer:
    from tokenizers import Tokenizer as HFTok

    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        tok = HFTok.from_file(str(path))
    except Exception as exc:  # the Rust loader raises plain Exception subclasses
        raise ValueError(f"model.tokenizer_path: {str(path)!r} is not a valid tokenizer.json ({exc})") from None
    vocab = tok.get_vocab(with_added_tokens=True)
    bos_pref, eos_pref, specials = _special_names(path, data)
    bos, eos = _pick(_BOS_NAMES, vocab, bos_pref), _pick(_EOS_NAMES, vocab, eos_pref)
    if eos is None or bos is None:
        # GPT-2 style tokenizers have one document separator; it then serves as both.
        bos = eos = bos or eos
    if bos is None:
        raise ValueError(
            f"model.tokenizer_path: {str(path)!r} has no BOS/EOS token; expected one of "
            f"{', '.join(_BOS_NAMES + _EOS_NAMES)} (or bos_token/eos_token in tokenizer_config.json)"
        )
    hf = HFTokenizer(tok, path, bos, eos)
    if hf.decode(hf.encode(_PROBE_TEXT)) == _PROBE_TEXT:
        return hf
    ranked = _ranked_byte_vocab(data, specials)
    if ranked is None:
        return hf  # _check_lossless reports it
    ranks, special_ids = ranked
    # Llama 3's split pattern: such vocabularies hold tokens like ".\n" that only it can produce
    # (GPT-2's pattern always splits punctuation from the following newline).
    return TiktokenTokenizer(ranks, special_ids, bos, eos, name=_file_name("tokenizer.json (ranked bytes, tiktoken)", path))


_BYTE_ESCAPE = re.compile(r"\\x([0-9a-fA-F]{2})")


def _ranked_byte_vocab(data: dict, specials: set[str]) -> tuple[dict[bytes, int], dict[str, int]] | None:
    """(byte ranks, special ids) if the file's BPE vocab is a ranked byte list without merges, else None.

    Recognised layout: ``model.type == "BPE"``, no merges, ids 0-255 are the 256 single bytes (as the
    character itself, or ``\\xNN`` for bytes 128-255), and higher ids are byte strings in rank order.
    Special tokens (from added_tokens / tokenizer_config.json, or spelled ``<|...|>``) are kept apart.
    """
    model = data.get("model") or {}
    vocab = model.get("vocab")
    if model.get("type") != "BPE" or model.get("merges") or not isinstance(vocab, dict):
        return None
    by_id = {i: s for s, i in vocab.items()}
    for added in data.get("added_tokens", []):
        by_id.setdefault(added["id"], added["content"])

    def to_bytes(s: str) -> bytes:
        return re.sub(_BYTE_ESCAPE, lambda m: chr(int(m.group(1), 16)), s).encode("latin-1")

    ranks: dict[bytes, int] = {}
    special_ids: dict[str, int] = {}
    for i in sorted(by_id):
        s = by_id[i]
        if s in specials or (s.startswith("<|") and s.endswith("|>")) or (i >= 256 and s in ("[PAD]", "<pad>")):
            special_ids[s] = i
            continue
        try:
            b = to_bytes(s)
        except UnicodeEncodeError:
            return None  # characters above U+00FF: not a raw-byte vocabulary
        if b in ranks:
            return None  # two ids for one byte string: not a rank list
        ranks[b] = i
    if any(ranks.get(bytes([b])) != b for b in range(256)):
        return None
    return ranks, special_ids
