"""A .txt / .jsonl data file that is binary (a NUL byte) or not UTF-8 within its first megabyte stops
the run in one line naming the file and the byte offset, before the model is built (issue 30);
text in UTF-16 or UTF-32 is named by its byte order mark. The earlier checks (the first bytes, a bad
byte past the first megabyte found when read) are in test_data.py."""
from __future__ import annotations

import pytest

from trainer.data import LocalFiles


@pytest.mark.parametrize("bad,what", [(b"\x00\x07\x00", "is not a text file: a NUL byte"),
                                      (b"\xc3\x28", "is not UTF-8 text: byte 0xc3")], ids=["nul", "utf8"])
def test_a_bad_byte_in_the_first_megabyte_stops_the_run_before_the_model(tmp_path, capsys, bad, what):
    # A folder whose second file is 200 KB of text with a bad byte at 150,000: found when the source
    # is built (the first 64 KiB were checked before; the file was read only when the run reached it).
    from trainer import train
    from trainer.config import parse_args

    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "a.txt").write_text("one document\n\nanother one\n" * 100)
    body = (b"x" * 99 + b"\n") * 1500
    (folder / "b.txt").write_bytes(body + bad + body[:50_000])
    rc = train.main(parse_args(["--training.dataset_path", str(folder), "--training.steps", "2",
                                "--training.seq_len", "16", "--training.local_batch_size", "2",
                                "--job.dump_folder", str(tmp_path / "run"), "--metrics.save_plot", "false"]))
    err = capsys.readouterr()
    assert rc == 1 and "Traceback" not in err.err
    lines = [line for line in err.err.splitlines() if "b.txt" in line]
    assert len(lines) == 1 and f"--training.dataset_path: {folder / 'b.txt'} {what}" in lines[0]
    assert f"at byte offset {len(body)}" in lines[0]
    assert "model llama3" not in err.out + err.err  # before the model is built


@pytest.mark.parametrize("enc,name", [("utf-16", "UTF-16"), ("utf-32", "UTF-32")])
def test_utf16_and_utf32_text_is_named(tmp_path, enc, name):
    f = tmp_path / "notes.txt"
    f.write_bytes("hello\n\nworld\n".encode(enc))
    with pytest.raises(ValueError, match=rf"notes.txt is {name} \(little-endian\) text \(a byte order mark at byte "
                                         rf"offset 0\); expected UTF-8: convert it \(e.g. iconv -f {enc} -t utf-8\)"):
        LocalFiles(f)
