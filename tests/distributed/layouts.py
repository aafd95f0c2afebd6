"""Run ``python -m trainer``'s ``main`` under several parallel layouts and compare with one process.

``run_layouts(world_size, {name: argv}, folder)`` starts one process that imports torch and the
trainer, then forks ``world_size`` ranks (OMP_NUM_THREADS=1, a gloo group on a fresh port) for each
layout in turn, each with its own dump folder ``folder/name`` and metrics.jsonl. Forking from a
process that already imported everything saves torch's start-up per rank (seconds on 2 cores).

``reference(tmp_path_factory, *argv)`` is the single-process run of the same job (cached for the
test session), and ``assert_same`` compares per-step losses (absolute 1e-4, fp32) and gradient norms.

Every run is the debugmodel in float32 with a fixed seed on the deterministic embedded corpus; the
global batch is ``GLOBAL_BATCH`` sequences of ``SEQ_LEN`` tokens in every layout (local batch =
global / data-parallel degree), so every layout sees exactly the same tokens per step.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
import traceback
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from tests.distributed.launcher import free_port

STEPS = 5
SEQ_LEN = 32
GLOBAL_BATCH = 4
COMMON = ["--training.seq_len", str(SEQ_LEN), "--training.steps", str(STEPS), "--lr_scheduler.warmup_steps", "2",
          "--optimizer.lr", "3e-3", "--metrics.log_freq", "1", "--metrics.enable_color", "false",
          "--training.global_batch_size", str(GLOBAL_BATCH), "--metrics.save_plot", "false"]  # no matplotlib per run
LOSS_TOL = 1e-4
NORM_RTOL = 1e-4


def records(folder: Path, kind: str = "loss") -> dict[int, dict]:
    """The training records of ``folder/metrics.jsonl`` by step (``kind="val_loss"``: the validation ones)."""
    lines = (Path(folder) / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r for r in map(json.loads, lines) if kind in r}


def fork_context():
    """The fork context of a zygote process: one thread per rank, Triton's interpreter, and the trainer
    (torch included) imported before forking, so that the forked ranks start in milliseconds."""
    os.environ.update(OMP_NUM_THREADS="1", TRITON_INTERPRET="1")
    import trainer.train  # noqa: F401  (everything the ranks need, imported before forking)
    import trainer.parallel.parallelize  # noqa: F401

    return mp.get_context("fork")


def family_layouts(*argv: str) -> dict[str, list[str]]:
    """FSDP 2, TP 2, EP 2 and CP 2 of the job ``argv`` (a model family's flavor), 2 ranks each, with the
    local batches that keep the reference's global batch."""
    return {
        "fsdp2": [*argv, "--training.local_batch_size", "2"],
        "tp2": [*argv, "--parallelism.tensor_parallel_degree", "2", "--training.local_batch_size", "4"],
        "ep2": [*argv, "--parallelism.expert_parallel_degree", "2", "--training.local_batch_size", "2"],
        "cp2": [*argv, "--parallelism.context_parallel_degree", "2", "--training.local_batch_size", "4"],
    }


def as_rank(rank: int, world_size: int, port: int) -> None:
    """This forked process as rank ``rank`` of ``world_size`` (torchrun's variables, the rendezvous on
    ``port``), with one intra-op thread."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)


def run_main(argv: list[str], out: Path, rank: int, rc_file: str) -> None:
    """``python -m trainer``'s main with ``argv``, writing into ``out``: its exit code into
    ``out/rc_file``, or the traceback into ``out/error-<rank>.txt`` (and raised again)."""
    from trainer import train
    from trainer.config import parse_args

    try:
        rc = train.main(parse_args([*argv, "--job.dump_folder", str(out)]))
        (out / rc_file).write_text(str(rc))
    except BaseException:
        (out / f"error-{rank}.txt").write_text(traceback.format_exc())
        raise


def layouts_fixture(world_size: int, layouts: dict[str, list[str]]):
    """A module-scoped fixture: ``run_layouts(world_size, layouts, ...)`` once for the test module."""

    @pytest.fixture(scope="module")
    def ranks(tmp_path_factory):
        return run_layouts(world_size, layouts, tmp_path_factory.mktemp(f"ranks_{world_size}"))

    return ranks


def _rank_main(rank: int, world_size: int, port: int, argv: list[str], out: Path) -> None:
    as_rank(rank, world_size, port)
    run_main([*COMMON, *argv], out, rank, f"rc-{rank}")


def _zygote(world_size: int, layouts: dict[str, list[str]], folder: str, timeout: float) -> None:
    """Import torch and the trainer once, then fork the ranks of each layout from this clean process.

    Forked ranks start in milliseconds, and each layout starts with empty process-wide caches (DTensor
    caches sharding decisions under meshes that compare equal across process groups, so a second run
    in the same process could reach the groups of the first).
    """
    fork = fork_context()
    for name, argv in layouts.items():
        out = Path(folder) / name
        out.mkdir(parents=True, exist_ok=True)
        port = free_port()
        procs = [fork.Process(target=_rank_main, args=(r, world_size, port, argv, out)) for r in range(world_size)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
        if hung:
            (out / "hung.txt").write_text(f"ranks {hung} still running after {timeout}s")


def run_layouts(world_size: int, layouts: dict[str, list[str]], folder: Path, timeout: float = 300.0) -> dict:
    """``{name: records or an error message}`` for each layout; ``timeout`` seconds per layout."""
    zygote = mp.get_context("spawn").Process(target=_zygote, args=(world_size, layouts, str(folder), timeout))
    zygote.start()
    zygote.join(timeout * len(layouts) + 60)
    if zygote.is_alive():
        zygote.kill()
    results = {}
    for name in layouts:
        out = Path(folder) / name
        errors = sorted(out.glob("error-*.txt")) if out.is_dir() else []
        if errors:
            results[name] = f"{errors[0].name}:\n{errors[0].read_text()}"
        elif not (out / "metrics.jsonl").is_file() or (out / "hung.txt").is_file():
            rcs = {p.name: p.read_text() for p in out.glob("rc-*")} if out.is_dir() else {}
            hung = (out / "hung.txt").read_text() if (out / "hung.txt").is_file() else ""
            results[name] = f"no complete run (exit codes {rcs}) {hung}"
        else:
            results[name] = records(out)
    return results


def reference(tmp_path_factory, *argv: str, kind: str = "loss") -> dict[int, dict]:
    """The single-process run of ``COMMON + argv`` (local batch = the global batch), once per session;
    its training records (``kind="val_loss"``: its validation records)."""
    from trainer import train
    from trainer.config import parse_args

    key = hashlib.sha1(" ".join(argv).encode()).hexdigest()[:10]
    folder = tmp_path_factory.getbasetemp() / f"single-process-{key}"
    if not (folder / "metrics.jsonl").is_file():
        n = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            rc = train.main(parse_args([*COMMON, "--training.local_batch_size", str(GLOBAL_BATCH), *argv,
                                        "--job.dump_folder", str(folder)]))
        finally:
            torch.set_num_threads(n)
        assert rc == 0
    return records(folder, kind)


def assert_same(got, ref: dict[int, dict], steps=range(1, STEPS + 1)) -> None:
    """Per-step loss within LOSS_TOL and gradient norm within NORM_RTOL of the reference; same LR."""
    assert not isinstance(got, str), got
    assert sorted(got) == list(steps), sorted(got)
    for s in steps:
        assert abs(got[s]["loss"] - ref[s]["loss"]) <= LOSS_TOL, (s, "loss", got[s]["loss"], ref[s]["loss"])
        g, r = got[s]["grad_norm"], ref[s]["grad_norm"]
        assert abs(g - r) <= NORM_RTOL * abs(r), (s, "grad_norm", g, r)
        assert got[s]["lr"] == ref[s]["lr"], s
    if steps[0] == 1:
        assert ref[steps[-1]]["loss"] < ref[1]["loss"] - 1.0  # the run is learning, too


def family_layouts_equal_one_process(argv: list[str], tmp_path, tmp_path_factory, without: str) -> dict:
    """Run ``family_layouts(*argv)`` but ``without`` (the layout a family's default test runs) and check
    each against the single-process run of ``argv``; returns the runs (records per layout)."""
    layouts = family_layouts(*argv)
    layouts.pop(without)
    runs = run_layouts(2, layouts, tmp_path)
    single = reference(tmp_path_factory, *argv)
    for name, got in runs.items():
        assert_same(got, single), name
    return runs
