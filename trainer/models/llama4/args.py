"""Llama 4 hyperparameters: ``Llama4Args`` and the published flavors (torch-free).

Meta, Llama 4 (the reference ``llama_models/llama4/model.py``) and Hugging Face ``Llama4ForCausalLM`` /
``Llama4TextConfig`` (text only). The shared decoder with
  - two kinds of layer: RoPE layers with chunked causal attention (query i sees key j <= i of its own
    chunk of ``attention_chunk`` positions, 8192 in the releases) and NoPE layers with full causal
    attention and no rotary. Which layer is which comes from the checkpoint's lists (``nope_layers``);
    by default every ``nope_layer_interval``-th layer is NoPE, counting from 1 (layers 3, 7, ...), as
    Meta placed them;
  - on RoPE layers with ``use_qk_norm``, a weightless RMS norm (eps ``norm_eps``) over head_dim of every
    query and key head, after the rotation (Hugging Face's ``Llama4TextWeightlessRMSNorm``);
  - on NoPE layers with ``attn_temperature_tuning``, the query at position p scaled by
    ``1 + attn_scale * ln(1 + floor((p + 1) / floor_scale))`` (the score scale stays head_dim^-0.5);
  - rotary on interleaved pairs, Llama 3 frequency scaling where the config has it;
  - MoE feed-forwards on ``moe_layers`` (by default every ``interleave_moe_layer_step``-th layer,
    counting from 1): top-1 of the router logits, whose sigmoid scales the expert's *input*, plus one
    shared expert every token goes through (experts and shared expert of width ``moe.hidden_dim``,
    ``intermediate_size``); the other layers a dense SwiGLU of width ``hidden_dim``
    (``intermediate_size_mlp``).

Parameter counts (text model, as Hugging Face's config builds it): Scout (17bx16e) 107.77e9 total /
17.17e9 active, Maverick (17bx128e) 400.71e9 / 17.18e9; Meta's model cards say 109B and 400B with the
vision encoder. The active count includes the embedding and the output head, as Meta's 17B does.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from trainer.models.common.args import ModelArgs
from trainer.models.common.moe_args import MoEArgs

# Llama 4 Scout's rope_scaling (config.json); Maverick has none.
SCOUT_ROPE_SCALING = dict(factor=16.0, low_freq_factor=1.0, high_freq_factor=1.0, original_max_position_embeddings=8192)


def default_nope_layers(n_layers: int, interval: int) -> tuple[int, ...]:
    """Meta's and Hugging Face's placement: layer i is NoPE when (i + 1) % interval == 0 (0: none)."""
    return tuple(i for i in range(n_layers) if interval > 0 and (i + 1) % interval == 0)


def default_moe_layers(n_layers: int, step: int) -> tuple[int, ...]:
    """Hugging Face's ``moe_layers`` from ``interleave_moe_layer_step``: step - 1, 2 step - 1, ..."""
    return tuple(range(step - 1, n_layers, step))


def _int_tuple(value, name: str, n_layers: int) -> tuple[int, ...]:
    out = tuple(value)
    if any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n_layers for i in out):
        raise ValueError(f"Llama4Args.{name}: expected layer indices in 0..{n_layers - 1}, got {list(out)}")
    if len(set(out)) != len(out):
        raise ValueError(f"Llama4Args.{name}: layer indices repeat in {list(out)}")
    return tuple(sorted(out))


