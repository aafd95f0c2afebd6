"""Flux training: the debug flavor lowers the loss on the embedded shapes and writes validation
samples; the captioned-image sources (folder, JSONL, Parquet, WebDataset) read the same pictures and
refuse bad files in one line; the loader deals samples (and caption dropout) alike in every layout
and resumes exactly; the encode cache serves later epochs; the timestep shift is FLUX.1's."""
from __future__ import annotations

import io
import json
import math
import tarfile

import numpy as np
import pytest
import torch

from trainer.models.flux.args import FLUX_FLAVORS
from trainer.models.flux.flow import sample_timesteps, shift_mu
from trainer.models.flux.loader import FluxLoader
from trainer.models.flux.shapes import ShapesSource, caption, draw
from trainer.models.flux.sources import open_source, preprocess
from tests.trainer.helpers import train_records

pytest.importorskip("transformers")


def test_debugmodel_trains_and_writes_samples(tmp_path):
    records = train_records(
        tmp_path, "--model.name", "flux", "--flavor", "debugmodel", "--training.steps", "8",
        "--training.local_batch_size", "8", "--lr_scheduler.warmup_steps", "2", "--optimizer.lr", "2e-3",
        "--validation.freq", "8", "--validation.steps", "1", "--flux.sample_steps", "2", "--flux.sample_count", "2",
        "--flux.caption_dropout", "0.2", "--flux.img_size", "16", "--checkpoint.last_save_in_hf",
        "--metrics.enable_tensorboard")
    losses = [r["loss"] for r in records if "loss" in r]
    assert losses[-1] < losses[0] * 0.8, losses
    val = [r for r in records if "val_loss" in r]
    assert len(val) == 1 and math.isfinite(val[0]["val_loss"]) and "val_perplexity" not in val[0]
    from PIL import Image

    with Image.open(tmp_path / "samples" / "step-8.png") as im:
        assert im.size == (32, 16)  # two 16x16 samples side by side
    assert len((tmp_path / "samples" / "step-8.txt").read_text().splitlines()) == 2
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(next((tmp_path / "tb").rglob("events.*")).parent)).Reload()
    (event,) = events.Images("validation/samples")  # the two samples of step 8, side by side
    assert (event.step, event.width, event.height) == (8, 32, 16)
    diffusers = pytest.importorskip("diffusers")
    exported = next((tmp_path / "checkpoint").glob("hf-step-8"))  # the run's end as a transformer/ folder
    assert sorted(p.name for p in exported.iterdir()) == ["config.json", "diffusion_pytorch_model.safetensors"]
    _, info = diffusers.FluxTransformer2DModel.from_pretrained(exported, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))


def _write_set(root, n=3):
    """n shapes as PNG + .txt in a folder, the same in a JSONL, a Parquet and a tar shard."""
    from PIL import Image
    import pyarrow as pa
    import pyarrow.parquet as pq

    (root / "img").mkdir(parents=True)
    rows, blobs = [], []
    for i in range(n):
        buf = io.BytesIO()
        Image.fromarray(draw(i)).save(buf, format="PNG")
        blobs.append(buf.getvalue())
        (root / "img" / f"{i:03d}.png").write_bytes(blobs[-1])
        (root / "img" / f"{i:03d}.txt").write_text(caption(i))
        rows.append({"image": f"img/{i:03d}.png", "caption": caption(i)})
    (root / "set.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    pq.write_table(pa.table({"image": blobs, "text": [caption(i) for i in range(n)]}), root / "set.parquet")
    with tarfile.open(root / "shard-0.tar", "w") as tar:
        for i in range(n):
            for name, data in ((f"{i:03d}.png", blobs[i]),
                               (f"{i:03d}.txt", caption(i).encode())):
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))


