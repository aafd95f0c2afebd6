"""The README's code runs as written.

* Every ```python block executes, on its own, in a fresh namespace (each block is self-contained).
* Every ``python -m trainer ...`` / ``torchrun ... -m trainer ...`` command of a ```bash block is a
  valid configuration: its keys exist, its values have the right types, its paths resolve from the
  repository root (what a fresh clone has). Training itself is not run here (the install commands
  and multi-GPU launches cannot run in a unit test); a command that names a placeholder (``DIR``,
  ``<path>``, ``...``) is checked for its keys only.
* The validation / profiling / plot example runs exactly as written (slow: 40 CPU steps).
"""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text(encoding="utf-8")
BLOCK = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
PLACEHOLDER = re.compile(r"^(<.*>|\.\.\.|[A-Z][A-Z0-9_]*(\.[a-z]+)?)$")


def _blocks(lang: str) -> list[tuple[int, str]]:
    return [(README[:m.start()].count("\n") + 1, m.group(2)) for m in BLOCK.finditer(README) if m.group(1) == lang]


def _commands(code: str) -> list[str]:
    """Shell commands of a bash block: continuation lines joined, comments dropped."""
    joined = re.sub(r"\\\n\s*", " ", code)
    out = []
    for line in joined.splitlines():
        line = line.split(" #", 1)[0].strip()
        if line and not line.startswith("#"):
            out.extend(part.strip() for part in line.split("&&"))
    return out


def _trainer_args(command: str) -> list[str] | None:
    """The arguments after ``-m trainer`` (the module itself, not trainer.plot etc.), or None."""
    words = shlex.split(command)
    for i in range(len(words) - 1):
        if words[i] == "-m" and words[i + 1] == "trainer":
            return words[i + 2:]
    return None


PY_BLOCKS = _blocks("python")
TRAINER_COMMANDS = [(line, cmd) for line, code in _blocks("bash") for cmd in _commands(code)
                    if _trainer_args(cmd) is not None]


def test_the_readme_has_code_to_check():
    assert len(PY_BLOCKS) >= 3 and len(TRAINER_COMMANDS) >= 5


@pytest.mark.parametrize("line, code", PY_BLOCKS, ids=[f"line{line}" for line, _ in PY_BLOCKS])
def test_python_block_runs_as_written(line, code, capsys):
    exec(compile(code, f"README.md:{line}", "exec"), {"__name__": "__readme__"})


@pytest.mark.parametrize("line, command", TRAINER_COMMANDS, ids=[f"line{line}" for line, _ in TRAINER_COMMANDS])
def test_trainer_command_is_a_valid_configuration(line, command, monkeypatch):
    from trainer.config import all_keys, parse_args

    args = _trainer_args(command)
    monkeypatch.chdir(REPO)  # the README's paths are relative to the repository root
    if any(PLACEHOLDER.match(a) for a in args if not a.startswith("--")):
        for a in args:
            if a.startswith("--") and "." in a:
                key = a[2:].split("=", 1)[0].replace("-", "_")
                assert key in all_keys(), f"README.md:{line}: unknown option {a}"
        return
    if "--help" in args:
        with pytest.raises(SystemExit) as exit_:
            parse_args(args)
        assert exit_.value.code == 0
        return
    parse_args(args)


@pytest.mark.slow
def test_validation_profiling_plot_example_runs_as_written(tmp_path):
    """The README's example (trains 40 steps of the debug model: about a minute on 2 cores)."""
    block = next(code for _, code in _blocks("bash") if "--validation.enable" in code and "trainer.plot" in code)
    env = {**os.environ, "PYTHONPATH": str(REPO), "NO_COLOR": "1"}
    for cmd in _commands(block):
        words = shlex.split(cmd)
        assert words[0] == "python"
        proc = subprocess.run([sys.executable, *words[1:]], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=900)
        assert proc.returncode == 0, proc.stderr[-3000:]
    out = tmp_path / "outputs" / "tried"
    records = (out / "metrics.jsonl").read_text()
    assert '"val_loss"' in records and (out / "metrics.png").is_file()
    assert (out / "profile_trace" / "iteration_20" / "rank0_trace.json").is_file()
    assert (out / "profile_trace" / "iteration_40" / "rank0_trace.json").is_file()
