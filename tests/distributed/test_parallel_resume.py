"""Checkpoint resharding: save under one layout, resume under another, same next-step losses.

  FSDP 4 -> FSDP 2 x TP 2   (4 ranks; data loader states of 4 ranks resharded to 2)
  PP 2 (Interleaved1F1B) -> FSDP 2, no pipeline   (2 ranks; loader 1 -> 2 ranks)

Each save run trains 5 steps with checkpoints at steps 3 and 5; the resume run loads step 3 and
trains steps 4 and 5, whose losses must equal the single-process run's within 1e-4 (gradient norms
1e-4 relative). DCP reshards the model and optimizer (parameter names do not depend on the layout);
``trainer.checkpoint.checkpointer.reshard_loader_state`` reshards the data loader, tested here on its own too.
About 40 s.
"""
from pathlib import Path

import pytest
import torch

from tests.distributed.layouts import assert_same, reference, run_layouts
from trainer.data.reshard import reshard_loader_state
from trainer.data import build_tokenizer
from trainer.data.datasets import build_source
from trainer.data.loader import DataLoader

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

CKPT = ["--checkpoint.enable", "--checkpoint.interval", "3"]


def _resume(folder: Path, saved: str) -> list[str]:
    return [*CKPT, "--checkpoint.folder", str(folder / saved / "checkpoint"), "--checkpoint.load_step", "3",
            "--checkpoint.interval", "100"]


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return reference(tmp_path_factory)


def test_fsdp4_checkpoint_resumes_under_fsdp2_tp2(tmp_path, single):
    layouts = {
        "fsdp4": [*CKPT, "--training.local_batch_size", "1"],
        "fsdp2_tp2": [*_resume(tmp_path, "fsdp4"), "--parallelism.tensor_parallel_degree", "2",
                      "--training.local_batch_size", "2"],
    }
    runs = run_layouts(4, layouts, tmp_path)
    assert_same(runs["fsdp4"], single)
    assert_same(runs["fsdp2_tp2"], single, steps=range(4, 6))


def test_pp2_checkpoint_resumes_without_pipeline(tmp_path, single):
    layouts = {
        "pp2": [*CKPT, "--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule",
                "Interleaved1F1B", "--training.local_batch_size", "4"],
        "fsdp2": [*_resume(tmp_path, "pp2"), "--training.local_batch_size", "2"],
    }
    runs = run_layouts(2, layouts, tmp_path)
    assert_same(runs["pp2"], single)
    assert_same(runs["fsdp2"], single, steps=range(4, 6))


# ------------------------------------------------------------------------------------------ the loader alone


def _loaders(text: Path, world: int, batch: int, seq: int = 8) -> list[DataLoader]:
    return [DataLoader(build_source("", str(text)), build_tokenizer(None), seq, batch, r, world) for r in range(world)]


def _rows(batches) -> set[tuple[int, ...]]:
    return {tuple(row.tolist()) for b in batches for row in b["input_ids"]}


@pytest.fixture
def corpus(tmp_path):
    text = tmp_path / "corpus.txt"
    text.write_text("\n\n".join(f"document {i}: " + "lorem ipsum " * (i % 5 + 1) for i in range(40)))
    return text


@pytest.mark.parametrize("old, new", [(4, 2), (2, 3), (1, 4), (3, 1)])
def test_resharded_loaders_read_exactly_what_one_loader_reads_next(corpus, old, new):
    steps, global_batch = 3, 12
    old_loaders = _loaders(corpus, old, global_batch // old)
    for loader in old_loaders:
        for _ in range(steps):
            next(loader)
    states = [loader.state_dict() for loader in old_loaders]
    one = _loaders(corpus, 1, global_batch)[0]
    for _ in range(steps):
        next(one)
    expected = _rows([next(one), next(one)])  # the next two global batches
    new_loaders = _loaders(corpus, new, global_batch // new)
    for r, loader in enumerate(new_loaders):
        loader.load_state_dict(reshard_loader_state(states, r, new))
    got = [next(loader) for loader in new_loaders for _ in range(2)]
    assert _rows(got) == expected and sum(b["input_ids"].shape[0] for b in got) == 2 * global_batch


def test_same_layout_gets_its_own_state_back(corpus):
    loaders = _loaders(corpus, 2, 3)
    next(loaders[0])
    states = [loader.state_dict() for loader in loaders]
    assert reshard_loader_state(states, 1, 2) == states[1]


def test_states_from_different_steps_are_refused(corpus):
    loaders = _loaders(corpus, 2, 3)
    next(loaders[0])
    next(loaders[0])
    next(loaders[1])  # rank 1 is a step behind rank 0: no exact position for another layout
    with pytest.raises(ValueError, match=r"ranks \[0\] are not at the same step as rank 1"):
        reshard_loader_state([loader.state_dict() for loader in loaders], 0, 3)
    with pytest.raises(ValueError, match="do not form one layout"):
        reshard_loader_state([loaders[1].state_dict()], 0, 1)
    assert torch.is_tensor(next(loaders[1])["input_ids"])
