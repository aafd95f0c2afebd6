"""bench/common.py: BENCH_OUT in a folder that does not exist yet, or naming a folder, still saves."""
import json

from bench import common


def _rows():
    return [common.Row(op="rms_norm", shape="(4, 8)", dtype="float32", impl="ours", time_s=2e-6),
            common.Row(op="rms_norm", shape="(4, 8)", dtype="float32", impl="eager", time_s=3e-6)]


def test_save_creates_missing_folders(tmp_path, monkeypatch):
    monkeypatch.setenv("BENCH_SKIP_CEILINGS", "1")  # no ceiling measurement in a unit test
    prefix = common.save(str(tmp_path / "not" / "yet" / "run1"), _rows())
    assert prefix == str(tmp_path / "not" / "yet" / "run1")
    data = json.loads((tmp_path / "not" / "yet" / "run1.json").read_text())
    assert [r["impl"] for r in data["rows"]] == ["ours", "eager"]
    assert data["rows"][0]["ratios"] == {"eager": 1.5}
    assert "| rms_norm |" in (tmp_path / "not" / "yet" / "run1.md").read_text()


def test_save_into_a_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("BENCH_SKIP_CEILINGS", "1")
    prefix = common.save(str(tmp_path / "results") + "/", _rows())
    files = sorted(p.name for p in (tmp_path / "results").iterdir())
    assert len(files) == 2 and files[0].endswith("-cpu.json") and files[1].endswith("-cpu.md")
    assert prefix.endswith("-cpu")
    common.save(str(tmp_path / "results"), _rows())  # an existing folder without the slash
    assert len(list((tmp_path / "results").iterdir())) == 2
