"""Document sources, packing, rank splitting and loader resume.

Expected windows are rebuilt here from the documents alone (BOS + tokens + EOS, joined, cut into
seq_len + 1 pieces; positions from the known document starts), independently of the loader's code.
"""
from __future__ import annotations

import itertools
import json
import random
import time

import numpy as np
import pytest
import torch

from trainer.config import JobConfig
from trainer.data import (
    DataLoader,
    DocumentSource,
    EmbeddedCorpus,
    LocalFiles,
    build_dataloader,
    build_source,
    build_tokenizer,
)
from trainer.data.datasets import HuggingFaceDataset, check_hub_reachable


class ListSource(DocumentSource):
    """Documents from a list; counts how many it hands out."""

    def __init__(self, docs: list[str], name: str = "list") -> None:
        self.docs, self.name, self.reads = docs, name, 0

    def iter_from(self, start):
        for doc in self.docs[start:]:
            self.reads += 1
            yield doc


def _random_docs(seed: int, n: int) -> list[str]:
    rng = random.Random(seed)
    words = ["thou", "art", "the", "king", "speak", "naïve", "λ", "日本", "🙂", "\n", "42"]
    docs = []
    for _ in range(n):
        kind = rng.random()
        length = 0 if kind < 0.1 else (1 if kind < 0.2 else rng.randint(2, 60))
        docs.append(" ".join(rng.choice(words) for _ in range(length)))
    return docs


def _expected_windows(docs: list[str], tok, seq_len: int, count: int):
    """The first ``count`` windows (tokens, positions) over as many epochs of ``docs`` as needed."""
    width = seq_len + 1
    stream, starts = [], set()
    while len(stream) < count * width:
        for doc in docs:
            if doc:
                starts.add(len(stream))
                stream += [tok.bos_id, *tok.encode(doc), tok.eos_id]
    tokens, positions = [], []
    for g in range(count):
        lo = g * width
        pos, p = [], 0
        for j in range(width):
            if j == 0 or lo + j in starts:
                p = 0
            pos.append(p)
            p += 1
        tokens.append(stream[lo:lo + width])
        positions.append(pos)
    return np.array(tokens), np.array(positions)


def _take(loader, n):
    return [next(loader) for _ in range(n)]


