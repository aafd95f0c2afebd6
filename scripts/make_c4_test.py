"""Write trainer/data/samples/c4_test.jsonl, the sample behind ``--training.dataset c4_test`` (the name of
torchtitan's debug dataset, tests/assets/c4_test there): C4's layout (one JSON object per line with a
"text" field) holding public-domain text we already ship, the plays of tests/data/tinyshakespeare.txt.

    python scripts/make_c4_test.py

Documents are the speeches of the file (blocks between blank lines) packed in order into documents of
about 1,500 characters, the first 100 of them (about 175 KB): deterministic, so the file is reproducible.
"""
from __future__ import annotations

import json
import pathlib

REPO = pathlib.Path(__file__).resolve().parents[1]
SOURCE = REPO / "tests" / "data" / "tinyshakespeare.txt"
OUT = REPO / "trainer" / "data" / "samples" / "c4_test.jsonl"
DOC_CHARS, DOCS = 1500, 100


def documents(text: str) -> list[str]:
    docs, current = [], ""
    for block in text.split("\n\n"):
        block = block.strip()
        if not block:
            continue
        current = f"{current}\n\n{block}" if current else block
        if len(current) >= DOC_CHARS:
            docs.append(current)
            current = ""
        if len(docs) == DOCS:
            break
    return docs


if __name__ == "__main__":
    OUT.parent.mkdir(parents=True, exist_ok=True)
    with open(OUT, "w", encoding="utf-8") as f:
        for doc in documents(SOURCE.read_text(encoding="utf-8")):
            f.write(json.dumps({"text": doc}, ensure_ascii=False) + "\n")
    print(f"{OUT}: {sum(1 for _ in open(OUT, encoding='utf-8'))} documents, {OUT.stat().st_size} bytes")