@dataclass(frozen=True)
class Llama4Args(ModelArgs):
    """Hyperparameters of a Llama 4 text model (module docstring).

    ``nope_layers`` / ``moe_layers``: layer indices (None: the default rule of ``nope_layer_interval`` /
    ``interleave_moe_layer_step``). ``layer_types`` (empty: derived) is chunked_attention on RoPE
    layers when ``attention_chunk`` > 0, full_attention elsewhere; a config may list its own.
    ``hidden_dim``: the dense layers' SwiGLU width. ``moe``: the routed experts (None: all dense).
    """

    vocab_size: int = 202048
    head_dim: int | None = 128
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    max_seq_len: int = 8192
    attention_chunk: int = 8192
    hidden_dim: int = 16384
    nope_layers: tuple[int, ...] | None = None
    nope_layer_interval: int = 4
    moe_layers: tuple[int, ...] | None = None
    interleave_moe_layer_step: int = 1
    use_qk_norm: bool = True
    attn_temperature_tuning: bool = True
    floor_scale: int = 8192
    attn_scale: float = 0.1

    SHAPE_FIELDS: ClassVar[tuple[str, ...]] = ModelArgs.SHAPE_FIELDS + ("moe_layers",)
    IGNORED_FIELDS: ClassVar[tuple[str, ...]] = ModelArgs.IGNORED_FIELDS + ("nope_layer_interval",
                                                                            "interleave_moe_layer_step")

    def __post_init__(self) -> None:
        n = self.n_layers
        for key in ("nope_layer_interval", "interleave_moe_layer_step", "floor_scale", "hidden_dim"):
            v = getattr(self, key)
            low = 0 if key == "nope_layer_interval" else 1
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(f"Llama4Args.{key}: expected an integer >= {low}, got {v!r}")
        nope = default_nope_layers(n, self.nope_layer_interval) if self.nope_layers is None else self.nope_layers
        object.__setattr__(self, "nope_layers", _int_tuple(nope, "nope_layers", n))
        if self.moe is not None or self.moe_layers is not None:
            moe = default_moe_layers(n, self.interleave_moe_layer_step) if self.moe_layers is None else self.moe_layers
            object.__setattr__(self, "moe_layers", _int_tuple(moe, "moe_layers", n))
        if not self.layer_types:
            object.__setattr__(self, "layer_types", tuple(
                "chunked_attention" if i not in self.nope_layers and self.attention_chunk > 0 else "full_attention"
                for i in range(n)))
        super().__post_init__()
        if self.moe is None and self.moe_layers:
            raise ValueError(f"Llama4Args.moe_layers: layers {list(self.moe_layers)} are MoE but no moe is given")
        if not self.attn_scale >= 0:
            raise ValueError(f"Llama4Args.attn_scale: expected a number >= 0, got {self.attn_scale!r}")

    def replace(self, **changes):
        # The derived lists follow a new n_layers unless given (a flavor resized stays Meta's pattern),
        # and the layer types a new chunk or NoPE list.
        if "n_layers" in changes:
            changes.setdefault("nope_layers", None)
            changes.setdefault("moe_layers", None)
        if {"n_layers", "attention_chunk", "nope_layers"} & set(changes):
            changes.setdefault("layer_types", ())
        return super().replace(**changes)

    # -- the layer kinds --

    def uses_rope(self, layer_id: int) -> bool:
        """Whether layer ``layer_id`` rotates q and k (a RoPE layer) or is a NoPE layer."""
        return layer_id not in self.nope_layers

    def moe_layer(self, layer_id: int) -> bool:
        return self.moe is not None and layer_id in self.moe_layers

    @property
    def n_moe_layers(self) -> int:
        return 0 if self.moe is None else len(self.moe_layers)

    @property
    def ffn_hidden_dim(self) -> int:
        return self.hidden_dim


def _moe(num_experts: int, hidden_dim: int) -> MoEArgs:
    return MoEArgs(num_experts=num_experts, top_k=1, hidden_dim=hidden_dim, num_shared_experts=1,
                   score_func="sigmoid", route_norm=False, score_before_experts=True)


LLAMA4_FLAVORS: dict[str, Llama4Args] = {
    # Small enough for our CPU, every feature at work at seq 256: 4 layers (chunked RoPE layers 0-2 with
    # chunk 16 and QK norm, NoPE layer 3 with temperature tuning from position 15 on), MoE on layers 1
    # and 3 (8 experts top-1 + the shared expert), dense SwiGLU on 0 and 2.
    "debugmodel": Llama4Args(dim=256, n_layers=4, n_heads=8, n_kv_heads=2, head_dim=32, vocab_size=-1,
                             attention_chunk=16, hidden_dim=512, interleave_moe_layer_step=2, floor_scale=16,
                             max_seq_len=4096, rope_scaling=SCOUT_ROPE_SCALING, moe=_moe(8, 256)),
    # meta-llama/Llama-4-Scout-17B-16E config.json (text_config): 107.77e9 parameters, 17.17e9 active.
    "17bx16e": Llama4Args(dim=5120, n_layers=48, n_heads=40, n_kv_heads=8, hidden_dim=16384,
                          interleave_moe_layer_step=1, rope_scaling=SCOUT_ROPE_SCALING, moe=_moe(16, 8192)),
    # meta-llama/Llama-4-Maverick-17B-128E config.json (text_config): 400.71e9 parameters, 17.18e9 active.
    "17bx128e": Llama4Args(dim=5120, n_layers=48, n_heads=40, n_kv_heads=8, hidden_dim=16384,
                           interleave_moe_layer_step=2, use_qk_norm=False, moe=_moe(128, 8192)),
}
