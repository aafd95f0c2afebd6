"""The tokenizer files and ``generation_config.json`` of a Hugging Face export, so that
``AutoTokenizer`` and ``AutoModelForCausalLM`` load the folder as a model with its tokenizer.

:func:`write_tokenizer_files` ships the tokenizer the run trained with (``--model.tokenizer_path``):

* a Hugging Face tokenizer (a ``tokenizer.json``, or a folder holding one): the tokenizer files of
  its folder (``TOKENIZER_FILES``: tokenizer.json, tokenizer_config.json, special_tokens_map.json,
  ...) are copied as they are; a lone JSON file of another name is copied as ``tokenizer.json``;
* the built-in byte-level tokenizer (an empty path): a ``tokenizer.json`` for the ``tokenizers``
  library that gives the same ids (GPT-2's byte-level alphabet, one token per UTF-8 byte with id =
  the byte's value, no merges; BOS 256 and EOS 257 as special tokens) and its tokenizer_config.json;
* a tiktoken rank list (Llama 3's ``tokenizer.model``, or a tokenizer.json of ranked bytes without
  merges, which training applies with tiktoken): a ``tokenizer.json`` with the merges the ranks
  define, by transformers' ``TikTokenConverter`` (the source files are copied too, but for its
  tokenizer.json, which the ``tokenizers`` library would apply differently);
* a SentencePiece ``.model``: copied as it is; the log says there is no tokenizer.json, so
  ``AutoTokenizer`` may not load it.

Without a tokenizer_config.json beside it, one is written (PreTrainedTokenizerFast, the BOS/EOS
token strings). The tokenizer.json shipped (written or copied) prepends BOS to every encoding (its
post-processor), as training starts every document with BOS, so ``AutoTokenizer`` gives the model the
ids it was trained on; ``add_special_tokens=False`` gives the bare ones.

Every case also sets ``bos_token_id`` / ``eos_token_id`` in config.json (transformers' family
defaults, e.g. Llama's 1 and 2, are another tokenizer's) and writes ``generation_config.json``
with the same ids, so ``generate`` stops at the tokenizer's end of text.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from trainer.hf.common import CONFIG, logger

GENERATION_CONFIG = "generation_config.json"
# The files transformers' tokenizers read from a model folder (save_pretrained's names).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json")
BYTE_BOS, BYTE_EOS = "<|begin_of_text|>", "<|end_of_text|>"


def byte_level_alphabet() -> dict[int, str]:
    """Byte value -> the printable character GPT-2's byte-level BPE writes it as (Radford et al.
    2019; the ``tokenizers`` ByteLevel pre-tokenizer's alphabet): printable Latin-1 bytes stand for
    themselves, the other 68 take the code points from 256 up, in byte order."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {b: chr(b) for b in kept}, 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def byte_tokenizer_json():
    """The built-in byte-level tokenizer (ids 0-255 = UTF-8 bytes, BOS 256, EOS 257) as a
    ``tokenizers.Tokenizer``, which encodes and decodes any text exactly as ``ByteTokenizer`` does."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    alphabet = byte_level_alphabet()
    if set(alphabet.values()) != set(pre_tokenizers.ByteLevel.alphabet()):
        raise RuntimeError("the tokenizers library's byte-level alphabet is not GPT-2's; cannot write the byte tokenizer")
    tok = Tokenizer(models.BPE(vocab={ch: b for b, ch in alphabet.items()}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(BYTE_BOS, special=True), AddedToken(BYTE_EOS, special=True)])
    return tok


def tiktoken_tokenizer_json(tok):
    """A ``TiktokenTokenizer`` (ranks, split pattern, special tokens at their ids) as a
    ``tokenizers.Tokenizer`` through transformers' ``TikTokenConverter`` (merges from the ranks), or
    None without transformers or when the special tokens do not land on their ids."""
    try:
        from transformers.convert_slow_tokenizer import TikTokenConverter
    except ImportError:
        logger.warning("the tokenizer.json of a tiktoken rank list is written by transformers, which is not installed")
        return None
    specials = sorted(tok.special_tokens.items(), key=lambda kv: kv[1])
    converter = TikTokenConverter(pattern=tok.pattern, extra_special_tokens=[s for s, _ in specials])
    converter.load_tiktoken_bpe = lambda _: tok.ranks  # the ranks are in memory, not at a URL
    converted = converter.converted()
    if any(converted.token_to_id(s) != i for s, i in specials):
        logger.warning("the special tokens of %s are not contiguous after its ranks; no tokenizer.json written", tok.name)
        return None
    return converted


def _prepend_bos(path: Path, bos: str, bos_id: int) -> None:
    """Make the ``tokenizer.json`` at ``path`` start every encoding with BOS (its post-processor), as the
    loader starts every training document: transformers' tokenizer then gives the ids the model was
    trained on (``add_special_tokens=False`` still gives the bare ones)."""
    from tokenizers import Tokenizer, processors

    t = Tokenizer.from_file(str(path))
    t.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                     special_tokens=[(bos, bos_id)])
    t.save(str(path))


def _special_names(tok) -> tuple[str, str] | None:
    """The BOS and EOS token strings of ``tok`` (None for a SentencePiece model)."""
    if hasattr(tok, "special_tokens"):
        by_id = {i: s for s, i in tok.special_tokens.items()}
        return by_id[tok.bos_id], by_id[tok.eos_id]
    if hasattr(tok, "_tok"):
        return tok._tok.id_to_token(tok.bos_id), tok._tok.id_to_token(tok.eos_id)
    return None


def _source_files(path: Path) -> tuple[Path, list[Path]]:
    """The tokenizer file ``path`` names (as build_tokenizer reads it) and the tokenizer files beside it."""
    if path.is_dir():
        main = next((path / n for n in ("tokenizer.json", "tokenizer.model") if (path / n).is_file()), path)
        folder = path
    else:
        main, folder = path, path.parent
    return main, [folder / n for n in TOKENIZER_FILES if (folder / n).is_file()]


def _final_name(out: Path) -> Path:
    """The folder a message names: a ``.<name>.partial`` folder being written is published as ``<name>``."""
    if out.name.startswith(".") and out.name.endswith(".partial"):
        return out.with_name(out.name[1:-len(".partial")])
    return out


def write_tokenizer_files(out: str | Path, tokenizer_path: str) -> list[str]:
    """Put the tokenizer of ``tokenizer_path`` (as ``--model.tokenizer_path``: "" = the byte-level one)
    beside the weights in the Hugging Face folder ``out``, set its BOS/EOS ids in config.json and
    write generation_config.json. Returns the names of the files written.

    Raises ValueError (from ``build_tokenizer``) for a path that is not a usable tokenizer.
    """
    from trainer.data.tokenizer import ByteTokenizer, HFTokenizer, TiktokenTokenizer, build_tokenizer

    out = Path(out)
    tok = build_tokenizer(tokenizer_path or None)
    written: list[str] = []
    if isinstance(tok, ByteTokenizer):
        byte_tokenizer_json().save(str(out / "tokenizer.json"))
        written.append("tokenizer.json")
        names = (BYTE_BOS, BYTE_EOS)
        logger.info("%s: the byte-level tokenizer written as tokenizer.json (one token per UTF-8 byte)",
                    _final_name(out))
    else:
        main, files = _source_files(Path(tokenizer_path).expanduser())
        targets = {f: f.name for f in files}
        if main.name not in TOKENIZER_FILES:  # e.g. my_tokenizer.json: it is the run's tokenizer.json
            name = "tokenizer.json" if isinstance(tok, (HFTokenizer, TiktokenTokenizer)) and main.suffix == ".json" \
                else main.name
            targets = {f: n for f, n in targets.items() if n != name}
            targets[main] = name
        converted = tiktoken_tokenizer_json(tok) if isinstance(tok, TiktokenTokenizer) else None
        if converted is not None:  # the tokenizers library applies a rank list only as merges
            targets = {f: n for f, n in targets.items() if n != "tokenizer.json"}
            converted.save(str(out / "tokenizer.json"))
            written.append("tokenizer.json")
        for f, name in targets.items():
            shutil.copyfile(f, out / name)
            written.append(name)
        logger.info("%s: tokenizer files from %s: %s%s", out, main.parent, ", ".join(written),
                    " (tokenizer.json written from its BPE ranks)" if converted is not None else "")
        if "tokenizer.json" not in written:
            logger.warning("%s: the tokenizer %s is copied as it is; it has no tokenizer.json, so AutoTokenizer "
                           "may not load it or may not give the training ids", out, tok.name)
        names = _special_names(tok)
    if "tokenizer.json" in written and names is not None:
        _prepend_bos(out / "tokenizer.json", names[0], tok.bos_id)
    if "tokenizer_config.json" not in written and names is not None:
        cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": names[0], "eos_token": names[1],
               "add_bos_token": True, "add_eos_token": False, "clean_up_tokenization_spaces": False,
               "model_max_length": int(json.loads((out / CONFIG).read_text())["max_position_embeddings"])}
        (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n", encoding="utf-8")
        written.append("tokenizer_config.json")
    config = json.loads((out / CONFIG).read_text(encoding="utf-8"))
    config.update(bos_token_id=tok.bos_id, eos_token_id=tok.eos_id)
    (out / CONFIG).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    generation = {"bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id}
    (out / GENERATION_CONFIG).write_text(json.dumps(generation, indent=2) + "\n", encoding="utf-8")
    return [*written, GENERATION_CONFIG]
