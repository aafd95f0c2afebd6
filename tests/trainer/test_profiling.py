"""Profiler traces land at <dump>/<save_traces_folder>/iteration_<step>/rank<r>_trace.json and hold the
steps of their cycle; memory snapshots are refused once on a CPU; the cycle stays aligned after a resume;
the validation pass is left out of the traces unless include_validation."""
import json
import logging
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from trainer import train
from trainer.config import ConfigError, parse_args
from trainer.observe.profiling import Profiler

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _cfg(**kw):
    base = dict(enable_profiling=True, profile_freq=4, profiler_warmup=1, profiler_active=2,
                save_traces_folder="profile_trace", enable_memory_snapshot=False, include_validation=False,
                save_memory_snapshot_folder="memory_snapshot")
    return SimpleNamespace(**{**base, **kw})


def _profiled_steps(path: Path) -> list[int]:
    """The training steps recorded in a trace (torch names step s 'ProfilerStep#<s - 1>')."""
    events = json.loads(path.read_text())["traceEvents"]
    return sorted({int(e["name"].split("#")[1]) + 1 for e in events if e.get("name", "").startswith("ProfilerStep#")})


def _work(step: int) -> None:
    a = torch.randn(32, 32)
    with torch.profiler.record_function(f"work_{step}"):
        (a @ a).sum()


@pytest.mark.parametrize("start_step", [0, 5])
def test_traces_every_profile_freq_steps_hold_the_last_active_steps(tmp_path, start_step):
    with Profiler(_cfg(), str(tmp_path), rank=3, device=torch.device("cpu"), start_step=start_step) as prof:
        for step in range(start_step + 1, 14):
            _work(step)
            prof.step(step)
    cycles = [s for s in range(start_step + 1, 14) if s % 4 == 0]
    folders = sorted(p.name for p in (tmp_path / "profile_trace").iterdir())
    assert folders == sorted(f"iteration_{s}" for s in cycles)
    for s in cycles:
        path = tmp_path / "profile_trace" / f"iteration_{s}" / "rank3_trace.json"
        assert prof.traces_written.count(path) == 1
        assert _profiled_steps(path) == [s - 1, s]  # active 2: the cycle's last two steps
        names = {e.get("name") for e in json.loads(path.read_text())["traceEvents"]}
        assert f"work_{s}" in names and f"work_{s - 2}" not in names and "aten::mm" in names


def test_memory_snapshot_on_cpu_says_once_it_is_cuda_only(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="trainer"):
        with Profiler(_cfg(enable_profiling=False, enable_memory_snapshot=True), str(tmp_path), 0,
                      torch.device("cpu")) as prof:
            for step in range(1, 9):
                prof.step(step)
    msgs = [r.getMessage() for r in caplog.records if "memory snapshot" in r.getMessage()]
    assert len(msgs) == 1 and "CUDA-only" in msgs[0] and "cpu" in msgs[0]
    assert not (tmp_path / "memory_snapshot").exists() and prof.snapshots_written == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA memory snapshots need a CUDA device")
def test_memory_snapshots_on_cuda(tmp_path):
    import pickle

    with Profiler(_cfg(enable_profiling=False, enable_memory_snapshot=True, profile_freq=2), str(tmp_path), 0,
                  torch.device("cuda")) as prof:
        keep = []
        for step in range(1, 5):
            keep.append(torch.empty(1 << 20, device="cuda"))
            prof.step(step)
    for s in (2, 4):
        path = tmp_path / "memory_snapshot" / f"iteration_{s}" / "rank0_memory_snapshot.pickle"
        snap = pickle.loads(path.read_bytes())
        assert "segments" in snap and snap["segments"]


def test_trainer_writes_traces_at_the_documented_path(tmp_path, capsys):
    rc = train.main(parse_args([
        "--training.seq_len", "16", "--training.local_batch_size", "2", "--training.steps", "6",
        "--metrics.log_freq", "3", "--metrics.save_plot", "false", "--metrics.enable_color", "false",
        "--job.dump_folder", str(tmp_path), "--profiling.enable_profiling", "--profiling.profile_freq", "3",
        "--profiling.profiler_warmup", "1", "--profiling.profiler_active", "1",
        "--profiling.save_traces_folder", "traces", "--profiling.enable_memory_snapshot",
    ]))
    assert rc == 0
    for s in (3, 6):
        path = tmp_path / "traces" / f"iteration_{s}" / "rank0_trace.json"
        assert _profiled_steps(path) == [s]
    out = capsys.readouterr().out
    assert f"profiler traces {tmp_path / 'traces'}" in out and out.count("CUDA-only") == 1


def _names(path: Path) -> set[str]:
    return {e.get("name", "") for e in json.loads(path.read_text())["traceEvents"]}


@pytest.mark.parametrize("include", [False, True])
def test_validation_is_left_out_of_traces_unless_asked(tmp_path, include):
    with Profiler(_cfg(include_validation=include), str(tmp_path), 0, torch.device("cpu")) as prof:
        for step in range(1, 5):
            _work(step)
            with prof.validation():
                with torch.profiler.record_function("val_forward"):
                    _work(100 + step)
                    time.sleep(0.3 if step == 4 else 0)  # the validation at the end of the cycle
            prof.step(step)
    path = tmp_path / "profile_trace" / "iteration_4" / "rank0_trace.json"
    names = _names(path)
    assert _profiled_steps(path) == [3, 4]
    # the cycle's last step's range ends before its validation unless it is included (so the trace
    # is written before it; a validation after an earlier step of the cycle is a gap in the next step's range)
    step_4 = [e for e in json.loads(path.read_text())["traceEvents"] if e.get("name") == "ProfilerStep#3"]
    assert (step_4[0]["dur"] > 0.3e6) == include
    assert {"work_3", "work_4"} <= names  # the training steps are traced either way
    assert ({"validation", "val_forward", "work_104"} <= names) == include
    assert not include or "work_102" not in names  # (the wait/warmup steps are not recorded)
    if not include:
        assert not names & {"validation", "val_forward", "work_103", "work_104"}


def test_trainer_marks_the_validation_pass_and_traces_it_when_asked(tmp_path):
    """The trainer wraps each evaluation in Profiler.validation (traced here, with include_validation);
    that it is left out by default is the test above (one short run: a profiled run is slow on the CPU)."""
    rc = train.main(parse_args([
        "--training.seq_len", "16", "--training.local_batch_size", "2", "--training.steps", "3",
        "--metrics.save_plot", "false", "--metrics.enable_color", "false", "--job.dump_folder", str(tmp_path),
        "--validation.enable", "--validation.freq", "3", "--validation.steps", "2",
        "--profiling.enable_profiling", "--profiling.profile_freq", "3", "--profiling.profiler_warmup", "1",
        "--profiling.profiler_active", "1", "--profiling.include_validation",
    ]))
    assert rc == 0
    names = _names(tmp_path / "profile_trace" / "iteration_3" / "rank0_trace.json")
    assert {"ProfilerStep#2", "validation"} <= names
    assert parse_args([]).profiling.include_validation is False


def test_profiling_config_errors():
    with pytest.raises(ConfigError, match=r"--profiling.profile_freq: expected an integer >= profiler_warmup \+ "
                                          r"profiler_active = 4, got 3"):
        parse_args(["--profiling.enable_profiling", "--profiling.profile_freq", "3"])
    parse_args(["--profiling.profile_freq", "3"])  # not profiling: no constraint
    with pytest.raises(ConfigError, match="--profiling.profiler_active: expected an integer >= 1"):
        parse_args(["--profiling.profiler_active", "0"])
