"""``ModelArgs``: the hyperparameters every family shares, with typed defaults, and the analytic counts
of the shared decoder (parameters, active parameters, FLOPs per token) that the estimate, the
planner and the MFU read. Each family subclasses it (``trainer/models/<family>/args.py``), changing
defaults and adding its own fields; what the decoder reads has one name here.

Plain Python (no torch), so that the config, the estimate and ``python -m trainer.plan`` load fast.

FLOPs per token (``flops_per_token``): 6 x the active parameters a token multiplies by (the input
embedding is a lookup and is not counted unless tied to the output), plus attention counted per
score entry that the kernels compute: 6 * n_heads * (qk_head_dim + v_head_dim) FLOPs (Q K^T and P V,
forward and backward) for each unmasked (query, key) pair of a layer, averaged over the sequence's
tokens. A causal layer computes s (s + 1) / 2 entries, a sliding window of w about s w, a chunk its
own square (``attention_entries``). torchtitan counts s^2 for every layer (its
``6 * n_layers * n_heads * 2 * head_dim * seq_len``), so its MFU reads higher on the attention share
and passes 100% for sliding-window layers (torchtitan #4300); ours counts what runs.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

from trainer.models.common.moe_args import MoEArgs

LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")


def attention_entries(seq_len: int, causal: bool = True, window: int = -1, chunk: int = 0) -> int:
    """Unmasked (query, key) pairs of one head's attention over a sequence of ``seq_len`` tokens.

    ``causal``: query i sees keys j <= i; ``window`` (> 0): also j >= i - window + 1 (a sliding
    window of ``window`` keys including the query's own, as Hugging Face's ``sliding_window``);
    ``chunk`` (> 0): keys of the query's own chunk of ``chunk`` positions only (Llama 4's local
    attention). Exact integer counts (tests/trainer/test_flops.py checks them against a mask).
    """
    s = seq_len
    if chunk > 0:
        full, rest = divmod(s, chunk)
        return full * attention_entries(chunk, causal, window) + (attention_entries(rest, causal, window) if rest else 0)
    if not causal:
        if window > 0:
            raise ValueError("attention_entries: a window is defined for causal attention only")
        return s * s
    if window <= 0 or window >= s:
        return s * (s + 1) // 2
    # rows i < window see i + 1 keys, the rest see window keys
    return window * (window + 1) // 2 + (s - window) * window


@dataclass(frozen=True)
class ModelArgs:
    """Hyperparameters of a model of the shared decoder (``trainer.models.common.decoder``); the families'
    args subclass it (names as in Meta's reference code and torchtitan).

    ``head_dim`` None means ``dim // n_heads``; ``n_kv_heads`` None means ``n_heads``;
    ``vocab_size = -1`` means "take it from the tokenizer" (the debug flavors). ``qk_norm``: an
    RMSNorm over head_dim on every query and key head before the rotary (Qwen3); ``attention_bias``:
    biases on wq/wk/wv/wo; ``attention_sinks``: a learned sink logit per head joining each row's
    softmax (GPT-OSS). ``moe``: the
    mixture-of-experts feed-forward of every layer from ``n_dense_layers`` on (None: dense).
    ``layer_types``: per layer ``full_attention`` / ``sliding_attention`` (a window of
    ``sliding_window`` keys, the query's own included) / ``chunked_attention`` (``attention_chunk``
    positions); empty = all full. ``init_std``: the standard deviation of every weight matrix except
    the residual output projections, which are scaled down with depth (``depth_init``:
    0.02/sqrt(2*(layer_id+1)), as torchtitan; otherwise 0.02/sqrt(2*n_layers), GPT-2 sec. 2.3).
    """

    dim: int = 256
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int | None = None
    head_dim: int | None = None
    vocab_size: int = -1
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_seq_len: int = 8192
    tie_word_embeddings: bool = False
    qk_norm: bool = False
    attention_bias: bool = False
    attention_sinks: bool = False
    sliding_window: int = 0
    attention_chunk: int = 0
    layer_types: tuple[str, ...] = ()
    moe: MoEArgs | None = None
    n_dense_layers: int = 0
    init_std: float = 0.02
    depth_init: bool = True

    # Fields that fix tensor shapes (a checkpoint with other values cannot load); the others change
    # the math only. A family adds its own.
    SHAPE_FIELDS: ClassVar[tuple[str, ...]] = (
        "dim", "n_layers", "n_heads", "kv_heads", "head_dim", "ffn_hidden_dim", "vocab_size", "tie_word_embeddings",
        "qk_norm", "attention_bias", "attention_sinks", "n_dense_layers", "moe.num_experts", "moe.hidden_dim",
        "moe.num_shared_experts", "moe.router_bias", "moe.expert_proj_bias")
    # What ``extra_params`` are (e.g. MTP), for messages.
    EXTRA_NAME: ClassVar[str] = "extra"
    # Whether the publisher's "active parameters" count the input embedding (Qwen does; DeepSeek and
    # OpenAI count the weights a token multiplies by, without the lookup).
    ACTIVE_INCLUDES_EMBEDDING: ClassVar[bool] = True
    # Fields that neither shape nor change the math of a trained model.
    IGNORED_FIELDS: ClassVar[tuple[str, ...]] = ("max_seq_len", "init_std", "depth_init", "moe.load_balance",
                                                 "moe.bias_update_rate", "moe.aux_loss_coeff")

    # Options of a run's configuration that only some models use: "section.key" -> (whether this model
    # uses it, why not when it does not). An option given (not at its default) to a model that does not
    # use it is refused (``unused_options``), never ignored. A family extends the table.
    OPTIONS: ClassVar[dict] = {
        "model.moe_load_balance": (lambda a: a.moe is not None, "has no mixture of experts"),
        "model.moe_bias_update_rate": (lambda a: a.moe is not None and a.moe.load_balance == "bias",
                                       "balances no experts by a routing bias (--model.moe_load_balance bias)"),
        "model.moe_aux_loss_coeff": (lambda a: a.moe is not None and a.moe.load_balance == "aux_loss",
                                     "balances no experts by an auxiliary loss (--model.moe_load_balance aux_loss)"),
        "parallelism.expert_parallel_degree": (lambda a: a.moe is not None, "has no experts to split"),
        "model.mtp_layers": (lambda a: False, "has no multi-token prediction modules (deepseek_v3 has)"),
        "training.mtp_loss_weight": (lambda a: getattr(a, "num_mtp_layers", 0) > 0,
                                     "has no multi-token prediction modules to weigh"),
        "optimizer.qk_clip_threshold": (lambda a: not a.qk_norm, "has QK-norm: its attention logits do not scale "
                                        "with W_q/W_k, so QK-clip cannot bound them"),
    }

    def unused_options(self, config) -> list[tuple[str, str]]:
        """``(key, why this model does not use it)`` for each option of ``OPTIONS`` that ``config`` (a
        ``trainer.config.JobConfig``) sets away from its default."""
        defaults = type(config)()
        out = []
        for key, (uses, why) in self.OPTIONS.items():
            section, _, name = key.partition(".")
            if getattr(getattr(config, section), name) != getattr(getattr(defaults, section), name) and not uses(self):
                out.append((key, why))
        return out

    def __post_init__(self) -> None:
        if isinstance(self.moe, dict):  # read back from a checkpoint's JSON record
            moe = dict(self.moe)
            if moe.get("swiglu_limit") == 0.0 and not moe.get("swiglu_up_offset"):
                moe["swiglu_limit"] = None  # records before None existed wrote 0 for a plain SwiGLU's "no clamp"
            object.__setattr__(self, "moe", MoEArgs(**moe))
        if isinstance(self.layer_types, list):
            object.__setattr__(self, "layer_types", tuple(self.layer_types))
        name = type(self).__name__
        for key in ("dim", "n_layers", "n_heads", "max_seq_len"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}.{key}: expected an integer >= 1, got {v!r}")
        # head_dim None: dim // n_heads, and it stays derived (replace() with another dim re-derives it).
        object.__setattr__(self, "_derived_head_dim", self.head_dim is None)
        if self.head_dim is None:
            if self.dim % self.n_heads:
                raise ValueError(f"{name}.dim: expected a multiple of n_heads={self.n_heads} (or a head_dim), got "
                                 f"{self.dim}")
            object.__setattr__(self, "head_dim", self.dim // self.n_heads)
        if isinstance(self.head_dim, bool) or not isinstance(self.head_dim, int) or self.head_dim < 1:
            raise ValueError(f"{name}.head_dim: expected an integer >= 1, got {self.head_dim!r}")
        if self.head_dim % 2:
            raise ValueError(f"{name}.head_dim: must be even for rotary, got {self.head_dim}")
        if self.kv_heads < 1 or self.n_heads % self.kv_heads:
            raise ValueError(f"{name}.n_kv_heads: expected a divisor of n_heads={self.n_heads}, got {self.n_kv_heads}")
        if self.vocab_size != -1 and (isinstance(self.vocab_size, bool) or not isinstance(self.vocab_size, int)
                                      or self.vocab_size < 1):
            raise ValueError(f"{name}.vocab_size: expected -1 (from the tokenizer) or >= 1, got {self.vocab_size}")
        if not 0 <= self.n_dense_layers <= self.n_layers:
            raise ValueError(f"{name}.n_dense_layers: expected 0..{self.n_layers}, got {self.n_dense_layers}")
        if self.layer_types:
            if len(self.layer_types) != self.n_layers:
                raise ValueError(f"{name}.layer_types: expected {self.n_layers} entries (one per layer), got "
                                 f"{len(self.layer_types)}")
            bad = sorted(set(self.layer_types) - set(LAYER_TYPES))
            if bad:
                raise ValueError(f"{name}.layer_types: expected entries of {', '.join(LAYER_TYPES)}, got {bad[0]!r}")
            if "sliding_attention" in self.layer_types and self.sliding_window < 1:
                raise ValueError(f"{name}.sliding_window: sliding_attention layers need a window >= 1, got "
                                 f"{self.sliding_window}")
            if "chunked_attention" in self.layer_types and self.attention_chunk < 1:
                raise ValueError(f"{name}.attention_chunk: chunked_attention layers need a chunk >= 1, got "
                                 f"{self.attention_chunk}")

    # -- shape of the model --

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def ffn_hidden_dim(self) -> int:
        """The dense SwiGLU hidden size (a family defines it)."""
        raise NotImplementedError(f"{type(self).__name__} defines no ffn_hidden_dim")

    @property
    def qk_head_dim(self) -> int:
        """The head_dim of queries and keys (what the softmax scale is computed from)."""
        return self.head_dim

    @property
    def v_head_dim(self) -> int:
        """The head_dim of values (and of attention's output per head)."""
        return self.head_dim

    @property
    def is_moe(self) -> bool:
        return self.moe is not None

    def moe_layer(self, layer_id: int) -> bool:
        """Whether block ``layer_id`` has a mixture-of-experts feed-forward."""
        return self.moe is not None and layer_id >= self.n_dense_layers

    @property
    def n_moe_layers(self) -> int:
        return 0 if self.moe is None else self.n_layers - self.n_dense_layers

    def layer_type(self, layer_id: int) -> str:
        return self.layer_types[layer_id] if self.layer_types else "full_attention"

    def attention_window(self, layer_id: int) -> tuple[int, int]:
        """``(window_size, chunk_size)`` of layer ``layer_id`` for ``titan_kernels.flash_attn``:
        window_size = (left, 0) for a sliding layer (left = sliding_window - 1: the window holds the
        query's own key), (-1, 0) otherwise (causal); chunk_size 0 except in a chunked layer."""
        kind = self.layer_type(layer_id)
        if kind == "sliding_attention":
            return (self.sliding_window - 1, 0), 0
        if kind == "chunked_attention":
            return (-1, 0), self.attention_chunk
        return (-1, 0), 0

    def tp_divisible(self) -> dict[str, int]:
        """The sizes tensor parallel splits evenly (name -> size): heads, FFN widths, vocabulary."""
        out = {"n_heads": self.n_heads, "n_kv_heads": self.kv_heads, "vocab_size": self.vocab_size}
        if self.n_layers > self.n_moe_layers:
            out["ffn_hidden_dim"] = self.ffn_hidden_dim
        if self.moe is not None:
            out["moe.hidden_dim"] = self.moe.hidden_dim
        return out

    # -- construction --

    def replace(self, **changes):
        if self._derived_head_dim and "head_dim" not in changes:
            changes["head_dim"] = None
        return dataclasses.replace(self, **changes)

    def record(self) -> dict:
        """The JSON-able fields (a derived head_dim as None, so that it stays derived when read back)."""
        out = dataclasses.asdict(self)
        if self._derived_head_dim:
            out["head_dim"] = None
        return out

    @classmethod
    def from_record(cls, fields: dict):
        """The args of a checkpoint's record (``dataclasses.asdict`` of them); fields a newer version
        added take their defaults. Raises ValueError for unknown fields."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(fields) - known)
        if unknown:
            raise ValueError(f"{cls.__name__}: unknown fields {', '.join(unknown)} (a checkpoint of a newer version?)")
        return cls(**fields)

    def configure(self, model_config):
        """These args adjusted by the ``[model]`` config section: the MoE load-balancing keys."""
        if self.moe is None:
            return self
        return self.replace(moe=self.moe.replace(
            load_balance=model_config.moe_load_balance, bias_update_rate=model_config.moe_bias_update_rate,
            aux_loss_coeff=model_config.moe_aux_loss_coeff))

    # -- analytic counts (no model needed; the estimate, the planner and the MFU) --

    def embedding_params(self) -> int:
        return self.vocab_size * self.dim

    def output_params(self) -> int:
        """The output projection's parameters (0 when tied to the embedding)."""
        return 0 if self.tie_word_embeddings else self.embedding_params()

    def loss_vocab_size(self) -> int:
        """The classes of the loss's softmax (what the loss's memory and communication scale with);
        0 for a model whose loss is no cross-entropy."""
        return self.vocab_size

    def attention_params(self) -> int:
        """wq, wk, wv, wo (and the QK-norm weights, biases, sinks)."""
        q, kv = self.n_heads * self.head_dim, self.kv_heads * self.head_dim
        out = 2 * self.dim * q + 2 * self.dim * kv + (2 * self.head_dim if self.qk_norm else 0)
        if self.attention_bias:
            out += q + 2 * kv + self.dim
        return out + (self.n_heads if self.attention_sinks else 0)

    def ffn_params(self) -> int:
        return 3 * self.dim * self.ffn_hidden_dim

    def dense_layer_params(self) -> int:
        return self.attention_params() + self.ffn_params() + 2 * self.dim

    def moe_layer_params(self, active: bool = False) -> int:
        m = self.moe
        return self.attention_params() + (m.active_params(self.dim) if active else m.total_params(self.dim)) \
            + 2 * self.dim

    def layer_params(self) -> int:
        """Parameters of one block (a MoE block, all its experts, when the model has any)."""
        return self.dense_layer_params() if self.moe is None else self.moe_layer_params()

    def expert_params(self) -> int:
        """All routed-expert weights of the model (what expert parallel splits)."""
        return 0 if self.moe is None else self.n_moe_layers * self.moe.expert_params(self.dim)

    def extra_params(self, active: bool = False) -> int:
        """Parameters outside the layers, embedding and output (a family's extra modules, e.g. MTP)."""
        return 0

    def _count(self, active: bool) -> int:
        self._need_vocab()
        out = 0 if self.tie_word_embeddings else self.vocab_size * self.dim
        n_moe = self.n_moe_layers
        layers = (self.n_layers - n_moe) * self.dense_layer_params()
        if n_moe:
            layers += n_moe * self.moe_layer_params(active)
        return self.embedding_params() + layers + self.dim + out + self.extra_params(active)

    def num_params(self) -> int:
        """Total trainable parameters (the tied output weight counted once)."""
        return self._count(active=False)

    def active_params(self) -> int:
        """Parameters one token uses, as the family's publisher counts them (``ACTIVE_INCLUDES_EMBEDDING``):
        the 'A3B' of 30B-A3B; for a dense model counting the embedding, num_params."""
        return self._count(active=True) - (0 if self.ACTIVE_INCLUDES_EMBEDDING else self.embedding_params())

    def attention_flops_per_token(self, seq_len: int) -> float:
        """Attention's training FLOPs per token over all layers (module docstring): each unmasked
        score entry costs 6 * n_heads * (qk_head_dim + v_head_dim)."""
        per_entry = 6 * self.n_heads * (self.qk_head_dim + self.v_head_dim)
        cache: dict[tuple, int] = {}
        total = 0
        for i in range(self.attention_layers()):
            (left, _), chunk = self.attention_window(i)
            key = (left, chunk)
            if key not in cache:
                cache[key] = attention_entries(seq_len, True, left + 1 if left >= 0 else -1, chunk)
            total += cache[key]
        return per_entry * total / seq_len

    def attention_saved_values(self) -> tuple[int, int]:
        """Values per token autograd keeps for one attention layer: ``(whole, per_head)``, where
        ``per_head`` is split over tensor-parallel ranks (q, the attention output, k, v, the log-sum-exp)
        and ``whole`` is kept on every rank (nothing for GQA)."""
        q, kv = self.n_heads * self.qk_head_dim, self.kv_heads * self.head_dim
        return 0, 2 * q + 2 * kv + self.n_heads

    def pipeline_refusal(self) -> str | None:
        """Why this model cannot be split into pipeline stages, or None."""
        return None

    def attention_layers(self) -> int:
        """Layers with attention that a token's FLOPs count (a family adds e.g. its MTP blocks)."""
        return self.n_layers

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6 * active parameters (without the embedding lookup) + attention
        (module docstring)."""
        n = self._count(active=True) - (0 if self.tie_word_embeddings else self.embedding_params())
        return 6 * n + self.attention_flops_per_token(seq_len)

    def _need_vocab(self) -> None:
        if self.vocab_size < 1:
            raise ValueError(f"{type(self).__name__}.vocab_size: not set; take it from the tokenizer first")


def format_params(args) -> str:
    """``30.53e9 parameters (3.35e9 active)`` for a MoE model, ``8.19e9 parameters`` for a dense one;
    a family's extra modules apart: ``671.03e9 parameters + 11.61e9 MTP (37.55e9 active)``."""
    extra = args.extra_params()
    total, active = args.num_params() - extra, args.active_params() - args.extra_params(active=True)
    def fmt(n: int) -> str:  # the debug flavors in millions, trillions as such
        exp = 12 if n >= 1e12 else 9 if n >= 1e9 or n >= total / 1000 >= 1e9 else 6
        return f"{n / 10**exp:.2f}e{exp}"

    text = f"{fmt(total)} parameters"
    if extra:
        text += f" + {fmt(extra)} {args.EXTRA_NAME}"
    if args.moe is not None:
        text += f" ({fmt(active)} active)"
    return text