def test_every_source_reads_the_same_captioned_images(tmp_path):
    _write_set(tmp_path)
    for path in (tmp_path / "img", tmp_path / "set.jsonl", tmp_path / "set.parquet", tmp_path / "shard-0.tar"):
        src = open_source(str(path))
        assert len(src) == 3, path
        for i in range(3):
            img, cap = src.item(i)
            assert cap == caption(i) and np.array_equal(img, draw(i)), path


def test_bad_files_are_one_line_naming_the_file(tmp_path):
    _write_set(tmp_path)
    (tmp_path / "img" / "002.txt").unlink()
    with pytest.raises(ValueError, match=r"002\.png: no caption file 002\.txt"):
        open_source(str(tmp_path / "img"))
    (tmp_path / "img" / "002.png").unlink()
    (tmp_path / "img" / "notes.csv").write_text("x")
    with pytest.raises(ValueError, match=r"notes\.csv: not an image"):
        open_source(str(tmp_path / "img"))
    (tmp_path / "img" / "notes.csv").unlink()
    (tmp_path / "img" / "001.png").write_bytes(b"not a png")
    src = open_source(str(tmp_path / "img"))
    with pytest.raises(ValueError, match=r"001\.png: not a readable image") as e:
        src.item(1)
    assert "\n" not in str(e.value)
    (tmp_path / "bad.jsonl").write_text('{"image": "img/000.png", "caption": "x"}\n{oops\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: not a JSON object"):
        open_source(str(tmp_path / "bad.jsonl"))


def test_a_caption_that_is_not_utf8_is_one_line_naming_it(tmp_path):
    """The message was codec's alone ('utf-8' codec can't decode byte 0xff...), naming no file."""
    _write_set(tmp_path)
    (tmp_path / "img" / "001.txt").write_bytes(b"\xff\xfered")
    with pytest.raises(ValueError, match=r"001\.txt: not UTF-8 text \(byte 0\)"):
        open_source(str(tmp_path / "img")).item(1)


def test_an_unreadable_image_among_the_validation_samples_is_one_line(tmp_path, capsys):
    """The validator reads its sample captions (and images) at start-up: a corrupt image there was a raw
    ValueError traceback, not the one line training gives for the same file."""
    from trainer.__main__ import main

    _write_set(tmp_path, n=4)
    (tmp_path / "img" / "002.png").write_bytes(b"not a png")  # not in the first training batch (checked at start)
    code = main(["--model.name", "flux", "--flavor", "debugmodel", "--training.steps", "1",
                 "--training.local_batch_size", "2", "--flux.img_size", "16", "--validation.enable",
                 "--training.dataset_path", str(tmp_path / "img"), "--job.dump_folder", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 1 and err.startswith("python -m trainer: error: --training.dataset_path: ")
    assert err.endswith("002.png: not a readable image (UnidentifiedImageError)")


def test_preprocess_resizes_and_center_crops():
    img = np.zeros((40, 80, 3), dtype=np.uint8)
    img[:, 20:60] = 255  # the center square is white
    out = preprocess(img, 16)
    assert out.shape == (3, 16, 16) and out.min() >= -1 and out.max() <= 1
    assert out.mean() > 0.9


def test_loader_deals_samples_and_dropout_alike_in_every_layout_and_resumes():
    def tok(caps):  # the "T5 ids" are the caption's length (0 when dropped)
        return torch.tensor([[len(c)] for c in caps]), torch.zeros(len(caps), 1, dtype=torch.int64)

    src = ShapesSource(n=10)
    one = FluxLoader(src, tok, 32, 4, seed=5, caption_dropout=0.5)
    two = [FluxLoader(src, tok, 32, 2, r, 2, seed=5, caption_dropout=0.5) for r in range(2)]
    dropped = 0
    for _ in range(3):  # crosses an epoch (10 items); t5_ids[:, 0] is the caption's length, 0 when dropped
        a = next(one)
        parts = [next(ld) for ld in two]
        got = {int(s): (int(i), int(t)) for p in parts for s, i, t in zip(p["sample"], p["item"], p["t5_ids"][:, 0])}
        assert got == {int(s): (int(i), int(t)) for s, i, t in zip(a["sample"], a["item"], a["t5_ids"][:, 0])}
        dropped += int((a["t5_ids"][:, 0] == 0).sum())
    assert 0 < dropped < 12
    state = two[1].state_dict()
    again = FluxLoader(src, tok, 32, 4, seed=5, caption_dropout=0.5)
    from trainer.data.reshard import reshard_loader_state

    again.load_state_dict(reshard_loader_state([ld.state_dict() for ld in two], 0, 1))
    assert torch.equal(next(again)["sample"], next(one)["sample"])
    with pytest.raises(ValueError, match="img_size"):
        FluxLoader(src, tok, 64, 4).load_state_dict(state)


def test_encode_cache_serves_later_epochs(tmp_path):
    from trainer.config import parse_args
    from trainer.models.flux.encoders import EncodeCache, FluxEncoders
    from trainer.models.flux.task import FluxTask

    args = FLUX_FLAVORS["debugmodel"]
    config = parse_args(["--model.name", "flux", "--flux.encode_cache", str(tmp_path / "cache")])
    task = FluxTask()
    task.encoders = FluxEncoders(args, config.flux, torch.device("cpu"))
    task.cache = EncodeCache(config.flux.encode_cache)
    task.sources["training"] = src = ShapesSource(n=4)
    loader = FluxLoader(src, task.encoders.tokenize, 32, 4)
    batch = next(loader)
    first = task.encode(batch)
    assert task.cache.misses == 4 and task.cache.hits == 0
    direct = task.encoders.encode_text(batch["t5_ids"], batch["clip_ids"])
    assert torch.equal(first[1], direct[0]) and torch.equal(first[2], direct[1])
    batch2 = next(loader)  # the next epoch: the same 4 captions, in another order
    second = task.encode(batch2)
    assert task.cache.hits == 4 and task.cache.misses == 4
    direct = task.encoders.encode_text(batch2["t5_ids"], batch2["clip_ids"])
    assert torch.equal(second[1], direct[0]) and torch.equal(second[2], direct[1])


def test_timesteps_are_logit_normal_shifted_by_resolution():
    u = torch.linspace(-2, 2, 9)
    t = sample_timesteps(u, "logit_normal", 4096, shift=False)
    assert torch.allclose(t, torch.sigmoid(u))
    shifted = sample_timesteps(u, "logit_normal", 4096, shift=True)
    mu = 1.15
    assert shift_mu(4096) == pytest.approx(mu) and shift_mu(256) == pytest.approx(0.5)
    assert torch.allclose(shifted, math.exp(mu) / (math.exp(mu) + 1 / torch.sigmoid(u) - 1))
    assert (shifted > t).all()


def test_a_resumed_run_continues_exactly(tmp_path):
    """Resumed from its step-2 checkpoint, a run gives the losses it gave going through: the loader's
    position and every sample's noise, timestep and dropout come back."""
    import shutil

    argv = ["--model.name", "flux", "--flavor", "debugmodel", "--training.local_batch_size", "2",
            "--flux.img_size", "16", "--validation.enable", "false", "--checkpoint.enable",
            "--checkpoint.interval", "2", "--lr_scheduler.warmup_steps", "1", "--flux.caption_dropout", "0.5",
            "--training.steps", "4"]
    whole = {r["step"]: r["loss"] for r in train_records(tmp_path / "whole", *argv) if "loss" in r}
    shutil.copytree(tmp_path / "whole", tmp_path / "resumed")
    shutil.rmtree(tmp_path / "resumed" / "checkpoint" / "step-4")
    again = {r["step"]: r["loss"] for r in train_records(tmp_path / "resumed", *argv) if "loss" in r}
    assert sorted(whole) == [1, 2, 3, 4] and whole[4] != whole[3]
    assert all(abs(again[s] - whole[s]) < 1e-6 for s in (3, 4)), (again, whole)
