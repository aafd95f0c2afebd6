"""Flux sampling (``trainer.models.flux.sample``) against diffusers' ``FluxPipeline(latents=...)`` on
tiny random pipelines saved with ``save_pretrained`` (guidance-distilled with the dynamic shift, and
not), from the pipeline folder and from a DCP checkpoint converted from it; and the one-line errors."""
from __future__ import annotations

import math

import pytest
import torch

from trainer.checkpoint.hf_convert import hf_to_dcp
from trainer.models.flux.flow import pack
from trainer.models.flux.sample import generate_main
from tests.trainer.flux_pipeline import save_tiny_pipeline

diffusers = pytest.importorskip("diffusers")
from safetensors.torch import load_file, save_file  # noqa: E402

PROMPTS = ["a red circle at the top left", "a blue square in the center"]


def diffusers_images(folder, latents, steps, guidance, true_cfg=1.0) -> torch.Tensor:
    pipe = diffusers.FluxPipeline.from_pretrained(folder)
    b, c, h, w = latents.shape
    out = pipe(prompt=PROMPTS, height=h * 2, width=w * 2, num_inference_steps=steps, guidance_scale=guidance,
               latents=pack(latents), output_type="pt", true_cfg_scale=true_cfg,
               negative_prompt=[""] * b if true_cfg > 1 else None).images
    return out * 2 - 1


def ours(tmp_path, args: list[str], latents) -> torch.Tensor:
    save_file({"latents": latents}, str(tmp_path / "noise.safetensors"))
    out = tmp_path / "out.safetensors"
    argv = [a for p in PROMPTS for a in ("--prompt", p)] + [
        "--height", "16", "--width", "16", "--latents_path", str(tmp_path / "noise.safetensors"), "--output", str(out),
        "--job.dump_folder", str(tmp_path / "dump"), *args]
    assert generate_main(argv) == 0
    return load_file(str(out))["images"]


@pytest.mark.parametrize("guidance", [True, False])
def test_images_equal_flux_pipeline(tmp_path, guidance):
    folder = save_tiny_pipeline(tmp_path / "pipe", guidance)
    latents = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(3))
    want = diffusers_images(folder, latents, steps=3, guidance=4.0)
    got = ours(tmp_path, ["--flux.pipeline_path", str(folder), "--num_inference_steps", "3", "--guidance", "4.0"],
               latents)
    assert got.shape == (2, 3, 16, 16)
    assert (got - want).abs().max() < 1e-4
    if guidance:  # a DCP checkpoint converted from the pipeline's transformer samples the same images
        dcp = hf_to_dcp(folder / "transformer", tmp_path / "dcp")
        again = ours(tmp_path, ["--flux.pipeline_path", str(folder), "--checkpoint.initial_load_path", str(dcp),
                                "--num_inference_steps", "3", "--guidance", "4.0"], latents)
        assert torch.equal(again, got)


def test_true_cfg_equals_flux_pipeline(tmp_path):
    folder = save_tiny_pipeline(tmp_path / "pipe", False, seed=1)
    latents = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(4))
    want = diffusers_images(folder, latents, steps=2, guidance=3.5, true_cfg=2.5)
    got = ours(tmp_path, ["--flux.pipeline_path", str(folder), "--num_inference_steps", "2", "--true_cfg_scale", "2.5"],
               latents)
    assert (got - want).abs().max() < 1e-4


