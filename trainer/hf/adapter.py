"""``HFAdapter``: how one family's models map to Hugging Face's, and the pieces the families share.

A family's adapter (``trainer/models/<family>/hf.py``) is an ``HFAdapter`` subclass that gives
  - ``config(args, dtype)`` / ``args_from_config(cfg, where)``: config.json <-> our args;
  - ``key_map``: our parameter names -> Hugging Face's (``{}`` standing for the layer index);
  - ``tensor_to_hf`` / ``tensor_from_hf``: per-tensor layout changes (the rotary row permutation);
and inherits the rest: names both ways, whole state dicts, and the routed experts, which every MoE
family here stores alike: ours stacked ``layers.{i}.feed_forward.experts.w1/w3/w2`` (E, in, out),
Hugging Face's per expert ``...mlp.experts.{e}.gate_proj/up_proj/down_proj.weight`` (out, in) as
``save_pretrained`` writes them, or (read only) transformers' in-memory fused ``gate_up_proj``
(E, 2 hidden, dim) and ``down_proj`` (E, dim, hidden).

The rotary layout: we rotate Meta's interleaved pairs (2i, 2i+1) of a head; Hugging Face rotates
halves (i, i + head_dim/2). The rows of wq/wk (and anything else feeding the rotary) are permuted
per head on the way out and back (``interleaved_to_half``).
"""
from __future__ import annotations

import re

import torch

from trainer.errors import HFCheckpointError

# The names every family's decoder shares with Hugging Face's *ForCausalLM (ours, the layer index as
# {} -> theirs): the embedding, the two norms of a block, the final norm and the output projection.
DECODER_KEYS: dict[str, str] = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "layers.{}.attention_norm.weight": "model.layers.{}.input_layernorm.weight",
    "layers.{}.ffn_norm.weight": "model.layers.{}.post_attention_layernorm.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_EXPERT_RE = re.compile(r"^layers\.(\d+)\.feed_forward\.experts\.(w[123])$")
_HF_EXPERT_RE = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_HF_FUSED_RE = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")
_EXPERT_HF = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_EXPERT_OURS = {v: k for k, v in _EXPERT_HF.items()}
_FUSED_HF = {"w1": "gate_up_proj", "w3": "gate_up_proj", "w2": "down_proj"}
_LAYER_RE = re.compile(r"\.(\d+)\.")


