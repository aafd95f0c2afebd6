"""Tokenizer round trips for every kind of file, built here with the libraries themselves.

* a Hugging Face byte-level BPE ``tokenizer.json`` trained by ``tokenizers`` on tinyshakespeare;
* a tiktoken BPE ranks file (Llama 3 ``tokenizer.model`` format) written from that BPE's vocabulary;
* a SentencePiece ``.model`` trained by ``sentencepiece`` (byte fallback, identity normalization);
* the built-in byte-level tokenizer;
* the real ``tokenizer.json`` in the shared test data, whose ranked byte vocabulary (no merges) is
  checked against an independent, plain-Python BPE.
"""
from __future__ import annotations

import base64
import io
import json
import random
import re

import pytest
import regex

from trainer.data.tokenizer import (
    LLAMA3_PATTERN,
    LLAMA3_SPECIAL_TOKENS,
    ByteTokenizer,
    build_tokenizer,
)

_BUILT: dict[str, object] = {}  # tokenizer files are trained once per test session


def _random_text(seed: int, n: int = 400) -> str:
    """Words, whitespace runs, digits, punctuation and characters from several Unicode blocks."""
    rng = random.Random(seed)
    words = ["the", "King", "speak", "thou", "O", "Romeo,", "art", "naïve", "café", "Ünïcödé", "λόγος",
             "日本語", "🙂", "x" * 7, "42", "3.14", "don't", "<|end_of_text|>", "<s>", "\\x80"]
    pieces = []
    for _ in range(n):
        r = rng.random()
        if r < 0.6:
            pieces.append(rng.choice(words))
        elif r < 0.8:
            pieces.append(rng.choice([" ", "  ", "\n", "\n\n", "\t", " \n ", "   "]))
        else:
            block = rng.choice([(0x21, 0x7E), (0xA1, 0xFF), (0x370, 0x3FF), (0x4E00, 0x4FFF), (0x1F600, 0x1F64F)])
            pieces.append("".join(chr(rng.randint(*block)) for _ in range(rng.randint(1, 5))))
    return "".join(pieces)


def _shakespeare(shared_data) -> str:
    return (shared_data / "tinyshakespeare.txt").read_text(encoding="utf-8")


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map used by byte-level BPE vocabularies."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    mapping, extra = {}, 0
    for b in range(256):
        if b in keep:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


@pytest.fixture
def hf_json(shared_data, tmp_path_factory):
    if "hf" not in _BUILT:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        text = _shakespeare(shared_data)[:300_000]
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=700, special_tokens=["<|begin_of_text|>", "<|end_of_text|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
        )
        tok.train_from_iterator([text[i:i + 10_000] for i in range(0, len(text), 10_000)], trainer)
        path = tmp_path_factory.mktemp("hf") / "tokenizer.json"
        tok.save(str(path))
        _BUILT["hf"] = path
    return _BUILT["hf"]


@pytest.fixture
def tiktoken_file(hf_json, tmp_path_factory):
    """A tiktoken ranks file (``<base64 bytes> <rank>`` lines) from the trained BPE's vocabulary."""
    if "tiktoken" not in _BUILT:
        vocab = json.loads(hf_json.read_text())["model"]["vocab"]
        to_byte = {c: b for b, c in _bytes_to_unicode().items()}
        tokens = [tok for tok, _ in sorted(vocab.items(), key=lambda kv: kv[1]) if not tok.startswith("<|")]
        lines = [base64.b64encode(bytes(to_byte[c] for c in tok)).decode() + f" {rank}" for rank, tok in enumerate(tokens)]
        path = tmp_path_factory.mktemp("tiktoken") / "tokenizer.model"
        path.write_text("\n".join(lines) + "\n")
        _BUILT["tiktoken"] = (path, len(tokens))
    return _BUILT["tiktoken"]


def _train_sentencepiece(text: str, **options) -> bytes:
    import sentencepiece as spm

    model = io.BytesIO()
    lines = [line for line in text.splitlines() if line.strip()]
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=model, vocab_size=500, model_type="bpe",
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1, character_coverage=1.0, minloglevel=2, **options,
    )
    return model.getvalue()


