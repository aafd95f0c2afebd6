"""Flux hyperparameters: ``FluxArgs`` and the published flavors (torch-free).

Black Forest Labs, FLUX.1 (``flux/model.py``, ``FluxParams``) and diffusers' ``FluxTransformer2DModel``:
an MMDiT of ``n_double_layers`` double-stream blocks (image and text weights apart, one joint
attention) then ``n_single_layers`` single-stream blocks (attention and MLP in parallel on the joined
sequence); QK RMSNorm; rotary over three position axes (``axes_dim``, summing to head_dim); AdaLN
modulation from the timestep, the pooled CLIP vector (``vec_dim``) and, for the guidance-distilled
flavors, the guidance; 2x2 patches of ``latent_channels``-channel latents (``in_channels`` =
4 * latent_channels). The text sequence is T5's (``context_dim``), ``max_txt_len`` tokens.

``dim`` is the hidden size (n_heads * head_dim); ``n_layers`` is the number of blocks of both kinds
(what the shared counts and layouts read). ``vocab_size`` is unused (the text comes encoded).

FLOPs per token (``flops_per_token``): 6 x the parameters a token multiplies by (the blocks; the
modulation and embedding MLPs run once per sample, not per token, and are not counted per token),
plus the joint attention: non-causal, every (query, key) pair of the whole text + image sequence,
6 * n_heads * 2 * head_dim FLOPs per entry (``trainer.models.common.args`` module docstring).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from trainer.models.common.args import ModelArgs, attention_entries


@dataclass(frozen=True)
class FluxArgs(ModelArgs):
    """Hyperparameters of a Flux transformer (module docstring)."""

    dim: int = 3072
    n_heads: int = 24
    head_dim: int | None = 128
    n_layers: int = 57
    n_double_layers: int = 19
    n_single_layers: int = 38
    in_channels: int = 64
    latent_channels: int = 16
    vae_scale: int = 8  # image pixels per latent pixel (1: pixel space, no autoencoder)
    context_dim: int = 4096
    vec_dim: int = 768
    mlp_ratio: float = 4.0
    axes_dim: tuple[int, ...] = (16, 56, 56)
    rope_theta: float = 10000.0
    guidance_embed: bool = False
    max_txt_len: int = 512
    norm_eps: float = 1e-6
    max_seq_len: int = 4608
    init_std: float = 0.02

    SHAPE_FIELDS: ClassVar[tuple[str, ...]] = (
        "dim", "n_heads", "head_dim", "n_double_layers", "n_single_layers", "in_channels", "context_dim", "vec_dim",
        "mlp_ratio", "guidance_embed")
    IGNORED_FIELDS: ClassVar[tuple[str, ...]] = ModelArgs.IGNORED_FIELDS + (
        "vocab_size", "n_layers", "max_txt_len", "latent_channels", "vae_scale")

    def __post_init__(self) -> None:
        if isinstance(self.axes_dim, list):
            object.__setattr__(self, "axes_dim", tuple(self.axes_dim))
        object.__setattr__(self, "n_layers", self.n_double_layers + self.n_single_layers)
        super().__post_init__()
        name = type(self).__name__
        if sum(self.axes_dim) != self.head_dim or any(a % 2 for a in self.axes_dim) or len(self.axes_dim) != 3:
            raise ValueError(f"{name}.axes_dim: expected three even sizes summing to head_dim={self.head_dim}, got "
                             f"{self.axes_dim}")
        if self.dim != self.n_heads * self.head_dim:
            raise ValueError(f"{name}.dim: expected n_heads * head_dim = {self.n_heads * self.head_dim}, "
                             f"got {self.dim}")
        if self.in_channels != 4 * self.latent_channels:
            raise ValueError(f"{name}.in_channels: expected 4 * latent_channels = {4 * self.latent_channels} (2x2 "
                             f"patches), got {self.in_channels}")

    # -- shape --

    @property
    def ffn_hidden_dim(self) -> int:
        return int(self.dim * self.mlp_ratio)

    def tp_divisible(self) -> dict[str, int]:
        return {"n_heads": self.n_heads, "ffn_hidden_dim": self.ffn_hidden_dim}

    def image_tokens(self, height: int, width: int) -> int:
        """Image tokens of a ``height`` x ``width`` picture: one per 2x2 latent patch."""
        patch = 2 * self.vae_scale
        return (height // patch) * (width // patch)

    # -- counts --

    def embedding_params(self) -> int:
        """The input and conditioning projections (img_in, txt_in, the time / vector / guidance MLPs)."""
        d = self.dim
        mlp = lambda n_in: n_in * d + d + d * d + d  # noqa: E731 (in_layer, out_layer with biases)
        return (self.in_channels * d + d) + (self.context_dim * d + d) + mlp(256) + mlp(self.vec_dim) \
            + (mlp(256) if self.guidance_embed else 0)

    def double_block_params(self) -> int:
        d, h = self.dim, self.ffn_hidden_dim
        stream = (d * 6 * d + 6 * d) + 4 * (d * d + d) + 2 * self.head_dim + (d * h + h + h * d + d)
        return 2 * stream

    def single_block_params(self) -> int:
        d, h = self.dim, self.ffn_hidden_dim
        return (d * 3 * d + 3 * d) + 3 * (d * d + d) + (d * h + h) + ((d + h) * d + d) + 2 * self.head_dim

    def final_params(self) -> int:
        d = self.dim
        return (d * 2 * d + 2 * d) + (d * self.in_channels + self.in_channels)

    def output_params(self) -> int:
        """The final layer (AdaLN projection and the patch projection), where a decoder has its output."""
        return self.final_params()

    def loss_vocab_size(self) -> int:
        return 0  # an MSE, no softmax

    def layer_params(self) -> int:
        """The largest block (a double-stream one)."""
        return self.double_block_params()

    def num_params(self) -> int:
        return (self.embedding_params() + self.n_double_layers * self.double_block_params()
                + self.n_single_layers * self.single_block_params() + self.final_params())

    def active_params(self) -> int:
        return self.num_params()

    def token_params(self) -> int:
        """Parameters each token multiplies by: a double block's one stream, every single block, the
        output projection (the modulation runs once per sample)."""
        d = self.dim
        mod_double, mod_single = d * 6 * d + 6 * d, d * 3 * d + 3 * d
        per_double = self.double_block_params() // 2 - mod_double
        per_single = self.single_block_params() - mod_single
        return (self.n_double_layers * per_double + self.n_single_layers * per_single
                + d * self.in_channels + self.in_channels)

    def attention_flops_per_token(self, seq_len: int) -> float:
        per_entry = 6 * self.n_heads * 2 * self.head_dim
        return per_entry * self.n_layers * attention_entries(seq_len, causal=False) / seq_len

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token of a ``seq_len``-token joint sequence (text + image; module docstring)."""
        return 6 * self.token_params() + self.attention_flops_per_token(seq_len)

    def attention_saved_values(self) -> tuple[int, int]:
        q = self.n_heads * self.head_dim
        return 0, 4 * q + self.n_heads

    def pipeline_refusal(self) -> str | None:
        return "Flux's two streams of blocks are not split into pipeline stages; use FSDP, TP or CP"

    def _need_vocab(self) -> None:  # the text comes encoded: no vocabulary
        return None


FLUX_FLAVORS: dict[str, FluxArgs] = {
    # Small enough for our CPU: pixel-space 2x2 patches of 3-channel 32x32 images (no autoencoder),
    # 2 double + 2 single blocks, tiny text encoders (trainer.models.flux.encoders) over bytes: 48
    # T5 tokens hold the longest caption of the embedded set (its position words at the end).
    "debugmodel": FluxArgs(dim=128, n_heads=4, head_dim=32, n_double_layers=2, n_single_layers=2, in_channels=12,
                           latent_channels=3, vae_scale=1, context_dim=64, vec_dim=32, axes_dim=(8, 12, 12),
                           guidance_embed=False, max_txt_len=48, max_seq_len=512),
    # black-forest-labs/FLUX.1-dev transformer/config.json: 11.90e9 parameters, guidance-distilled.
    "flux-dev": FluxArgs(guidance_embed=True),
    # black-forest-labs/FLUX.1-schnell: the same shapes without the guidance embedding (timestep-distilled).
    "flux-schnell": FluxArgs(guidance_embed=False, max_txt_len=256),
}