def interleaved_to_half(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rows of a (n_heads * head_dim, in) projection from rotary pairs (2i, 2i+1) per head to halves
    (i, i + head_dim/2) per head (a 1-D weight is treated as one column)."""
    if w.dim() == 1:
        return interleaved_to_half(w.reshape(-1, 1), n_heads).reshape(-1)
    out_dim, in_dim = w.shape
    return w.view(n_heads, out_dim // n_heads // 2, 2, in_dim).transpose(1, 2).reshape(out_dim, in_dim)


def half_to_interleaved(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """The inverse of ``interleaved_to_half``."""
    if w.dim() == 1:
        return half_to_interleaved(w.reshape(-1, 1), n_heads).reshape(-1)
    out_dim, in_dim = w.shape
    return w.view(n_heads, 2, out_dim // n_heads // 2, in_dim).transpose(1, 2).reshape(out_dim, in_dim)


def is_expert(key: str) -> bool:
    """Whether our parameter ``key`` is a MoE layer's stacked routed-expert weight (E, in, out)."""
    return key.endswith(("feed_forward.experts.w1", "feed_forward.experts.w2", "feed_forward.experts.w3"))


def expert_hf_shape(want: tuple[int, ...], name: str) -> tuple[int, ...]:
    """The shape of the Hugging Face tensor ``name`` holding (part of) our expert weight of shape
    ``want`` (E, in, out): fused ``gate_up_proj`` (E, 2 out, in), fused ``down_proj`` (E, out, in),
    else one expert's (out, in)."""
    e, a, b = want
    if name.endswith("gate_up_proj"):
        return (e, 2 * b, a)
    if name.endswith("experts.down_proj"):
        return (e, b, a)
    return (b, a)


def fuse_gate_up(state_dict: dict, key: str, w1: str, w3: str, interleaved: bool) -> torch.Tensor | None:
    """The fused ``gate_up_proj`` (E, in, 2 out) that our ``key`` (``w1`` or ``w3`` of one layer, or
    their biases) exports to, gate and up as halves of the last dim or ``interleaved`` in its even and
    odd columns; None for a w3 whose w1 is in ``state_dict`` (that one exports the pair). Raises
    KeyError when one of the pair is missing: a half cannot be written alone."""
    if key == w3 and w1 in state_dict:
        return None
    if w1 not in state_dict or w3 not in state_dict:
        raise KeyError(f"{key}: w1 and w3 make one gate_up_proj; convert them together ({w1}, {w3})")
    gate, up = state_dict[w1], state_dict[w3]
    return torch.stack([gate, up], dim=-1).flatten(-2) if interleaved else torch.cat([gate, up], dim=-1)


def split_gate_up(key: str, t: torch.Tensor, interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of ``fuse_gate_up``: our gate (w1) and up (w3) from the Hugging Face tensor ``key``.
    Raises ValueError for an odd number of columns."""
    if t.shape[-1] % 2:
        pairs = "interleaved gate and up pairs" if interleaved else "gate and up halves"
        raise ValueError(f"{key}: {t.shape[-1]} columns are not {pairs}")
    gate, up = (t[..., 0::2], t[..., 1::2]) if interleaved else t.chunk(2, dim=-1)
    return gate.contiguous(), up.contiguous()


class HFAdapter:
    """The mapping of one family to Hugging Face (module docstring). Subclasses set ``title``,
    ``model_types``, ``key_map`` and implement ``config`` and ``args_from_config``."""

    title = "?"
    model_types: tuple[str, ...] = ()
    key_map: dict[str, str] = {}
    # Our buffer holding the MoE load-balancing bias, and its Hugging Face name (None: not stored).
    expert_bias_hf: str | None = None
    # The weight files' stem: transformers writes model.safetensors, diffusers diffusion_pytorch_model.safetensors.
    weights_name: str = "model"
    # Whether an export writes the run's tokenizer files beside the weights (a diffusers transformer
    # folder has none: its pipeline keeps the text encoders' tokenizers).
    tokenizer_files: bool = True

    def __init__(self) -> None:
        self._inverse = {v: k for k, v in self.key_map.items()}

    # -- config.json --

    def config(self, args, dtype: torch.dtype = torch.float32) -> dict:
        """The config.json of the Hugging Face model equal to ``args``; raises HFCheckpointError for a
        model its classes cannot express."""
        raise NotImplementedError

    def args_from_config(self, cfg: dict, where: str):
        """``(args, flavor)`` of a config.json (flavor "custom" when it matches none); raises
        HFCheckpointError, naming the field, for a model we cannot reproduce exactly."""
        raise NotImplementedError

    # -- names --

    def _rename(self, key: str, table: dict[str, str]) -> str:
        m = _LAYER_RE.search(key)
        pattern = key.replace(f".{m.group(1)}.", ".{}.", 1) if m else key
        if pattern not in table:
            raise KeyError(f"state dict key {key!r} has no Hugging Face {self.title} counterpart")
        return table[pattern].format(m.group(1)) if m else table[pattern]

    def hf_names(self, args, key: str, fused: bool = False) -> list[str]:
        """The Hugging Face tensors holding our parameter or buffer ``key``: one name, E names for a
        routed expert weight (``fused``: the one fused tensor), none for a buffer Hugging Face does not
        store. Raises KeyError for a key with no counterpart."""
        if key.endswith("feed_forward.expert_bias"):
            return [] if self.expert_bias_hf is None else [self._bias_name(key)]
        m = _EXPERT_RE.match(key)
        if m:
            layer, name = m.groups()
            if fused:
                return [f"model.layers.{layer}.mlp.experts.{_FUSED_HF[name]}"]
            return [f"model.layers.{layer}.mlp.experts.{e}.{_EXPERT_HF[name]}.weight" for e in range(self._experts(args))]
        return [self._rename(key, self.key_map)]

    def _bias_name(self, key: str) -> str:
        layer = _LAYER_RE.search(key).group(1)
        return self.expert_bias_hf.format(layer)

    @staticmethod
    def _experts(args) -> int:
        return args.moe.num_experts if args.moe is not None else 0

    def hf_shape(self, key: str, want: tuple[int, ...], name: str) -> tuple[int, ...]:
        """The shape the Hugging Face tensor ``name`` holding (part of) our ``key`` of shape ``want``
        must have: ``want`` itself (the rotary permutation keeps it), an expert's (``expert_hf_shape``)."""
        return expert_hf_shape(want, name) if is_expert(key) else want

    def export_group(self, key: str) -> tuple[str, ...]:
        """Our keys that convert together (GPT-OSS's w1 and w3 make one tensor); alone by default."""
        return (key,)

    # -- per-tensor layout (identity unless a family permutes) --

    def tensor_to_hf(self, key: str, t: torch.Tensor, args) -> torch.Tensor:
        return t

    def tensor_from_hf(self, key: str, t: torch.Tensor, args) -> torch.Tensor:
        return t

    # -- whole state dicts --

    def to_hf(self, state_dict: dict[str, torch.Tensor], args) -> dict[str, torch.Tensor]:
        """Our (full, unsharded) state dict -> Hugging Face names and layout; routed experts split into
        one (out, in) matrix per expert; tied models get ``lm_head.weight``. Raises KeyError for a key
        with no counterpart."""
        out = {}
        for key, t in state_dict.items():
            if key.endswith("feed_forward.expert_bias"):
                if self.expert_bias_hf is not None:
                    out[self._bias_name(key)] = t
                continue
            m = _EXPERT_RE.match(key)
            if m:
                for e in range(t.shape[0]):
                    out[f"model.layers.{m.group(1)}.mlp.experts.{e}.{_EXPERT_HF[m.group(2)]}.weight"] = \
                        t[e].t().contiguous()
                continue
            out[self._rename(key, self.key_map)] = self.tensor_to_hf(key, t, args)
        if args.tie_word_embeddings and "lm_head.weight" not in out and "model.embed_tokens.weight" in out:
            out["lm_head.weight"] = out["model.embed_tokens.weight"]
        return out

    def from_hf(self, state_dict: dict[str, torch.Tensor], args) -> dict[str, torch.Tensor]:
        """Inverse of ``to_hf``: per-expert matrices stacked into (E, in, out), or transformers' fused
        ``gate_up_proj`` / ``down_proj`` split and transposed; MoE layers without a stored bias get a
        zero ``expert_bias``. Raises KeyError for unknown keys, ValueError for a missing expert or a
        fused tensor of the wrong shape."""
        out, experts = {}, {}
        bias_re = None
        if self.expert_bias_hf is not None:
            bias_re = re.compile("^" + re.escape(self.expert_bias_hf).replace(r"\{\}", r"(\d+)") + "$")
        for key, t in state_dict.items():
            if key == "lm_head.weight" and args.tie_word_embeddings:
                continue
            if key.endswith("rotary_emb.inv_freq"):  # a buffer some Hugging Face checkpoints carry
                continue
            if bias_re is not None and bias_re.match(key):
                out[f"layers.{bias_re.match(key).group(1)}.feed_forward.expert_bias"] = t.float()
                continue
            m = _HF_EXPERT_RE.match(key)
            if m:
                experts.setdefault((int(m.group(1)), _EXPERT_OURS[m.group(3)]), {})[int(m.group(2))] = t
                continue
            m = _HF_FUSED_RE.match(key)
            if m:
                self._read_fused(out, int(m.group(1)), m.group(2), key, t)
                continue
            ours = self._rename(key, self._inverse)
            out[ours] = self.tensor_from_hf(ours, t, args)
        for (layer, name), by_expert in sorted(experts.items()):
            n = self._experts(args) or len(by_expert)
            missing = sorted(set(range(n)) - set(by_expert))
            if missing:
                raise ValueError(f"layer {layer}: Hugging Face experts {missing} of {n} missing ({_EXPERT_HF[name]})")
            out[f"layers.{layer}.feed_forward.experts.{name}"] = torch.stack([by_expert[e].t() for e in range(n)])
            out.setdefault(f"layers.{layer}.feed_forward.expert_bias", torch.zeros(n, dtype=torch.float32))
        return out

    @staticmethod
    def _read_fused(out: dict, layer: int, which: str, key: str, t: torch.Tensor) -> None:
        if t.dim() != 3:
            raise ValueError(f"{key}: expected a 3-D fused expert tensor, got shape {tuple(t.shape)}")
        base = f"layers.{layer}.feed_forward"
        if which == "gate_up_proj":
            if t.shape[1] % 2:
                raise ValueError(f"{key}: gate_up_proj rows {t.shape[1]} are not gate and up halves")
            gate, up = t.chunk(2, dim=1)
            out[f"{base}.experts.w1"] = gate.transpose(1, 2).contiguous()
            out[f"{base}.experts.w3"] = up.transpose(1, 2).contiguous()
        else:
            out[f"{base}.experts.w2"] = t.transpose(1, 2).contiguous()
        out.setdefault(f"{base}.expert_bias", torch.zeros(t.shape[0], dtype=torch.float32))

    # -- export checks --

    def export_warning(self, biased_layers: list[tuple[str, float]], out) -> str | None:
        """The warning for an export whose MoE layers hold a non-zero load-balancing bias that
        Hugging Face does not store (None when it stores it, or none is set)."""
        if not biased_layers or self.expert_bias_hf is not None:
            return None
        key, peak = max(biased_layers, key=lambda kv: kv[1])
        return (f"{out}: {len(biased_layers)} MoE layer(s) have a non-zero load-balancing expert_bias (largest |bias| "
                f"{peak:.3g}, {key}); Hugging Face {self.title} has none and picks the top-k experts by the router "
                f"scores alone, so the exported model routes some tokens differently from the trained one")


def check_field(cfg: dict, key: str, ok, expected: str, where: str) -> None:
    """Raise HFCheckpointError naming config.json's ``key`` unless ``ok``."""
    if not ok:
        raise HFCheckpointError(f"{where}: {key} {cfg.get(key)!r} is not supported (expected {expected})")
