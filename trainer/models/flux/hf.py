"""Flux <-> diffusers' ``FluxTransformer2DModel`` (a FluxPipeline folder's ``transformer/``):
config.json both ways, our (Black Forest Labs') parameter names <-> diffusers', and the one layout
changes: the final AdaLN projection stores (shift, scale) here (as BFL does) and (scale, shift) in
diffusers (``norm_out.linear``), so its rows swap halves on the way; a single block's output
projection is ours as two column blocks (``out_attn`` (dim, dim), ``out_mlp`` (dim, 4 dim) with the
bias) and diffusers' as one ``proj_out`` (dim, 5 dim), so they convert together (``export_group``).
diffusers' transformer has no mlp_ratio field: it is 4. diffusers writes its weights
as ``diffusion_pytorch_model.safetensors`` (``weights_name``); its config.json names the class in
``_class_name`` where transformers has ``model_type``.
"""
from __future__ import annotations

import re

import torch

from trainer.hf.adapter import HFAdapter, check_field
from trainer.hf.common import DTYPE_NAMES, HFCheckpointError, config_errors
from trainer.models.flux.args import FLUX_FLAVORS, FluxArgs

CLASS_NAME = "FluxTransformer2DModel"


def _linear(ours: str, theirs: str) -> dict[str, str]:
    return {f"{ours}.{p}": f"{theirs}.{p}" for p in ("weight", "bias")}


def _key_map() -> dict[str, str]:
    m: dict[str, str] = {}
    m.update(_linear("img_in", "x_embedder"))
    m.update(_linear("txt_in", "context_embedder"))
    for ours, theirs in (("time_in", "timestep_embedder"), ("vector_in", "text_embedder"),
                         ("guidance_in", "guidance_embedder")):
        m.update(_linear(f"{ours}.in_layer", f"time_text_embed.{theirs}.linear_1"))
        m.update(_linear(f"{ours}.out_layer", f"time_text_embed.{theirs}.linear_2"))
    d, t = "double_blocks.{}", "transformer_blocks.{}"
    for stream, mod, q, k, v, out, nq, nk, ff in (
            ("img", "norm1", "to_q", "to_k", "to_v", "to_out.0", "norm_q", "norm_k", "ff"),
            ("txt", "norm1_context", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out", "norm_added_q",
             "norm_added_k", "ff_context")):
        m.update(_linear(f"{d}.{stream}.mod.lin", f"{t}.{mod}.linear"))
        for ours, theirs in (("wq", q), ("wk", k), ("wv", v)):
            m.update(_linear(f"{d}.{stream}.attn.{ours}", f"{t}.attn.{theirs}"))
        m[f"{d}.{stream}.attn.q_norm.weight"] = f"{t}.attn.{nq}.weight"
        m[f"{d}.{stream}.attn.k_norm.weight"] = f"{t}.attn.{nk}.weight"
        m.update(_linear(f"{d}.{stream}.proj", f"{t}.attn.{out}"))
        m.update(_linear(f"{d}.{stream}.mlp.w1", f"{t}.{ff}.net.0.proj"))
        m.update(_linear(f"{d}.{stream}.mlp.w2", f"{t}.{ff}.net.2"))
    s, st = "single_blocks.{}", "single_transformer_blocks.{}"
    m.update(_linear(f"{s}.mod.lin", f"{st}.norm.linear"))
    for ours, theirs in (("wq", "to_q"), ("wk", "to_k"), ("wv", "to_v")):
        m.update(_linear(f"{s}.attn.{ours}", f"{st}.attn.{theirs}"))
    m[f"{s}.attn.q_norm.weight"] = f"{st}.attn.norm_q.weight"
    m[f"{s}.attn.k_norm.weight"] = f"{st}.attn.norm_k.weight"
    m.update(_linear(f"{s}.mlp_in", f"{st}.proj_mlp"))
    m[f"{s}.out_mlp.bias"] = f"{st}.proj_out.bias"  # the weight's two column blocks: _OUT, below
    m.update(_linear("final_layer.adaLN_modulation", "norm_out.linear"))
    m.update(_linear("final_layer.linear", "proj_out"))
    return m


_OUT = re.compile(r"^single_blocks\.(\d+)\.out_(attn|mlp)\.weight$")
_HF_OUT = re.compile(r"^single_transformer_blocks\.(\d+)\.proj_out\.weight$")


def _swap_halves(t: torch.Tensor) -> torch.Tensor:
    a, b = t.chunk(2, dim=0)
    return torch.cat([b, a], dim=0)


