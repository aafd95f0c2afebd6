"""The Flux transformer (MMDiT): double-stream blocks, then single-stream blocks, over the joint
text + image sequence; ``FluxTransformer.forward`` maps packed noisy latents to the predicted
velocity (noise - data).

Structure and numerics as Black Forest Labs' ``flux/model.py`` and diffusers'
``FluxTransformer2DModel`` (tests/trainer/test_flux.py compares our output with diffusers' at 1e-5).
Parameter names follow BFL's (``double_blocks.{i}.img_attn.wq``...); ``trainer.models.flux.hf``
maps them to diffusers' names. The blocks are ``blocks()`` (double then single), which activation
checkpointing, compile and FSDP2 wrap one by one like a decoder's layers.
"""
from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from trainer.models.common.decoder import init_parameters
from trainer.models.flux.layers import (
    QKV,
    TIME_CHANNELS,
    TIME_FACTOR,
    MLPEmbedder,
    Modulation,
    Rope,
    joint_attention,
    modulate,
    rope_tables,
    timestep_embedding,
)


class MLP(nn.Module):
    """``w2(gelu_tanh(w1(x)))`` with biases (a double block's feed-forward)."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden)
        self.w2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x), approximate="tanh"))


class Stream(nn.Module):
    """One stream of a double block (image or text): its modulation (6 chunks), QK-normed
    projections, attention output projection and MLP."""

    def __init__(self, args) -> None:
        super().__init__()
        self.mod = Modulation(args.dim, 6)
        self.attn = QKV(args.dim, args.head_dim, args.norm_eps)
        self.proj = nn.Linear(args.dim, args.dim)
        self.mlp = MLP(args.dim, args.ffn_hidden_dim)


class DoubleStreamBlock(nn.Module):
    """Image and text streams with their own weights and one joint attention (text first).

    forward(img (b, n_img, dim), txt (b, n_txt, dim), vec (b, dim), rope) -> (img, txt)."""

    def __init__(self, layer_id: int, args) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.img = Stream(args)
        self.txt = Stream(args)
        self.context_parallel = None  # set by context parallel: the ring over the joint sequence

    def forward(self, img: torch.Tensor, txt: torch.Tensor, vec: torch.Tensor, rope: Rope):
        img_mod = self.img.mod(vec)
        txt_mod = self.txt.mod(vec)
        qi, ki, vi = self.img.attn(modulate(img, img_mod[0], img_mod[1]))
        qt, kt, vt = self.txt.attn(modulate(txt, txt_mod[0], txt_mod[1]))
        n_txt = txt.shape[1]
        attn = joint_attention(torch.cat([qt, qi], 1), torch.cat([kt, ki], 1), torch.cat([vt, vi], 1), rope,
                               self.context_parallel)
        txt_attn, img_attn = attn[:, :n_txt], attn[:, n_txt:]
        img = img + img_mod[2] * self.img.proj(img_attn)
        img = img + img_mod[5] * self.img.mlp(modulate(img, img_mod[3], img_mod[4]))
        txt = txt + txt_mod[2] * self.txt.proj(txt_attn)
        txt = txt + txt_mod[5] * self.txt.mlp(modulate(txt, txt_mod[3], txt_mod[4]))
        return img, txt


class SingleStreamBlock(nn.Module):
    """Attention and MLP in parallel on the joined sequence, one output projection over both,
    ``out(cat(attn, gelu_tanh(mlp_in(x))))``, held as its two column blocks ``out_attn`` (no bias) and
    ``out_mlp`` (so that tensor parallel splits each like its input; the Hugging Face export joins
    them). forward(x (b, seq, dim), vec (b, dim), rope) -> x."""

    def __init__(self, layer_id: int, args) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.mod = Modulation(args.dim, 3)
        self.attn = QKV(args.dim, args.head_dim, args.norm_eps)
        self.mlp_in = nn.Linear(args.dim, args.ffn_hidden_dim)
        self.out_attn = nn.Linear(args.dim, args.dim, bias=False)
        self.out_mlp = nn.Linear(args.ffn_hidden_dim, args.dim)
        self.context_parallel = None

    def forward(self, x: torch.Tensor, vec: torch.Tensor, rope: Rope) -> torch.Tensor:
        shift, scale, gate = self.mod(vec)
        h = modulate(x, shift, scale)
        q, k, v = self.attn(h)
        attn = joint_attention(q, k, v, rope, self.context_parallel)
        return x + gate * (self.out_attn(attn) + self.out_mlp(F.gelu(self.mlp_in(h), approximate="tanh")))


class FinalLayer(nn.Module):
    """``linear(LayerNorm(x) * (1 + scale) + shift)``, (shift, scale) = adaLN_modulation(silu(vec))."""

    def __init__(self, dim: int, out_channels: int) -> None:
        super().__init__()
        self.adaLN_modulation = nn.Linear(dim, 2 * dim)
        self.linear = nn.Linear(dim, out_channels)

    def forward(self, x: torch.Tensor, vec: torch.Tensor) -> torch.Tensor:
        shift, scale = self.adaLN_modulation(F.silu(vec))[:, None, :].chunk(2, dim=-1)
        return self.linear(modulate(x, shift, scale))


class FluxTransformer(nn.Module):
    """The Flux MMDiT of ``args`` (a ``FluxArgs``).

    forward(img (b, n_img, in_channels) packed latents, txt (b, n_txt, context_dim) T5 states,
    vec (b, vec_dim) pooled CLIP, timesteps (b,) in [0, 1], img_ids (n_img, 3), txt_ids (n_txt, 3),
    guidance (b,) or None) -> (b, n_img, in_channels): the predicted velocity, in img's dtype.
    ``guidance`` is required exactly when ``args.guidance_embed``; timesteps and guidance are scaled
    by 1000 inside (as diffusers' transformer takes them). Raises ValueError for wrong shapes.
    """

    def __init__(self, args) -> None:
        super().__init__()
        self.args = args
        d = args.dim
        self.img_in = nn.Linear(args.in_channels, d)
        self.txt_in = nn.Linear(args.context_dim, d)
        self.time_in = MLPEmbedder(TIME_CHANNELS, d)
        self.vector_in = MLPEmbedder(args.vec_dim, d)
        self.guidance_in = MLPEmbedder(TIME_CHANNELS, d) if args.guidance_embed else None
        self.double_blocks = nn.ModuleDict({str(i): DoubleStreamBlock(i, args) for i in range(args.n_double_layers)})
        self.single_blocks = nn.ModuleDict({str(i): SingleStreamBlock(args.n_double_layers + i, args)
                                            for i in range(args.n_single_layers)})
        self.final_layer = FinalLayer(d, args.in_channels)
        self.rope = Rope()
        self.context_parallel = None  # set by context parallel (trainer.models.flux.parallelize)

    def blocks(self) -> list[nn.Module]:
        """Every transformer block, double-stream then single-stream."""
        return [*self.double_blocks.values(), *self.single_blocks.values()]

    def conditioning(self, timesteps: torch.Tensor, vec: torch.Tensor, guidance: torch.Tensor | None,
                     dtype: torch.dtype) -> torch.Tensor:
        """The modulation input (b, dim): time + pooled text (+ guidance) embeddings."""
        out = self.time_in(timestep_embedding(timesteps * TIME_FACTOR).to(dtype)) + self.vector_in(vec)
        if self.guidance_in is not None:
            if guidance is None:
                raise ValueError("guidance: this flavor is guidance-distilled (guidance_embed); pass a guidance scale")
            out = out + self.guidance_in(timestep_embedding(guidance * TIME_FACTOR).to(dtype))
        return out

    def forward(self, img: torch.Tensor, txt: torch.Tensor, vec: torch.Tensor, timesteps: torch.Tensor,
                img_ids: torch.Tensor, txt_ids: torch.Tensor, guidance: torch.Tensor | None = None) -> torch.Tensor:
        a = self.args
        if img.dim() != 3 or img.shape[-1] != a.in_channels:
            raise ValueError(f"img: expected (batch, tokens, {a.in_channels}), got {tuple(img.shape)}")
        if txt.dim() != 3 or txt.shape[-1] != a.context_dim or txt.shape[0] != img.shape[0]:
            raise ValueError(f"txt: expected ({img.shape[0]}, tokens, {a.context_dim}), got {tuple(txt.shape)}")
        if vec.shape != (img.shape[0], a.vec_dim):
            raise ValueError(f"vec: expected ({img.shape[0]}, {a.vec_dim}), got {tuple(vec.shape)}")
        if img_ids.shape != (img.shape[1], 3) or txt_ids.shape != (txt.shape[1], 3):
            raise ValueError(f"img_ids, txt_ids: expected ({img.shape[1]}, 3) and ({txt.shape[1]}, 3), got "
                             f"{tuple(img_ids.shape)} and {tuple(txt_ids.shape)}")
        img = self.img_in(img)
        txt = self.txt_in(txt)
        vec = self.conditioning(timesteps, vec, guidance, img.dtype)
        cos, sin = rope_tables(torch.cat([txt_ids, img_ids]), a.axes_dim, a.rope_theta)
        self.rope.set(cos, sin)
        for block in self.double_blocks.values():
            img, txt = block(img, txt, vec, self.rope)
        n_txt = txt.shape[1]
        x = torch.cat([txt, img], dim=1)
        for block in self.single_blocks.values():
            x = block(x, vec, self.rope)
        return self.final_layer(x[:, n_txt:], vec)

    # -- initialization --

    def param_init_std(self, name: str) -> float | None:
        """None for norm weights (ones), 0.0 for biases and the AdaLN modulations and the final
        layer (zeros: every block starts as the identity, DiT's adaLN-Zero), else init_std."""
        if name.endswith("norm.weight"):
            return None
        if name.endswith("bias") or re.search(r"(mod\.lin|final_layer\.\w+)\.weight$", name):
            return 0.0
        return self.args.init_std

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Fill every parameter, the same for any sharding: each drawn whole from a generator seeded by
        (seed, name) (``param_init_std``), each rank keeping its shard. Raises RuntimeError on meta."""
        init_parameters(self, seed)
