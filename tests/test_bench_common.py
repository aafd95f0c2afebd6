"""bench/common.py: BENCH_OUT in a folder that does not exist yet, or naming a folder, still saves; the
ceilings are the best measured in the process, with the load beside them, and a share over 100% of a
ceiling is flagged, never printed as a result."""
import json
import os

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


# ----------------------------------------------------------------------------- ceilings and shares


def test_share_over_the_ceiling_is_flagged_not_printed(tmp_path, monkeypatch):
    monkeypatch.setenv("BENCH_SKIP_CEILINGS", "1")
    rows = _rows()
    rows[0].gbps, rows[0].bw_share, rows[0].tflops, rows[0].flop_share = 40.0, 5.06, 2.0, 0.37
    rows[1].flop_share = 8.01
    text = common.table(rows)
    assert "| 506 |" not in text and "| 801 |" not in text, text
    assert text.count(">100% (ceiling measured under load)") == 2 and "| 37 |" in text, text
    assert common.share_cell(0.5) == "50" and common.share_cell(0.5, "%") == "50%" and common.share_cell(0.0) == ""
    assert common.share_cell(1.0) == "100" and common.share_cell(1.0001).startswith(">100%")
    prefix = common.save(str(tmp_path / "run"), rows)
    data = json.loads((tmp_path / "run.json").read_text())
    ours, eager = data["rows"]
    assert ours["bw_share"] is None and ours["flop_share"] == 0.37
    assert ours["measurement_error"] == "bw_share 5.06 > 1: ceiling measured under load"
    assert eager["flop_share"] is None and "flop_share 8.01" in eager["measurement_error"]
    assert "measurement_error" not in common.row_json(common.Row("op", "", "float32", "x", 1.0, bw_share=0.9))
    md = (tmp_path / "run.md").read_text()
    assert "| 506 |" not in md and md.count(">100% (ceiling measured under load)") == 2, md
    assert "load now" in md and prefix == str(tmp_path / "run")


def test_the_best_measurement_of_a_ceiling_wins(monkeypatch):
    monkeypatch.setattr(common, "CEILINGS", {})
    rates = iter([5.0, 3.0, 7.0, 9.0, 11.0, 13.0])
    assert common._ceiling("x", lambda: next(rates), remeasure=False) == 5.0
    assert common._ceiling("x", lambda: next(rates), remeasure=False) == 5.0  # cached: not measured again
    assert common._ceiling("x", lambda: next(rates), remeasure=True) == 5.0  # 3.0 measured, worse: kept 5
    assert common._ceiling("x", lambda: next(rates), remeasure=True) == 7.0
    assert common.CEILINGS["x"].samples == 3
    common._ceiling("x", lambda: next(rates), remeasure=True)  # the last one allowed (MAX_REMEASURES = 3)
    assert common._ceiling("x", lambda: next(rates), remeasure=True) == 9.0 and common.CEILINGS["x"].samples == 4
    load, kept = common.load_average(), common.CEILINGS["x"].load  # the load when the best one was measured
    assert (load is None and kept is None) or (len(kept) == 3 and all(x >= 0 for x in kept)), (load, kept)


def test_run_remeasures_a_ceiling_it_exceeds(monkeypatch):
    # A ceiling measured under load (1 MB/s here): the row above it measures the ceiling again, keeps
    # the better figure, and prints the load the ceiling was measured under.
    monkeypatch.setattr(common, "CEILINGS", {"copy": common.Ceiling(1e6, (9.0, 9.0, 9.0))})
    monkeypatch.setattr(common, "ROWS", [])
    monkeypatch.setattr(common, "measure", lambda fn: 1e-3)  # every timing 1 ms: no real clock in a unit test
    monkeypatch.setenv("BENCH_DEVICE", "cpu")
    row = common.run(None, lambda: None, op="copy", impl="ours", shape=(3,), dtype="float32", bytes_moved=1e6)
    ceiling = common.CEILINGS["copy"]
    assert ceiling.samples == 2 and ceiling.value == 2 * (1 << 26) / 1e-3  # 64 MiB read + written in 1 ms
    assert row.bw_share == 1e6 / 1e-3 / ceiling.value and common.ROWS == [row]
    line = common.ceilings_line()
    assert line.startswith("ceilings measured in this process: copy 134.2 GB/s (load ") and "best of 2" in line
    assert "load now" in line and f"on {os.cpu_count()} CPUs" in line
    env = common.environment()
    assert env["ceilings"]["copy"]["samples"] == 2 and "load_average" in env