class FluxAdapter(HFAdapter):
    title = "Flux"
    model_types = (CLASS_NAME,)
    key_map = _key_map()
    weights_name = "diffusion_pytorch_model"
    tokenizer_files = False

    def config(self, args: FluxArgs, dtype: torch.dtype = torch.float32) -> dict:
        if args.mlp_ratio != 4.0:
            raise HFCheckpointError(f"cannot write a diffusers Flux config: mlp_ratio {args.mlp_ratio} "
                                    "(diffusers' is 4)")
        return {
            "_class_name": CLASS_NAME,
            "attention_head_dim": args.head_dim,
            "axes_dims_rope": list(args.axes_dim),
            "guidance_embeds": args.guidance_embed,
            "in_channels": args.in_channels,
            "joint_attention_dim": args.context_dim,
            "num_attention_heads": args.n_heads,
            "num_layers": args.n_double_layers,
            "num_single_layers": args.n_single_layers,
            "out_channels": None,
            "patch_size": 1,
            "pooled_projection_dim": args.vec_dim,
            "torch_dtype": DTYPE_NAMES.get(dtype, "float32"),
        }

    def args_from_config(self, cfg: dict, where: str):
        for key in ("attention_head_dim", "num_attention_heads", "num_layers", "num_single_layers", "in_channels",
                    "joint_attention_dim", "pooled_projection_dim"):
            v = cfg.get(key)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise HFCheckpointError(f"{where}: {key} {v!r} is not supported (expected an integer >= 1)")
        check_field(cfg, "patch_size", cfg.get("patch_size", 1) == 1, "1 (2x2 patches are packed outside)", where)
        out = cfg.get("out_channels")
        check_field(cfg, "out_channels", out in (None, cfg["in_channels"]), "null or in_channels", where)
        check_field(cfg, "in_channels", cfg["in_channels"] % 4 == 0, "4 x the latent channels", where)
        with config_errors(where):
            heads, hd = cfg["num_attention_heads"], cfg["attention_head_dim"]
            args = FluxArgs(
                dim=heads * hd, n_heads=heads, head_dim=hd, n_double_layers=cfg["num_layers"],
                n_single_layers=cfg["num_single_layers"], in_channels=cfg["in_channels"],
                latent_channels=cfg["in_channels"] // 4, context_dim=cfg["joint_attention_dim"],
                vec_dim=cfg["pooled_projection_dim"], axes_dim=tuple(cfg.get("axes_dims_rope", (16, 56, 56))),
                guidance_embed=bool(cfg.get("guidance_embeds", False)))
        for name, flavor in FLUX_FLAVORS.items():
            if all(getattr(flavor, f) == getattr(args, f) for f in FluxArgs.SHAPE_FIELDS + ("axes_dim",)):
                return flavor, name
        return args, "custom"

    # -- a single block's output projection: two of our tensors, one of theirs --

    def hf_names(self, args, key: str, fused: bool = False) -> list[str]:
        m = _OUT.match(key)
        if m:
            return [f"single_transformer_blocks.{m.group(1)}.proj_out.weight"]
        return super().hf_names(args, key, fused)

    def hf_shape(self, key: str, want: tuple[int, ...], name: str) -> tuple[int, ...]:
        if _OUT.match(key):  # (dim, dim + 4 dim): the attention's and the MLP's columns
            return (want[0], 5 * want[0])
        return want

    def export_group(self, key: str) -> tuple[str, ...]:
        m = _OUT.match(key)
        if m:
            return tuple(f"single_blocks.{m.group(1)}.out_{w}.weight" for w in ("attn", "mlp"))
        return (key,)

    def to_hf(self, state_dict, args):
        """Ours -> diffusers'; a single block's out_attn and out_mlp weights must come together."""
        out, rest = {}, {}
        for key, t in state_dict.items():
            m = _OUT.match(key)
            if m is None:
                rest[key] = t
                continue
            a, b = self.export_group(key)
            if a not in state_dict or b not in state_dict:
                raise KeyError(f"{key}: out_attn and out_mlp make one proj_out; convert them together ({a}, {b})")
            out[self.hf_names(args, key)[0]] = torch.cat([state_dict[a], state_dict[b]], dim=1)
        out.update(super().to_hf(rest, args))
        return out

    def from_hf(self, state_dict, args):
        out, rest = {}, {}
        for key, t in state_dict.items():
            m = _HF_OUT.match(key)
            if m is None:
                rest[key] = t
                continue
            d = t.shape[0]
            if t.dim() != 2 or t.shape[1] != 5 * d:
                raise ValueError(f"{key}: expected shape ({d}, {5 * d}) (attention and MLP columns), "
                                 f"got {tuple(t.shape)}")
            out[f"single_blocks.{m.group(1)}.out_attn.weight"] = t[:, :d].contiguous()
            out[f"single_blocks.{m.group(1)}.out_mlp.weight"] = t[:, d:].contiguous()
        out.update(super().from_hf(rest, args))
        return out

    def tensor_to_hf(self, key: str, t: torch.Tensor, args) -> torch.Tensor:
        return _swap_halves(t) if key.startswith("final_layer.adaLN_modulation.") else t

    def tensor_from_hf(self, key: str, t: torch.Tensor, args) -> torch.Tensor:
        return _swap_halves(t) if key.startswith("final_layer.adaLN_modulation.") else t


ADAPTER = FluxAdapter()