@pytest.fixture
def sp_model(shared_data, tmp_path_factory):
    if "sp" not in _BUILT:
        data = _train_sentencepiece(
            _shakespeare(shared_data)[:300_000],
            byte_fallback=True, normalization_rule_name="identity", remove_extra_whitespaces=False,
        )
        path = tmp_path_factory.mktemp("sp") / "sp.model"
        path.write_bytes(data)
        _BUILT["sp"] = path
    return _BUILT["sp"]


def _check_round_trips(tok, texts: list[str]) -> None:
    for text in texts:
        ids = tok.encode(text)
        assert isinstance(ids, list) and all(isinstance(i, int) for i in ids)
        assert all(0 <= i < tok.vocab_size for i in ids)
        assert tok.bos_id not in ids and tok.eos_id not in ids  # nothing added, no specials from text
        assert tok.decode(ids) == text
        arr = tok.encode_array(text)
        assert arr.dtype.name == "int32" and arr.tolist() == ids
    assert tok.bos_id != tok.eos_id
    assert 0 <= tok.bos_id < tok.vocab_size and 0 <= tok.eos_id < tok.vocab_size


# ---- each kind ---------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [1, 2])
def test_byte_tokenizer_round_trip(seed):
    tok = build_tokenizer(None)
    assert isinstance(tok, ByteTokenizer) and build_tokenizer("").name == "bytes"
    assert (tok.vocab_size, tok.bos_id, tok.eos_id) == (258, 256, 257)
    text = _random_text(seed)
    _check_round_trips(tok, [text, "", "a"])
    assert tok.encode("é") == [0xC3, 0xA9]


def test_hf_tokenizer_json_round_trip(hf_json, shared_data):
    tok = build_tokenizer(hf_json)
    assert tok.name.startswith("tokenizer.json tokenizer.json sha1:")
    assert tok.vocab_size == 700
    assert (tok.bos_id, tok.eos_id) == (0, 1)
    held_out = _shakespeare(shared_data)[-20_000:]
    _check_round_trips(tok, [_random_text(3), held_out, ""])
    assert len(held_out) / len(tok.encode(held_out)) > 1.7  # the merges are in use (bytes: 1.0)
    # a folder holding tokenizer.json works too
    assert build_tokenizer(hf_json.parent).encode("speak") == tok.encode("speak")


def test_tokenizer_name_follows_the_content_not_the_path(hf_json, tmp_path):
    # The name goes into the loader state; a resume with the same file elsewhere must be accepted.
    copy = tmp_path / "tokenizer.json"
    copy.write_bytes(hf_json.read_bytes())
    assert build_tokenizer(copy).name == build_tokenizer(hf_json).name
    copy.write_bytes(hf_json.read_bytes().replace(b'"<|end_of_text|>"', b'"<|end_of_doc|>"'))
    assert build_tokenizer(copy).name != build_tokenizer(hf_json).name


def test_tiktoken_file_round_trip(tiktoken_file, shared_data):
    path, n_ranks = tiktoken_file
    tok = build_tokenizer(path)
    assert tok.name.startswith("tiktoken tokenizer.model sha1:")
    # Llama 3 layout: the 256 special tokens follow the ranks, BOS and EOS first
    assert tok.vocab_size == n_ranks + 256
    assert (tok.bos_id, tok.eos_id) == (n_ranks, n_ranks + 1)
    assert len(LLAMA3_SPECIAL_TOKENS) == 256 and LLAMA3_SPECIAL_TOKENS[9] == "<|eot_id|>"
    held_out = _shakespeare(shared_data)[-20_000:]
    _check_round_trips(tok, [_random_text(4), held_out, ""])
    assert len(held_out) / len(tok.encode(held_out)) > 1.7
    assert tok.decode([tok.bos_id]) == "<|begin_of_text|>"


def test_sentencepiece_round_trip(sp_model, shared_data):
    tok = build_tokenizer(sp_model)
    assert tok.name.startswith("sentencepiece sp.model sha1:")
    assert (tok.vocab_size, tok.bos_id, tok.eos_id) == (500, 1, 2)
    held_out = _shakespeare(shared_data)[-20_000:]
    _check_round_trips(tok, [_random_text(5), held_out])