def _same_batches(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for key in x:
            assert torch.equal(x[key], y[key]), key


# ---- packing ---------------------------------------------------------------------------------


@pytest.mark.parametrize("seq_len, batch", [(1, 1), (7, 3), (13, 2), (64, 5)])
def test_packing_matches_the_joined_stream(seq_len, batch):
    tok = build_tokenizer(None)
    docs = _random_docs(seq_len, 40)
    loader = DataLoader(ListSource(docs), tok, seq_len=seq_len, local_batch_size=batch)
    n_batches = 30
    tokens, positions = _expected_windows(docs, tok, seq_len, n_batches * batch)
    for b in range(n_batches):
        out = next(loader)
        rows = slice(b * batch, (b + 1) * batch)
        for key in ("input_ids", "labels", "position_ids"):
            assert out[key].shape == (batch, seq_len) and out[key].dtype == torch.int64
            assert out[key].is_contiguous()
        assert torch.equal(out["input_ids"], torch.from_numpy(tokens[rows, :-1]))
        assert torch.equal(out["labels"], torch.from_numpy(tokens[rows, 1:]))
        assert torch.equal(out["position_ids"], torch.from_numpy(positions[rows, :-1]))
        assert int(out["position_ids"].min()) >= 0 and int(out["position_ids"].max()) < seq_len


def test_documents_are_joined_with_bos_and_eos():
    tok = build_tokenizer(None)
    loader = DataLoader(ListSource(["ab", "", "c"]), tok, seq_len=8, local_batch_size=1)
    out = next(loader)
    bos, eos = tok.bos_id, tok.eos_id
    # an empty document contributes nothing; the stream wraps into the next epoch
    window = [bos, ord("a"), ord("b"), eos, bos, ord("c"), eos, bos, ord("a")]
    assert out["input_ids"][0].tolist() == window[:-1]
    assert out["labels"][0].tolist() == window[1:]
    assert out["position_ids"][0].tolist() == [0, 1, 2, 3, 0, 1, 2, 0]
    assert loader.state_dict()["epoch"] == 1


def test_epochs_repeat_the_same_documents():
    tok = build_tokenizer(None)
    docs = _random_docs(9, 5)
    loader = DataLoader(ListSource(docs), tok, seq_len=5, local_batch_size=4)
    epoch_tokens = sum(len(d.encode()) + 2 for d in docs if d)
    batches = _take(loader, 3 * epoch_tokens // 24 + 2)
    tokens, _ = _expected_windows(docs, tok, 5, 4 * len(batches))
    got = torch.cat([b["input_ids"] for b in batches]).numpy()
    assert np.array_equal(got, tokens[:, :-1])
    assert loader.state_dict()["epoch"] >= 2


# ---- ranks -----------------------------------------------------------------------------------


@pytest.mark.parametrize("world", [2, 3])
def test_windows_are_dealt_round_robin(world):
    tok = build_tokenizer(None)
    docs = _random_docs(world, 30)
    seq_len, batch, steps = 11, 2, 8
    tokens, _ = _expected_windows(docs, tok, seq_len, world * batch * steps)
    for rank in range(world):
        loader = DataLoader(ListSource(docs), tok, seq_len, batch, dp_rank=rank, dp_world_size=world)
        got = torch.cat([b["input_ids"] for b in _take(loader, steps)]).numpy()
        assert np.array_equal(got, tokens[rank::world, :-1])


def test_each_step_sees_the_same_windows_for_any_layout():
    """1 rank x 12 sequences == 2 ranks x 6 == 3 ranks x 2 sequences x 2 micro-batches, per step."""
    tok = build_tokenizer(None)
    docs = _random_docs(11, 40)
    source = lambda: ListSource(docs)  # noqa: E731
    single = DataLoader(source(), tok, 9, 12)
    two = [DataLoader(source(), tok, 9, 6, r, 2) for r in range(2)]
    three = [DataLoader(source(), tok, 9, 2, r, 3) for r in range(3)]

    def rows(batches):
        return sorted(tuple(r) for b in batches for r in b["input_ids"].tolist())

    for _ in range(5):
        want = rows([next(single)])
        assert rows([next(l) for l in two]) == want
        assert rows([next(l) for l in three for _ in range(1)] + [next(l) for l in three]) == want


# ---- resume ----------------------------------------------------------------------------------


_TINY = ["To be, or not to be,", "", "that is the question:", "Whether 'tis nobler in the mind to suffer", "x"]


def _sources(shared_data):
    shakespeare = shared_data / "tinyshakespeare.txt"
    real_tok = shared_data / "tokenizer" / "tokenizer.json"
    return {
        # the embedded corpus, rank 1 of 2, byte-level tokens
        "pydoc": (lambda: EmbeddedCorpus(), lambda: build_tokenizer(None), 64, 3, 1, 2),
        # a local text file with the real tokenizer, rank 0 of 3
        "shakespeare": (lambda: LocalFiles(shakespeare), lambda: build_tokenizer(real_tok), 48, 2, 0, 3),
        # a tiny source: interruptions fall in later epochs and inside documents
        "tiny": (lambda: ListSource(_TINY, "tiny"), lambda: build_tokenizer(None), 17, 3, 0, 1),
    }


@pytest.mark.parametrize("interruptions", [1, 2, 3])
@pytest.mark.parametrize("kind", ["pydoc", "shakespeare", "tiny"])
def test_resume_continues_with_exactly_the_next_sample(shared_data, kind, interruptions):
    make_source, make_tok, seq_len, batch, rank, world = _sources(shared_data)[kind]
    total = 30
    straight = _take(DataLoader(make_source(), make_tok(), seq_len, batch, rank, world), total)
    rng = random.Random(100 * interruptions + len(kind))
    cuts = sorted(rng.sample(range(1, total), interruptions))
    resumed, state = [], None
    for lo, hi in zip([0, *cuts], [*cuts, total]):
        loader = DataLoader(make_source(), make_tok(), seq_len, batch, rank, world)  # a fresh process
        if state is not None:
            loader.load_state_dict(json.loads(json.dumps(state)))  # plain data only
        resumed += _take(loader, hi - lo)
        state = loader.state_dict()
    _same_batches(resumed, straight)
    if kind == "tiny":
        assert state["epoch"] >= 2


def test_state_is_plain_and_loading_it_twice_gives_the_same_samples():
    tok = build_tokenizer(None)
    docs = _random_docs(3, 20)
    loader = DataLoader(ListSource(docs), tok, 10, 2, 1, 2)
    _take(loader, 4)
    state = loader.state_dict()
    assert all(isinstance(v, (int, str)) and not isinstance(v, bool) for v in state.values())
    assert (state["dp_rank"], state["dp_world_size"], state["seq_len"]) == (1, 2, 10)
    a, b = (DataLoader(ListSource(docs), tok, 10, 2, 1, 2) for _ in range(2))
    a.load_state_dict(state)
    b.load_state_dict(state)
    _same_batches(_take(a, 3), _take(b, 3))
    _same_batches(_take(loader, 3), _take(DataLoader(ListSource(docs), tok, 10, 2, 1, 2), 7)[4:])


@pytest.mark.parametrize(
    "change, key",
    [
        (dict(dp_world_size=4), "dp_world_size"),
        (dict(dp_rank=0), "dp_rank"),
        (dict(seq_len=11), "seq_len"),
        (dict(name="other"), "dataset"),
        (dict(tokenizer="real"), "tokenizer"),
    ],
)
def test_resume_with_another_layout_is_refused(shared_data, change, key):
    docs = _random_docs(4, 10)
    args = dict(seq_len=10, local_batch_size=2, dp_rank=1, dp_world_size=2)
    saved = DataLoader(ListSource(docs), build_tokenizer(None), **args)
    next(saved)
    name = change.pop("name", "list")
    tok = build_tokenizer(shared_data / "tokenizer" / "tokenizer.json") if change.pop("tokenizer", None) else build_tokenizer(None)
    args.update(change)
    other = DataLoader(ListSource(docs, name), tok, **args)
    with pytest.raises(ValueError, match=f"state: the checkpoint's data loader has {key}=.* this run has {key}="):
        other.load_state_dict(saved.state_dict())


def test_malformed_state_is_refused():
    loader = DataLoader(ListSource(["abc"]), build_tokenizer(None), 4, 1)
    with pytest.raises(TypeError, match="state: expected a dict"):
        loader.load_state_dict([1, 2])
    with pytest.raises(ValueError, match="missing"):
        loader.load_state_dict({"epoch": 0})
    bad = loader.state_dict() | {"doc_index": -1}
    with pytest.raises(ValueError, match="doc_index must be an integer >= 0"):
        loader.load_state_dict(bad)
    with pytest.raises(ValueError, match="version"):
        loader.load_state_dict(loader.state_dict() | {"version": 99})


def test_tokenized_documents_are_cached_across_epochs():
    class CountingTokenizer:
        def __init__(self):
            self.inner, self.calls = build_tokenizer(None), 0
            self.bos_id, self.eos_id, self.vocab_size, self.name = 256, 257, 258, "bytes"

        def encode_array(self, text):
            self.calls += 1
            return self.inner.encode_array(text)

    docs = _random_docs(8, 12)
    tok, source = CountingTokenizer(), ListSource(docs)
    loader = DataLoader(source, tok, 16, 4)
    while loader.state_dict()["epoch"] < 3:
        next(loader)
    assert tok.calls == sum(1 for d in docs if d)
    assert source.reads == len(docs) + 1 or source.reads == len(docs)
    # a cache too small to hold anything still gives the same batches
    small = DataLoader(ListSource(docs), build_tokenizer(None), 16, 4, max_cached_tokens=0)
    _same_batches(_take(small, 20), _take(DataLoader(ListSource(docs), build_tokenizer(None), 16, 4), 20))


def test_loader_argument_errors():
    tok = build_tokenizer(None)
    with pytest.raises(ValueError, match="seq_len: expected an integer >= 1, got 0"):
        DataLoader(ListSource(["a"]), tok, 0, 1)
    with pytest.raises(TypeError, match="local_batch_size: expected an int, got str"):
        DataLoader(ListSource(["a"]), tok, 4, "8")
    with pytest.raises(ValueError, match=r"dp_rank: expected an integer in \[0, 2\), got 2"):
        DataLoader(ListSource(["a"]), tok, 4, 1, dp_rank=2, dp_world_size=2)
    for docs in ([], ["", ""]):
        with pytest.raises(ValueError, match="has no text to train on"):
            next(DataLoader(ListSource(docs), tok, 4, 1))


# ---- sources ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pydoc_docs():
    return list(EmbeddedCorpus().iter_from(0))


def test_embedded_corpus_is_real_english_and_deterministic(pydoc_docs):
    text = "\n".join(pydoc_docs)
    assert len(text) > 1_500_000
    assert len(pydoc_docs) > 300
    words = text.lower().split()
    common = {"the", "of", "a", "to", "is", "and", "in", "be", "for", "that"}
    assert sum(w in common for w in words) / len(words) > 0.15  # English prose, not code or noise
    again = EmbeddedCorpus()
    assert len(again) == len(pydoc_docs)
    for k in (0, 1, 17, len(pydoc_docs) - 2):
        assert list(itertools.islice(again.iter_from(k), 2)) == pydoc_docs[k:k + 2]


def test_embedded_corpus_epoch_is_fast(pydoc_docs):
    # The whole corpus through the loader, byte-level tokens: a guard against quadratic work.
    tok = build_tokenizer(None)
    loader = DataLoader(EmbeddedCorpus(), tok, 256, 8)
    start = time.perf_counter()
    while loader.state_dict()["epoch"] == 0:
        next(loader)
    first = time.perf_counter() - start
    start = time.perf_counter()
    while loader.state_dict()["epoch"] == 1:
        next(loader)
    second = time.perf_counter() - start
    assert first < 30 and second < 10, (first, second)


def _write_local_files(root):
    (root / "sub").mkdir(parents=True)
    # Windows line ends read as "\n"; a line of spaces counts as blank
    (root / "a.txt").write_bytes(b"First para\nline two\n\n  \nSecond para\n\n\n\nThird\r\n\r\nFourth\n")
    (root / "sub" / "b.jsonl").write_text('{"text": "json one"}\n\n{"text": "json two", "id": 3}\n')
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": [f"row {i}" for i in range(7)], "n": list(range(7))}),
                   root / "sub" / "c.parquet", row_group_size=3)
    (root / "notes.md").write_text("ignored")
    return ["First para\nline two", "Second para", "Third", "Fourth", "json one", "json two"] + \
        [f"row {i}" for i in range(7)]


def test_local_files_of_each_kind_and_folders(tmp_path):
    expected = _write_local_files(tmp_path / "data")
    source = build_source("pydoc", str(tmp_path / "data"))  # the path wins over the name
    assert isinstance(source, LocalFiles)
    assert list(source.iter_from(0)) == expected
    for k in range(len(expected) + 1):
        assert list(source.iter_from(k)) == expected[k:], k
    fresh = LocalFiles(tmp_path / "data")
    assert list(fresh.iter_from(9)) == expected[9:]  # skipping before the per-file counts are known
    assert list(LocalFiles(tmp_path / "data" / "sub" / "c.parquet").iter_from(5)) == ["row 5", "row 6"]
    assert list(LocalFiles(tmp_path / "data" / "sub" / "b.jsonl").iter_from(0)) == ["json one", "json two"]


def test_local_file_errors(tmp_path):
    (tmp_path / "x.csv").write_text("a,b")
    with pytest.raises(ValueError, match="training.dataset_path: .* has suffix '.csv'; expected one of"):
        LocalFiles(tmp_path / "x.csv")
    with pytest.raises(ValueError, match="training.dataset_path: no such file or folder"):
        LocalFiles(tmp_path / "missing.txt")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="training.dataset_path: folder .* holds no .txt"):
        LocalFiles(tmp_path / "empty")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"content": "no text"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: expected an object with a string 'text' field, got \['content'\]"):
        list(LocalFiles(bad).iter_from(0))
    bad.write_text('{"text": "ok"}\nnot json\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2 is not valid JSON"):
        list(LocalFiles(bad).iter_from(0))
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "p.parquet")
    with pytest.raises(ValueError, match=r"expected a 'text' column, got columns \['body'\]"):
        list(LocalFiles(tmp_path / "p.parquet").iter_from(0))


