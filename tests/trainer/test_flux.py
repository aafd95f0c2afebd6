"""Flux (``--model.name flux``): the transformer against diffusers' ``FluxTransformer2DModel`` (float64
reference, guidance on and off), the parameter counts, diffusers folders both ways (``transformer/``
in and out, ``python -m trainer.convert``), and the one-line refusals of configs we cannot reproduce."""
from __future__ import annotations

import json

import pytest
import torch

from trainer.checkpoint.checkpointer import Checkpointer
from trainer.convert import main as convert_main
from trainer.hf import HFCheckpoint, HFCheckpointError, args_from_hf_config, hf_config, load_into_model
from trainer.checkpoint.hf_convert import hf_to_dcp
from trainer.hf.mapping import from_hf_state_dict
from trainer.models.common.args import format_params
from trainer.models.flux.args import FLUX_FLAVORS, FluxArgs
from trainer.registry import build_model
from tests.trainer.helpers import cpu_model, rel

diffusers = pytest.importorskip("diffusers")


def tiny(guidance: bool) -> FluxArgs:
    """Awkward small shapes: 2 heads of 16 (rotary axes 4 + 6 + 6), 8 input channels, 24-dim text."""
    return FluxArgs(dim=32, n_heads=2, head_dim=16, n_double_layers=2, n_single_layers=2, in_channels=8,
                    latent_channels=2, context_dim=24, vec_dim=12, axes_dim=(4, 6, 6), guidance_embed=guidance)


def diffusers_model(args: FluxArgs):
    return diffusers.FluxTransformer2DModel(
        patch_size=1, in_channels=args.in_channels, num_layers=args.n_double_layers,
        num_single_layers=args.n_single_layers, attention_head_dim=args.head_dim, num_attention_heads=args.n_heads,
        joint_attention_dim=args.context_dim, pooled_projection_dim=args.vec_dim, guidance_embeds=args.guidance_embed,
        axes_dims_rope=args.axes_dim)


def inputs(args: FluxArgs, b=2, h=3, w=5, n_txt=7, seed=1):
    g = torch.Generator().manual_seed(seed)
    img_ids = torch.zeros(h * w, 3)
    img_ids[:, 1] = torch.arange(h).repeat_interleave(w)
    img_ids[:, 2] = torch.arange(w).repeat(h)
    return dict(img=torch.randn(b, h * w, args.in_channels, generator=g),
                txt=torch.randn(b, n_txt, args.context_dim, generator=g), vec=torch.randn(b, args.vec_dim, generator=g),
                timesteps=torch.rand(b, generator=g), img_ids=img_ids, txt_ids=torch.zeros(n_txt, 3),
                guidance=torch.tensor([3.5, 1.0]) if args.guidance_embed else None)


def diffusers_out(ref, x: dict, dtype=torch.float64) -> torch.Tensor:
    c = {k: (v.to(dtype) if v is not None else None) for k, v in x.items()}
    with torch.no_grad():
        return ref.to(dtype)(c["img"], c["txt"], c["vec"], c["timesteps"], c["img_ids"], c["txt_ids"], c["guidance"],
                             return_dict=False)[0]


def random_weights(model, seed=0, std=0.3):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * std)
    return model


@pytest.mark.parametrize("guidance", [False, True])
def test_output_equals_diffusers(guidance):
    args = tiny(guidance)
    ref = random_weights(diffusers_model(args))
    model = build_model(args, "cpu")
    model.load_state_dict(from_hf_state_dict(ref.state_dict(), args), strict=True)
    x = inputs(args)
    with torch.no_grad():
        got = model(**x)
    assert got.dtype == torch.float32 and got.shape == x["img"].shape
    assert rel(got, diffusers_out(ref, x)) < 1e-5


def test_guidance_is_required_by_a_guidance_distilled_flavor():
    args = tiny(True)
    x = {**inputs(args), "guidance": None}
    with pytest.raises(ValueError, match="guidance"):
        cpu_model(args)(**x)


@pytest.mark.parametrize("flavor, published", [("flux-dev", "11.90e9"), ("flux-schnell", "11.89e9")])
def test_parameter_counts(flavor, published):
    args = FLUX_FLAVORS[flavor]
    assert format_params(args) == f"{published} parameters"
    assert sum(p.numel() for p in build_model(args).parameters()) == args.num_params()


def test_export_loads_in_diffusers_and_the_converter_round_trips(tmp_path):
    args = tiny(True)
    model = random_weights(cpu_model(args), seed=3)
    Checkpointer(tmp_path / "ckpt", model, model_args=args).save_seed()
    assert convert_main(["dcp-to-hf", str(tmp_path / "ckpt"), str(tmp_path / "hf"), "--max_shard_size", "40KB"]) == 0
    assert (tmp_path / "hf" / "diffusion_pytorch_model.safetensors.index.json").is_file()
    ref, info = diffusers.FluxTransformer2DModel.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    x = inputs(args)
    with torch.no_grad():
        assert rel(model(**x), diffusers_out(ref, x)) < 1e-5
    back = hf_to_dcp(tmp_path / "hf", tmp_path / "dcp")
    again = cpu_model(args, seed=9)
    Checkpointer(tmp_path / "dcp-parent", again, model_args=args).initial_load(back, model_only=True)
    for (name, a), b in zip(model.state_dict().items(), again.state_dict().values()):
        assert torch.equal(a, b), name


def test_a_pipeline_transformer_folder_imports(tmp_path):
    args = tiny(False)
    ref = random_weights(diffusers_model(args), seed=5)
    ref.save_pretrained(tmp_path / "transformer")
    ckpt = HFCheckpoint(tmp_path / "transformer")
    assert ckpt.family == "flux" and ckpt.flavor == "custom"
    model = build_model(ckpt.args, "cpu")
    assert load_into_model(model, ckpt) == len(list(model.parameters()))
    x = inputs(args)
    with torch.no_grad():
        assert rel(model(**x), diffusers_out(ref, x)) < 1e-5


def test_published_configs_read_back_as_their_flavors():
    for name in ("flux-dev", "flux-schnell"):
        args, flavor = args_from_hf_config(hf_config(FLUX_FLAVORS[name]), "x/config.json")
        assert flavor == name


def test_configs_we_cannot_reproduce_are_refused_in_one_line():
    cfg = hf_config(tiny(False))
    for change, message in [({"patch_size": 2}, "patch_size"), ({"out_channels": 4}, "out_channels"),
                            ({"axes_dims_rope": [4, 4, 4]}, "axes_dim"), ({"num_layers": 0}, "num_layers")]:
        with pytest.raises(HFCheckpointError, match=message) as e:
            args_from_hf_config({**cfg, **change}, "x/config.json")
        assert "\n" not in str(e.value) and str(e.value).startswith("x/config.json: ")
