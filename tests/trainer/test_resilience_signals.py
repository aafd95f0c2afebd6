"""Signals (issue 20): SIGTERM at a random moment stops at a step with a checkpoint (exit 75) and the
resumed run equals an uninterrupted one; Ctrl-C during a save is one line and exit 130 with the last
good checkpoint intact; a Ctrl-C after a preemption signal aborts at once; the grace period bounds
the exit (124). Each case is ``python -m trainer`` in a subprocess (signals reach a real process),
a few seconds each.
"""
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from trainer.checkpoint.folder import complete_steps

REPO = Path(__file__).resolve().parents[2]
BASE = ["--training.seq_len", "32", "--training.local_batch_size", "2", "--lr_scheduler.warmup_steps", "2",
        "--lr_scheduler.decay_ratio", "0", "--metrics.log_freq", "1", "--metrics.enable_color", "false",
        "--metrics.save_plot", "false"]
ENV = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}

# The trainer with a checkpoint write that prints WRITING and then takes `delay` seconds.
SLOW_SAVE = textwrap.dedent("""
    import sys, time
    from torch.distributed.checkpoint import FileSystemWriter
    real = FileSystemWriter.write_data
    def slow(self, *a, **kw):
        print("WRITING", flush=True)
        time.sleep({delay})
        return real(self, *a, **kw)
    FileSystemWriter.write_data = slow
    from trainer.__main__ import main
    sys.exit(main(sys.argv[1:]))
""")


def records(folder):
    lines = (Path(folder) / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r for r in map(json.loads, lines) if "loss" in r}


def start(folder, steps, *extra, script=None):
    argv = [*BASE, "--training.steps", str(steps), "--job.dump_folder", str(folder), *extra]
    cmd = [sys.executable, "-c", script, *argv] if script else [sys.executable, "-m", "trainer", *argv]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV, cwd=REPO)


def wait_for(proc, text, timeout=120):
    deadline = time.monotonic() + timeout
    lines = []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if text in line:
            return lines
    proc.kill()
    raise AssertionError(f"{text!r} not seen; output:\n{''.join(lines)}\n{proc.stderr.read()}")


def finish(proc, timeout=120):
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def test_sigterm_at_a_random_moment_saves_exits_75_and_resumes_exactly(tmp_path):
    straight = tmp_path / "straight"
    rc, _, err = finish(start(straight, 14))
    assert rc == 0, err
    run = tmp_path / "run"
    proc = start(run, 14, "--checkpoint.enable", "--checkpoint.interval", "100")
    wait_for(proc, "step  2")
    time.sleep(random.Random().uniform(0.0, 0.4))  # anywhere inside a step
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    rc, out, err = finish(proc)
    took = time.monotonic() - t0
    assert rc == 75, err
    (line,) = err.splitlines()
    assert "stopped after step" in line and "SIGTERM" in line and "run the same command to resume" in line
    stopped = int(line.split("stopped after step ")[1].split()[0])
    assert complete_steps(run / "checkpoint") == [stopped] and took < 80  # within the default grace
    rc, _, err = finish(start(run, 14, "--checkpoint.enable", "--checkpoint.interval", "100"))
    assert rc == 0, err
    got, ref = records(run), records(straight)
    assert sorted(got) == list(range(1, 15))
    for s in range(1, 15):  # the same steps, nothing lost or repeated: equal losses (one process, same threads)
        assert abs(got[s]["loss"] - ref[s]["loss"]) <= 1e-6, (s, got[s]["loss"], ref[s]["loss"])


def test_sigterm_without_checkpoints_says_nothing_was_saved(tmp_path):
    proc = start(tmp_path / "run", 200)  # --checkpoint.enable is off by default
    wait_for(proc, "step  2")
    proc.send_signal(signal.SIGTERM)
    rc, out, err = finish(proc)
    assert rc == 75, err
    (line,) = err.splitlines()
    assert "with no checkpoint (--checkpoint.enable is off: a rerun starts at step 1)" in line
    assert "resume" not in line and "saved" not in out + err and not (tmp_path / "run" / "checkpoint").exists()


def test_ctrl_c_during_a_save_is_one_line_and_130_with_the_last_checkpoint_intact(tmp_path):
    run = tmp_path / "run"
    rc, _, err = finish(start(run, 2, "--checkpoint.enable", "--checkpoint.interval", "2"))
    assert rc == 0 and complete_steps(run / "checkpoint") == [2], err
    proc = start(run, 6, "--checkpoint.enable", "--checkpoint.interval", "2", script=SLOW_SAVE.format(delay=30))
    wait_for(proc, "WRITING")  # the save of step 4 is in flight
    proc.send_signal(signal.SIGINT)
    rc, out, err = finish(proc, timeout=20)
    assert rc == 130, err
    (line,) = err.splitlines()
    assert "interrupted while saving checkpoint step-4" in line and "the last good checkpoint is step-2" in line
    assert complete_steps(run / "checkpoint") == [2]  # intact; the .partial is removed by the next save
    rc, _, err = finish(start(run, 6, "--checkpoint.enable", "--checkpoint.interval", "2"))
    assert rc == 0 and complete_steps(run / "checkpoint") == [4, 6], err
    assert not list((run / "checkpoint").glob(".*partial"))


def test_a_second_signal_aborts_at_once_and_the_grace_period_bounds_the_exit(tmp_path):
    run = tmp_path / "run"
    slow = SLOW_SAVE.format(delay=30)
    proc = start(run, 50, "--checkpoint.enable", "--checkpoint.interval", "100", script=slow)
    wait_for(proc, "step  2")
    proc.send_signal(signal.SIGTERM)
    wait_for(proc, "WRITING")  # the preemption checkpoint is being written
    proc.send_signal(signal.SIGTERM)  # a repeat (launchers deliver it twice): ignored
    time.sleep(0.5)
    assert proc.poll() is None
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)  # the second signal: abort now
    rc, _, err = finish(proc, timeout=20)
    assert rc == 130 and time.monotonic() - t0 < 5 and len(err.splitlines()) == 1, err
    assert complete_steps(run / "checkpoint") == []
    proc = start(tmp_path / "grace", 50, "--checkpoint.enable", "--checkpoint.interval", "100",
                 "--checkpoint.preempt_grace_seconds", "2", script=slow)
    wait_for(proc, "step  2")
    t0 = time.monotonic()
    proc.send_signal(signal.SIGUSR1)
    rc, _, err = finish(proc, timeout=30)
    assert rc == 124 and time.monotonic() - t0 < 10, err
    assert "SIGUSR1 received 2s ago" in err.splitlines()[-1]