def test_bad_latents_are_one_line(tmp_path, capsys):
    folder = save_tiny_pipeline(tmp_path / "pipe", False)
    save_file({"noise": torch.zeros(1)}, str(tmp_path / "bad.safetensors"))
    base = ["--prompt", "a", "--height", "16", "--width", "16", "--flux.pipeline_path", str(folder),
            "--job.dump_folder", str(tmp_path / "d")]
    assert generate_main(base + ["--latents_path", str(tmp_path / "bad.safetensors"), "--output", "x.png"]) == 1
    assert "--latents_path" in capsys.readouterr().err
    save_file({"latents": torch.zeros(1, 4, 4, 4)}, str(tmp_path / "small.safetensors"))
    assert generate_main(base + ["--latents_path", str(tmp_path / "small.safetensors"), "--output", "x.png"]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: --latents_path:") and "expected (1, 4, 8, 8)" in err
    assert generate_main(base + ["--output", "x.jpg"]) == 1
    assert "--output" in capsys.readouterr().err


def test_training_starts_from_a_pipeline_folder(tmp_path):
    """``--flavor custom --checkpoint.initial_load_in_hf``: the pipeline's transformer, trained on the
    embedded shapes through its own frozen T5, CLIP and autoencoder (16x16 pixels, 8x8 latents)."""
    from tests.trainer.helpers import train_records

    folder = save_tiny_pipeline(tmp_path / "pipe", True)
    records = train_records(
        tmp_path / "run", "--model.name", "flux", "--flavor", "custom", "--checkpoint.initial_load_in_hf",
        "--checkpoint.initial_load_path", str(folder / "transformer"), "--flux.pipeline_path", str(folder),
        "--flux.img_size", "16", "--training.dataset", "shapes", "--training.steps", "2",
        "--training.local_batch_size", "2",
        "--validation.enable", "false", "--flux.encode_cache", str(tmp_path / "cache"))
    assert [r["step"] for r in records if "loss" in r] == [1, 2]
    assert all(math.isfinite(r["loss"]) for r in records if "loss" in r)
    assert any((tmp_path / "cache" / "latents").rglob("*.safetensors"))  # the autoencoder's outputs kept


@pytest.mark.parametrize("flag", ["--true_cfg_scale", "--guidance"])
@pytest.mark.parametrize("value", ["nan", "inf"])
def test_a_guidance_that_is_not_finite_is_one_line_and_writes_nothing(tmp_path, capsys, flag, value):
    """``--true_cfg_scale nan`` (or inf, or ``--guidance nan``) wrote an image of NaN and said "wrote"."""
    folder = save_tiny_pipeline(tmp_path / "pipe", True)
    out = tmp_path / "out.png"
    assert generate_main(["--prompt", "a", "--height", "16", "--width", "16", "--flux.pipeline_path", str(folder),
                          "--job.dump_folder", str(tmp_path / "d"), "--num_inference_steps", "1",
                          flag, value, "--output", str(out)]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == f"error: {flag}: expected a finite number, got {float(value)!r}" and not out.exists()


def test_an_output_that_cannot_be_written_or_no_t5_tokens_is_one_line_before_sampling(tmp_path, capsys):
    """``--output FILE/x.png`` (a file where the folder would be) said only "[Errno 17] File exists", after
    sampling; ``--max_sequence_length 0`` was a reshape error from the T5 encoder."""
    folder = save_tiny_pipeline(tmp_path / "pipe", True)
    (tmp_path / "afile").write_text("")
    base = ["--prompt", "a", "--height", "16", "--width", "16", "--flux.pipeline_path", str(folder),
            "--job.dump_folder", str(tmp_path / "d"), "--num_inference_steps", "1"]
    assert generate_main(base + ["--output", str(tmp_path / "afile" / "x.png")]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: --output: cannot create the folder of") and "File exists" in err
    assert generate_main(base + ["--max_sequence_length", "0", "--output", str(tmp_path / "y.png")]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == "error: --max_sequence_length: expected an integer >= 1, got 0"
    assert not (tmp_path / "y.png").exists()


def test_text_generation_or_eval_of_a_flux_checkpoint_is_one_line(tmp_path, capsys):
    """A Flux checkpoint given to the text decoder's generate / eval (no --model.name flux) was an
    AttributeError traceback ('Rope' object has no attribute 'reset_parameters')."""
    from trainer.eval import main as eval_main
    from trainer.generate.cli import main as text_main

    folder = save_tiny_pipeline(tmp_path / "pipe", True)
    dcp = hf_to_dcp(folder / "transformer", tmp_path / "dcp")
    for path in (folder / "transformer", dcp):
        assert text_main(["--checkpoint.initial_load_path", str(path), "--prompt", "x"]) == 1
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert err == (f"python -m trainer.generate: error: --checkpoint.initial_load_path: {path} holds a flux model, "
                       f"not a text decoder; sample it with python -m trainer.generate --model.name flux")
    assert eval_main(["--checkpoint.initial_load_path", str(dcp), "--training.dataset_path",
                      "tests/data/tinyshakespeare.txt", "--no_progress"]) == 1
    assert "holds a flux model, not a text decoder" in capsys.readouterr().err


def test_a_negative_prompt_without_true_cfg_or_a_prompt_not_utf8_is_one_line(tmp_path, capsys):
    """--negative_prompt without --true_cfg_scale > 1 was ignored without a word; a --prompt of argv bytes
    that are not UTF-8 was the codec's message naming no option."""
    folder = save_tiny_pipeline(tmp_path / "pipe", True)
    base = ["--height", "16", "--width", "16", "--flux.pipeline_path", str(folder),
            "--job.dump_folder", str(tmp_path / "d"), "--num_inference_steps", "1", "--output", str(tmp_path / "o.png")]
    assert generate_main(["--prompt", "a", "--negative_prompt", "b", *base]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == "error: --negative_prompt: used only with --true_cfg_scale > 1, got 1.0"
    assert generate_main(["--prompt", b"\xff".decode("utf-8", "surrogateescape"), *base]) == 1
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("error: --prompt: expected UTF-8 text")
    assert not (tmp_path / "o.png").exists()