def test_lossy_sentencepiece_is_refused(shared_data, tmp_path):
    # Default training normalizes (NFKC) and collapses whitespace: newlines would silently vanish.
    path = tmp_path / "lossy.model"
    path.write_bytes(_train_sentencepiece(_shakespeare(shared_data)[:100_000]))
    with pytest.raises(ValueError, match=r"model.tokenizer_path: .* does not reproduce text"):
        build_tokenizer(path)


# ---- the real tokenizer.json -------------------------------------------------------------------


def _reference_bpe(text: str, ranks: dict[bytes, int]) -> list[int]:
    """Plain byte-level BPE: pre-split with Llama 3's pattern, then merge the lowest-ranked pair."""
    ids = []
    for chunk in regex.findall(LLAMA3_PATTERN, text):
        parts = [bytes([b]) for b in chunk.encode("utf-8")]
        while len(parts) > 1:
            best = min(range(len(parts) - 1), key=lambda i: ranks.get(parts[i] + parts[i + 1], 1 << 60))
            if parts[best] + parts[best + 1] not in ranks:
                break
            parts[best:best + 2] = [parts[best] + parts[best + 1]]
        ids += [ranks[p] for p in parts]
    return ids


def test_real_tokenizer_json(shared_data):
    path = shared_data / "tokenizer" / "tokenizer.json"
    tok = build_tokenizer(path)
    data = json.loads(path.read_text())
    assert tok.vocab_size == len(data["model"]["vocab"]) == 2020
    assert tok.bos_id == data["model"]["vocab"]["<|begin_of_text|>"]
    assert tok.eos_id == data["model"]["vocab"]["<|end_of_text|>"]
    text = _shakespeare(shared_data)
    _check_round_trips(tok, [text, _random_text(6), ""])
    assert len(text) / len(tok.encode(text)) > 2.2  # ~2.5 characters per token: the ranks are merged
    # The ids are those of byte-level BPE with the file's ranks (single bytes are ids 0-255, written
    # raw or as a \xNN escape), computed here without tiktoken.
    ranks = {}
    for token, i in data["model"]["vocab"].items():
        if not (token.startswith("<|") or token.startswith("<tool") or token.startswith("</") or token == "[PAD]"):
            ranks[re.sub(r"\\x([0-9a-f]{2})", lambda m: chr(int(m.group(1), 16)), token).encode("latin-1")] = i
    sample = text[:3000] + "\n" + _random_text(7, 150)
    assert tok.encode(sample) == _reference_bpe(sample, ranks)


# ---- errors ------------------------------------------------------------------------------------


def test_errors_name_the_argument(tmp_path):
    with pytest.raises(ValueError, match="model.tokenizer_path: no such file"):
        build_tokenizer(tmp_path / "missing.json")
    with pytest.raises(ValueError, match="model.tokenizer_path: folder .* holds neither"):
        build_tokenizer(tmp_path)


# a ranks file without all 256 single bytes
_PARTIAL_RANKS = "".join(f"{base64.b64encode(bytes([b])).decode()} {b}\n" for b in range(200)).encode()


@pytest.mark.parametrize("name, content, message", [
    ("garbage.model", bytes(range(256)) * 4, "model.tokenizer_path: .* is neither a tokenizer.json, a tiktoken"),
    ("bad.json", b'{"model": 3}', "model.tokenizer_path: .* is not a valid tokenizer.json"),
    ("partial.model", _PARTIAL_RANKS, "lacks 56 of the 256 single-byte tokens"),
    ("malformed.model", b"QQ== 0\nQg== x\n", "line 2: expected '<base64 token> <rank>'"),
], ids=["garbage", "bad-json", "partial-ranks", "malformed-ranks"])
def test_a_file_that_is_no_tokenizer_is_refused_naming_the_argument(tmp_path, name, content, message):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(ValueError, match=message):
        build_tokenizer(path)


def test_tokenizer_json_without_bos_eos_is_refused(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["some text to learn from"], trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    with pytest.raises(ValueError, match="has no BOS/EOS token"):
        build_tokenizer(path)