def test_unknown_dataset_name_suggests():
    with pytest.raises(ValueError, match=r"training.dataset: unknown dataset 'pydok'.*did you mean 'pydoc'\?"):
        build_source("pydok")


def test_c4_without_network_fails_quickly_with_a_clear_message(monkeypatch):
    # Whichever is missing here, the package or the network, the answer is a RuntimeError at once.
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens: refused at once
    for var in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    start = time.perf_counter()
    with pytest.raises(RuntimeError, match=r"training.dataset='c4' .*(needs the Hugging Face hub|'datasets' package)"):
        build_source("c4")
    assert time.perf_counter() - start < 15


def test_hub_probe_reports_an_unreachable_endpoint(monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    for var in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    start = time.perf_counter()
    with pytest.raises(RuntimeError, match=r"training.dataset='c4' needs the Hugging Face hub, but 127.0.0.1:9 cannot be reached"):
        check_hub_reachable("c4", timeout_s=2.0)
    assert time.perf_counter() - start < 10


def test_hf_dataset_without_the_datasets_package(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_datasets(name, *args, **kwargs):
        if name == "datasets":
            raise ImportError("No module named 'datasets'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_datasets)
    with pytest.raises(RuntimeError, match=r"streams allenai/c4 .* needs the 'datasets' package"):
        HuggingFaceDataset("c4")


def test_hf_dataset_streams_text_and_resumes_by_skipping(monkeypatch):
    """The streaming path, with a stand-in for the ``datasets`` package (no network here)."""
    import sys
    import types

    rows = [{"text": f"document {i}", "url": "u"} for i in range(10)]
    calls = []

    class Stream:
        def __init__(self, items):
            self.items = items

        def skip(self, n):
            return Stream(self.items[n:])

        def __iter__(self):
            return iter(self.items)

    def load_dataset(path, name=None, split=None, streaming=False):
        calls.append((path, name, split, streaming))
        return Stream(rows)

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    monkeypatch.setattr("trainer.data.datasets.check_hub_reachable", lambda name, timeout_s=3.0: None)
    source = build_source("c4")
    assert list(source.iter_from(0)) == [r["text"] for r in rows]
    assert list(source.iter_from(7)) == ["document 7", "document 8", "document 9"]
    assert calls[0] == ("allenai/c4", "en", "train", True)
    assert list(build_source("someone/corpus:v2").iter_from(9)) == ["document 9"]
    assert calls[-1] == ("someone/corpus", "v2", "train", True)
    rows[3] = {"content": "no text"}
    with pytest.raises(ValueError, match=r"training.dataset='c4': expected a 'text' field, got fields \['content'\]"):
        list(build_source("c4").iter_from(0))


# ---- build_dataloader --------------------------------------------------------------------------


def test_build_dataloader_on_shakespeare_with_the_real_tokenizer(shared_data):
    config = JobConfig()
    config.training.dataset_path = str(shared_data / "tinyshakespeare.txt")
    config.training.seq_len = 33
    config.training.local_batch_size = 3
    tok = build_tokenizer(shared_data / "tokenizer" / "tokenizer.json")
    loader = build_dataloader(config, tok, dp_rank=0, dp_world_size=1)
    batch = next(loader)
    ids = batch["input_ids"]
    assert ids.shape == (3, 33) and int(ids.max()) < tok.vocab_size
    assert torch.equal(batch["labels"][:, :-1], ids[:, 1:])
    assert int(ids[0, 0]) == tok.bos_id
    first = ids[0].tolist()
    text = tok.decode(first[1:first.index(tok.eos_id)])
    assert text == "First Citizen:\nBefore we proceed any further, hear me speak."


def test_build_dataloader_default_is_the_embedded_corpus():
    config = JobConfig()
    config.training.seq_len = 16
    loader = build_dataloader(config, build_tokenizer(None), 0, 1)
    assert isinstance(loader.source, EmbeddedCorpus)
    assert next(loader)["input_ids"].shape == (8, 16)


# ---- text checks, one pass, held-out split ----------------------------------------------------


@pytest.mark.parametrize("suffix", [".txt", ".jsonl"])
def test_binary_and_non_utf8_files_are_refused_naming_the_file_and_offset(tmp_path, suffix):
    head = b'{"text": "ok"}\n' if suffix == ".jsonl" else b"ok\n\n"
    binary = tmp_path / f"zeros{suffix}"
    binary.write_bytes(head + b"\x00\x01\x02" * 10)
    with pytest.raises(ValueError, match=rf"training.dataset_path: .*zeros{suffix} is not a text file: a NUL byte "
                                         rf"at byte offset {len(head)}"):
        LocalFiles(binary)  # at construction: before any model is built
    latin1 = tmp_path / f"latin1{suffix}"
    latin1.write_bytes(head + "caf\u00e9".encode("latin-1") + b"\n")
    with pytest.raises(ValueError, match=rf"validation.dataset_path: .*latin1{suffix} is not UTF-8 text: byte 0xe9 "
                                         rf"at byte offset {len(head) + 3}"):
        build_source("", str(latin1), section="validation")
    # Past the first megabyte the file is checked when it is read, with the offset in the whole file.
    late = tmp_path / f"late{suffix}"
    filler = (b'{"text": "' + b"a" * 100 + b'"}\n') if suffix == ".jsonl" else b"a" * 100 + b"\n\n"
    body = filler * 11_000
    late.write_bytes(body + b"\xff\n")
    source = LocalFiles(late)
    with pytest.raises(ValueError, match=rf"is not UTF-8 text: byte 0xff at byte offset {len(body)}"):
        list(source.iter_from(0))
    # A multi-byte character cut by the 1 MiB window is not an error.
    cut = tmp_path / "cut.txt"
    cut.write_bytes(b"x" * ((1 << 20) - 1) + "\u00e9\n".encode())
    assert list(LocalFiles(cut).iter_from(0)) == ["x" * ((1 << 20) - 1) + "\u00e9"]



def test_check_reads_the_first_batch_and_rewinds(tmp_path):
    tok = build_tokenizer(None)
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n  \n")
    loader = DataLoader(LocalFiles(empty), tok, 8, 2)
    with pytest.raises(ValueError, match=r"dataset 'files:.*empty.txt' has no text to train on"):
        loader.check()
    docs = _random_docs(5, 30)
    checked = DataLoader(ListSource(docs), tok, 9, 3)
    checked.check()
    _same_batches(_take(checked, 4), _take(DataLoader(ListSource(docs), tok, 9, 3), 4))


@pytest.mark.parametrize("world", [1, 3])
def test_one_epoch_pads_the_last_window_and_stops(world):
    tok = build_tokenizer(None)
    docs = _random_docs(11, 7)
    seq_len, batch = 10, 2
    stream = [t for d in docs if d for t in [tok.bos_id, *d.encode(), tok.eos_id]]
    n_windows = -(-len(stream) // (seq_len + 1))
    labelled = []  # (window index, labels) of every window with a label, from the joined stream
    for g in range(n_windows):
        w = stream[g * (seq_len + 1):(g + 1) * (seq_len + 1)]
        labelled.append((g, w[1:] + [-100] * (seq_len + 1 - len(w))))
    for rank in range(world):
        loader = DataLoader(ListSource(docs), tok, seq_len, batch, rank, world, one_epoch=True)
        mine = [lab for g, lab in labelled if g % world == rank]
        n_batches = -(-len(mine) // batch)
        got = torch.cat([b["labels"] for b in _take(loader, n_batches + 2)])
        want = mine + [[-100] * seq_len] * (len(got) - len(mine))
        assert got.tolist() == want
        assert loader.state_dict()["epoch"] == 0  # never wrapped into a second pass
        loader.rewind()
        again = torch.cat([b["labels"] for b in _take(loader, n_batches)])
        assert again.tolist() == want[:len(again)]


def test_held_out_split_partitions_the_documents():
    from trainer.data.splits import SplitSource

    docs = [f"doc {i}" for i in range(23)]
    train_part = SplitSource(ListSource(docs), 4, "train")
    val_part = SplitSource(ListSource(docs), 4, "validation")
    assert list(val_part.iter_from(0)) == ["doc 3", "doc 7", "doc 11", "doc 15", "doc 19"]
    kept = [d for i, d in enumerate(docs) if i % 4 != 3]
    assert list(train_part.iter_from(0)) == kept
    for k in range(len(kept) + 1):
        assert list(train_part.iter_from(k)) == kept[k:], k
    for k in range(6):
        assert list(val_part.iter_from(k)) == ["doc 3", "doc 7", "doc 11", "doc 15", "doc 19"][k:], k
    assert "train part, 1 in 4" in train_part.name
    with pytest.raises(ValueError, match="validation.split_every: expected an integer >= 2, got 1"):
        SplitSource(ListSource(docs), 1, "train")


def test_with_validation_on_the_training_loader_never_reads_a_held_out_document():
    config = JobConfig()
    config.training.seq_len, config.training.local_batch_size = 64, 4
    config.validation.enable, config.validation.split_every = True, 3
    tok = build_tokenizer(None)
    loader = build_dataloader(config, tok, 0, 1)
    windows = torch.cat([torch.cat([b["input_ids"], b["labels"][:, -1:]], 1) for b in _take(loader, 40)])
    # The stream is exactly documents 0, 1, 3, 4, 6, ... of the corpus: 2, 5, 8, ... are held out.
    kept = [d for i, d in enumerate(itertools.islice(EmbeddedCorpus().iter_from(0), 200)) if i % 3 != 2 and d]
    stream = [t for d in kept for t in [tok.bos_id, *d.encode(), tok.eos_id]]
    assert windows.flatten().tolist() == stream[:windows.numel()]
